"""The documentation covers the package: every public name, every public exception."""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Iterator
from pathlib import Path

import crossdevice

DOCS = Path(__file__).resolve().parents[2] / "docs"


def public_objects(
    module: types.ModuleType = crossdevice, prefix: str = "crossdevice"
) -> Iterator[tuple[str, object]]:
    """`(dotted name, object)` for every public name of `module` and its public submodules."""
    seen: set[int] = set()
    stack = [(module, prefix)]
    while stack:
        mod, name = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        for attr in getattr(mod, "__all__", [n for n in dir(mod) if not n.startswith("_")]):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr)
            dotted = f"{name}.{attr}"
            if isinstance(obj, types.ModuleType):
                if obj.__name__.startswith("crossdevice"):
                    stack.append((obj, dotted))
                continue
            yield dotted, obj


def public_exception_classes() -> dict[str, type[BaseException]]:
    return {
        name: obj
        for name, obj in public_objects()
        if inspect.isclass(obj) and issubclass(obj, Exception)
    }


def test_troubleshooting_names_every_public_exception_class() -> None:
    exceptions = public_exception_classes()
    assert "crossdevice.CollectiveTimeoutError" in exceptions  # the walk finds them
    page = (DOCS / "troubleshooting.md").read_text()
    missing = [
        name
        for name, cls in exceptions.items()
        if not re.search(rf"^#+ .*\b{cls.__name__}\b", page, re.MULTILINE)
    ]
    assert not missing, f"troubleshooting.md has no section (a heading) for {missing}"


def test_reference_lists_every_public_name() -> None:
    page = (DOCS / "reference.md").read_text()
    directives = set(re.findall(r"^::: (\S+)$", page, re.MULTILINE))
    modules = {d for d in directives if isinstance(_resolve(d), types.ModuleType)}
    documented = {id(_resolve(d)) for d in directives}  # one entry covers every alias
    missing = [
        name
        for name, obj in public_objects()
        if id(obj) not in documented and not any(name.startswith(m + ".") for m in modules)
    ]
    assert not missing, f"docs/reference.md has no `::: name` entry for {missing}"


def _resolve(dotted: str) -> object:
    import importlib

    obj: object = crossdevice
    parts = dotted.split(".")
    for k, part in enumerate(parts[1:], start=1):
        if not hasattr(obj, part):  # a submodule imported only on request (crossdevice.torch)
            importlib.import_module(".".join(parts[: k + 1]))
        obj = getattr(obj, part)
    return obj
