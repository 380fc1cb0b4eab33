"""The examples in the docstrings (what `help()` and the API reference show) run as written."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import crossdevice

#: Every module of the package but `__main__`, which runs the command line on import.
MODULES = sorted(
    ["crossdevice"]
    + [
        info.name
        for info in pkgutil.walk_packages(crossdevice.__path__, "crossdevice.")
        if not info.name.endswith("__main__")
    ]
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for test in finder.find(module, name):
        runner.run(test, out=report.append)
    assert not runner.failures, "".join(report)
