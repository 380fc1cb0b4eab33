"""`call_site`: the user's line that asked for a cross-worker reduction.

Every worker runs the same program, so the same reduction comes from the same line
everywhere; it is part of what the workers compare, with the values' shapes. Code that
reduces on the user's behalf from places the walk cannot name alike on every worker
gives a fixed site instead (`purpose(site=...)`): `crossdevice.torch`'s gradient
buckets are issued from a backward hook inside torch's autograd engine, or at the end
of the backward pass when a parameter got no gradient (a branch one worker did not
take), and the walk named torch's own frames there, a different one in each case: a
false mismatch between workers that trained correctly.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import types
from typing import Final

import optree

from crossdevice._core.purpose import fixed_site

__all__ = ["call_site"]

_PACKAGE_DIR: Final = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THREADING_FILE: Final = threading.__file__
_RUNNER_FILE: Final = os.path.join(_PACKAGE_DIR, "_replica", "runner.py")
#: optree's tree functions call back into the package (a reduction of each leaf): walked
#: past, so the site is the user's line, not optree's.
_OPTREE_DIR: Final = os.path.dirname(os.path.abspath(optree.__file__))

#: `_file_kind`'s verdicts on a frame's file: walk on past it, or stop (no site).
_WALK: Final = 0
_STOP: Final = 1


@functools.lru_cache(maxsize=1024)
def _file_kind(name: str) -> str | int:
    """What `call_site` makes of a frame of file `name`: `_WALK`, `_STOP`, or its base name."""
    if name == _RUNNER_FILE or name.startswith("<frozen"):
        return _STOP
    if name.startswith((_PACKAGE_DIR, _OPTREE_DIR)) or name == _THREADING_FILE:
        return _WALK
    return os.path.basename(name)


def call_site() -> tuple[str, str, int] | None:
    """The user's line that asked for this reduction: file name, function, line.

    Every worker runs the same program, so the same reduction comes from the same line
    everywhere; two reductions of equal shapes issued in a different order on two
    workers differ here (the fault campaign's swapped all-reduces). Only the file's base
    name counts: workers may install the program in different directories.

    The walk stops at the replica runner: below it lies whatever thread happens to run
    a merge (the caller's or a replica's), which differs from worker to worker. A
    reduction with no user frame above the runner (an internal merge) has no site.
    Inside `purpose(site=...)`, that site.
    """
    fixed = fixed_site()
    if fixed is not None:
        return fixed
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        kind = _file_kind(code.co_filename)
        if kind != _WALK:
            return None if kind == _STOP else (kind, code.co_name, frame.f_lineno)  # type: ignore[return-value]
        frame = frame.f_back
    return None
