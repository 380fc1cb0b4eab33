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
