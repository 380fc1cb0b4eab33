"""`strategy.run`'s results: the NumPy fast path regroups exactly as `regroup` does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._strategies.replicated import _regroup_numpy
from crossdevice._values.regroup import regroup
from crossdevice._values.values import PerReplica

DEVICES = (
    "/job:localhost/replica:0/task:0/device:CPU:0",
    "/job:localhost/replica:0/task:0/device:CPU:1",
)
SHARED = np.ones(3, np.float32)
SCALAR = np.float32(2.0)

CASES = {
    "one-shared-array": [SHARED, SHARED],
    "arrays": [np.zeros(2), np.ones(2)],
    "one-shared-scalar": [SCALAR, SCALAR],
    "scalars": [np.float32(1.0), np.float32(1.0)],
    "array-and-scalar": [SHARED, SCALAR],
}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, PerReplica):
        return (
            type(b) is PerReplica
            and a._devices == b._devices
            and all(x is y for x, y in zip(a.values, b.values, strict=True))
        )
    return a is b


@pytest.mark.parametrize("results", CASES.values(), ids=CASES.keys())
def test_numpy_results_regroup_as_regroup_does(results: list[Any]) -> None:
    fast = _regroup_numpy(results, DEVICES)
    assert fast is not None
    assert _same(fast, regroup(results, PerReplica, False, DEVICES, collapse_arrays=False))


@pytest.mark.parametrize(
    "results",
    [[1.0, 1.0], [SHARED, None], [[SHARED], [SHARED]], [SHARED]],
    ids=["floats", "array-and-none", "nests", "one-replica"],
)
def test_other_results_take_regroup(results: list[Any]) -> None:
    assert _regroup_numpy(results, DEVICES[: len(results)]) is None


def test_run_returns_a_shared_all_reduce_result_per_replica() -> None:
    with cd.MirroredStrategy(["CPU:0", "CPU:1"]) as strategy:
        out = strategy.run(lambda: cd.get_replica_context().all_reduce("sum", SHARED))
        assert isinstance(out, PerReplica)
        assert [x.tolist() for x in strategy.experimental_local_results(out)] == [[2.0] * 3] * 2
        assert strategy.run(lambda: SCALAR) is SCALAR
