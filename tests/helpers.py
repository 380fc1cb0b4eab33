"""Helpers shared by the test suites."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from crossdevice._arrays import backend_for


def parametrize(**axes: list[Any]) -> Any:
    """Cartesian product of named axes with readable ids (optree's tests/helpers.py)."""
    names = list(axes)
    combos = list(itertools.product(*axes.values()))
    ids = ["-".join(f"{n}={v}" for n, v in zip(names, c, strict=True)) for c in combos]
    return pytest.mark.parametrize(",".join(names), combos, ids=ids)


def to_numpy(x: Any) -> np.ndarray:
    """Any array value (NumPy, torch, Mirrored, Variable) as a NumPy array."""
    from crossdevice._values.values import DistributedValues

    if isinstance(x, DistributedValues):
        x = x._get_on_device_or_primary()
    if hasattr(x, "_value"):
        x = x._value
    return np.asarray(backend_for(x).to_numpy(x))


def assert_allclose(actual: Any, expected: Any, **kw: Any) -> None:
    """`np.testing.assert_allclose` over any array value."""
    np.testing.assert_allclose(to_numpy(actual), np.asarray(expected), **kw)


def within(seconds: float, fn: Any, *args: Any) -> Any:
    """`fn(*args)` on a helper thread: its result, its exception, or a failure if it hangs.

    For tests of calls that once blocked for ever: a regression fails the test in
    `seconds` instead of leaving it to the suite's timeout (the stuck daemon thread is
    abandoned).
    """
    import threading

    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # re-raised on the test's thread
            box["error"] = exc

    thread = threading.Thread(target=body, daemon=True, name="test-within")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)!s} did not return within {seconds} s (a hang)")
    if "error" in box:
        raise box["error"]
    return box["result"]
