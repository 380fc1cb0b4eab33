"""`__module__` of re-exported names points at the public module (trio's fixup)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["fix_module_metadata"]


def fix_module_metadata(namespace: Mapping[str, Any], names: Iterable[str], public: str) -> None:
    """Set `__module__` of each re-exported object defined in a private module to `public`.

    Tracebacks and reprs then say `crossdevice.MirroredStrategy`, not a private module.
    """
    for name in names:
        obj = namespace[name]
        if getattr(obj, "__module__", "").startswith("crossdevice._"):
            obj.__module__ = public
