"""Imports go down the layers of docs/design.md §2, at top level and inside functions alike.

The test reads every module of `src/crossdevice` (its AST, so imports inside functions and
under `TYPE_CHECKING` count as much as those at the top) and fails on any import of a
crossdevice module from a higher layer, and on any cycle of imports between modules,
inside one package too: within a layer, imports go down as well. Optional third-party
imports (torch) are not crossdevice modules and may be lazy anywhere. No module is
longer than `MAX_LINES`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import crossdevice

#: Layer of each package or public module: a module may import only lower layers (or its
#: own package). `_input` sits below the strategies (it needs only values and arrays).
LAYERS: dict[str, float] = {
    "_core": 1,
    "cluster_resolver": 2,
    "_arrays": 3,
    "_data": 3,
    "_values": 4,
    "_sync": 2,
    # Tracing's switch, recorder and flight recorder: the rendezvous' hooks call them.
    "_trace": 1.5,
    "_comm": 5,
    "_cross_device": 6,
    "_replica": 7,
    "_input": 8,
    "_strategies": 9,
    # Checkpoints (crossdevice.train) save strategies' objects; experimental re-exports them.
    "_train": 9.5,
    "config": 10,
    "experimental": 10,
    "train": 10,
    "datasets": 10,
    "nn": 10,
    # Frameworks (docs/design.md §2, layer 10): torch training on the strategies.
    "_frameworks": 10,
    "__init__": 11,
    "torch": 11,  # the public face of _frameworks.torch, imported on request
    # The command line is off the library's import path: it may use the public package.
    "_cli": 12,
    "__main__": 13,
}

ROOT = Path(crossdevice.__file__).parent

#: Longest module allowed (docs/design.md: one concept per module, 100-400 lines preferred).
MAX_LINES = 600


def _unit(module: str) -> str:
    """`crossdevice._strategies.base` -> `_strategies`; `crossdevice` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path, module: str, *, names: bool = False) -> list[tuple[int, str]]:
    """(line, imported crossdevice module) for every import in `path`.

    With `names`, `from package import name` also yields `package.name` (a submodule, when
    it is one; `_module_of` tells).
    """
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from crossdevice import _strategies` imports a package by name.
            if target == "crossdevice" or names:
                found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "crossdevice"]


def _modules() -> list[tuple[Path, str]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(relative.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((path, ".".join(parts)))
    return out


def _upward_imports() -> list[str]:
    bad = []
    for path, module in _modules():
        unit = _unit(module) if module != "crossdevice" else "__init__"
        for line, target in _imports(path, module):
            other = _unit(target)
            if other == unit or (other == "__init__" and target != "crossdevice"):
                continue
            if LAYERS[other] >= LAYERS[unit]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} ({unit}) imports {target}")
    return bad


def test_every_package_has_a_layer() -> None:
    units = {_unit(module) for _, module in _modules()}
    assert units <= set(LAYERS), units - set(LAYERS)


def test_no_import_goes_up_the_layers() -> None:
    assert _upward_imports() == []


def test_the_check_sees_function_level_imports(tmp_path: Path) -> None:
    """The walk must not look at the top level only (a lazy import hides nothing)."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from crossdevice._strategies import base\n")
    assert _imports(path, "crossdevice._core.probe") == [(2, "crossdevice._strategies")]


def _module_of(name: str, modules: set[str]) -> str | None:
    """The module `name` (a module, or a name inside one) belongs to."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    """Module -> the crossdevice modules it imports.

    The bare parent package of a `from package.sub import x` is left out (importing a
    submodule imports its parents, which is no dependency of one's own), but a name taken
    from a parent package's `__init__` (`from crossdevice._arrays import is_torch` inside
    `crossdevice._arrays.numpy_backend`) is an edge like any other.
    """
    paths = {module: path for path, module in _modules()}
    # Compiled extensions (built from a .c file beside them) are modules that import nothing.
    extensions = {
        ".".join(c.relative_to(ROOT.parent).with_suffix("").parts) for c in ROOT.rglob("*.c")
    }
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets = set()
        for _, name in _imports(path, module, names=True):
            target = _module_of(name, set(paths) | extensions)
            if target in extensions:
                continue
            if target is None or target == module:
                continue
            if module.startswith(target + ".") and name == target:
                continue  # the implicit import of a parent package
            targets.add(target)
        graph[module] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_anywhere() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_check_sees_a_cycle_inside_a_package() -> None:
    """A cycle between two modules of one package, through a `from package import name`."""
    graph = {"crossdevice.p.a": {"crossdevice.p.b"}, "crossdevice.p.b": {"crossdevice.p.a"}}
    assert _cycles(graph) == [["crossdevice.p.a", "crossdevice.p.b"]]
    assert _cycles({"crossdevice.p.a": {"crossdevice.p.b"}, "crossdevice.p.b": set()}) == []


def test_no_module_is_over_the_line_cap() -> None:
    long = {
        str(path.relative_to(ROOT.parent)): n
        for path, _ in _modules()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
