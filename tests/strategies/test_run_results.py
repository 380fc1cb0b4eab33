"""`strategy.run`'s results: TF's regroup rules, and the NumPy fast path agrees with them.

The same object from every replica is one value (TF: a captured constant, what one
`merge_fn` returned); a collective's result stays per-replica even where our replicas
share its buffer (TF gives each replica a tensor of its own).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._arrays.handout import mark_shared
from crossdevice._strategies.replicated import _regroup_numpy
from crossdevice._values.regroup import regroup
from crossdevice._values.values import PerReplica
from tests.helpers import to_numpy

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
    assert _same(fast, regroup(results, PerReplica, False, DEVICES))


@pytest.mark.parametrize(
    "results",
    [[1.0, 1.0], [SHARED, None], [[SHARED], [SHARED]], [SHARED]],
    ids=["floats", "array-and-none", "nests", "one-replica"],
)
def test_other_results_take_regroup(results: list[Any]) -> None:
    assert _regroup_numpy(results, DEVICES[: len(results)]) is None


def test_the_fast_path_keeps_a_shared_result_per_replica() -> None:
    shared = np.ones(2)
    mark_shared(shared)
    fast = _regroup_numpy([shared, shared], DEVICES)
    assert type(fast) is PerReplica
    assert _same(fast, regroup([shared, shared], PerReplica, False, DEVICES))


def test_run_returns_a_shared_all_reduce_result_per_replica() -> None:
    with cd.MirroredStrategy(["CPU:0", "CPU:1"]) as strategy:
        out = strategy.run(lambda: cd.get_replica_context().all_reduce("sum", SHARED))
        assert isinstance(out, PerReplica)
        assert [x.tolist() for x in strategy.experimental_local_results(out)] == [[2.0] * 3] * 2
        assert strategy.run(lambda: SCALAR) is SCALAR


def _replicas(strategy: Any) -> int:
    return len(strategy.extended.worker_devices)


def test_one_object_from_every_replica_is_one_value(strategy: Any, backend: Any) -> None:
    # TF (p16): `run(lambda: W)` gives W itself: one local result, gather gives W, and a
    # SUM raises (summing one value N times is not defined); the same for an argument
    # passed through and for what one merge_fn returned.
    constant = backend.make(np.array([1.0, 2.0], np.float32))
    ctx = cd.get_replica_context
    for fn, args in [
        (lambda: constant, ()),
        (lambda x: x, (constant,)),
        (lambda: ctx().merge_call(lambda _: constant), ()),
    ]:
        out = strategy.run(fn, args=args)
        assert out is constant
        assert strategy.experimental_local_results(out) == (constant,)
        assert strategy.gather(out, axis=0) is constant
        if _replicas(strategy) > 1:
            with pytest.raises(ValueError, match="cannot be reduced"):
                strategy.reduce("sum", out, axis=None)
    # A plain value's per-axis sum counts once per replica (TF runs it in each): 3 * N.
    expected = 3.0 * strategy.num_replicas_in_sync
    assert float(to_numpy(strategy.reduce("sum", constant, axis=0))) == expected
    assert float(to_numpy(strategy.reduce("mean", constant, axis=0))) == 1.5
    scalar = backend.make(np.array(4.0, np.float32))
    assert strategy.gather(scalar, axis=0) is scalar  # TF returns a plain value as it is


def _collectives(backend: Any) -> dict[str, Any]:
    ctx = cd.get_replica_context

    def mine() -> Any:
        return backend.make(np.array([1.0, 2.0], np.float32) * (ctx().replica_id_in_sync_group + 1))

    def merged(fn: Any) -> Any:
        return lambda: ctx().merge_call(fn, args=(mine(),))

    return {
        "all_reduce": lambda: ctx().all_reduce("sum", mine()),
        "all_reduce_nest": lambda: ctx().all_reduce("sum", {"a": mine(), "b": [mine()]}),
        "all_reduce_int_mean_0d": lambda: ctx().all_reduce(
            "mean", backend.make(np.array(ctx().replica_id_in_sync_group + 1, np.int32))
        ),
        "all_reduce_int_mean_1d": lambda: ctx().all_reduce(
            "mean", backend.make(np.array([ctx().replica_id_in_sync_group + 1], np.int64))
        ),
        "all_gather": lambda: ctx().all_gather(mine(), axis=0),
        "batch_reduce_to": merged(
            lambda s, x: s.extended.batch_reduce_to("sum", [(x, x), (x, x)])[1]
        ),
        "reduce_to_replicas": merged(lambda s, x: s.extended.reduce_to("sum", x, x)),
        "broadcast": merged(
            lambda s, x: cd.ReductionToOneDevice().broadcast(s.experimental_local_results(x)[0], x)
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        "all_reduce",
        "all_reduce_nest",
        "all_reduce_int_mean_0d",
        "all_reduce_int_mean_1d",
        "all_gather",
        "batch_reduce_to",
        "reduce_to_replicas",
        "broadcast",
    ],
)
def test_collective_results_stay_per_replica(strategy: Any, backend: Any, name: str) -> None:
    # TF gives every replica a tensor of its own (PerReplica of N, whatever the dtype or
    # rank: p03/p04); ours may share one buffer, which must not make them one value.
    out = strategy.run(_collectives(backend)[name])
    n = _replicas(strategy)
    for leaf in cd_nest_leaves(out):
        if n == 1:
            assert not isinstance(leaf, cd.DistributedValues)
            continue
        assert type(leaf) is PerReplica, leaf
        assert len(strategy.experimental_local_results(leaf)) == n
        first = to_numpy(strategy.experimental_local_results(leaf)[0])
        summed = to_numpy(strategy.reduce("sum", leaf, axis=None))
        np.testing.assert_allclose(summed, first * n)


def cd_nest_leaves(value: Any) -> list[Any]:
    """The leaves of a run result (dicts and lists walked; distributed values are leaves)."""
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in cd_nest_leaves(v)]
    if isinstance(value, list | tuple):
        return [leaf for v in value for leaf in cd_nest_leaves(v)]
    return [value]
