"""One contract suite, run against every strategy with NumPy and torch values."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from tests.helpers import to_numpy, within


def _replica_value(strategy: Any, backend: Any, shape: tuple[int, ...] = (3,)) -> Any:
    """Replica r holds `r + 1` everywhere (a PerReplica, or a plain value on one replica)."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: backend.make(np.full(shape, ctx.replica_id_in_sync_group + 1.0, np.float32))
    )


def _sum_of_ids(n: int) -> float:
    return n * (n + 1) / 2


def test_run_gives_each_replica_its_id(strategy: Any) -> None:
    n = strategy.num_replicas_in_sync
    result = strategy.run(lambda: cd.get_replica_context().replica_id_in_sync_group)
    assert list(strategy.experimental_local_results(result)) == list(range(n))


def test_run_splits_per_replica_args(strategy: Any, backend: Any) -> None:
    value = _replica_value(strategy, backend)
    result = strategy.run(lambda x: x * 2, args=(value,))
    locals_ = strategy.experimental_local_results(result)
    for i, x in enumerate(locals_):
        np.testing.assert_array_equal(to_numpy(x), np.full(3, 2.0 * (i + 1)))


@pytest.mark.parametrize("op", ["sum", "mean", cd.ReduceOp.SUM])
def test_all_reduce(strategy: Any, backend: Any, op: Any) -> None:
    n = strategy.num_replicas_in_sync

    def fn() -> Any:
        ctx = cd.get_replica_context()
        x = backend.make(np.full((2, 3), ctx.replica_id_in_sync_group + 1.0, np.float32))
        return ctx.all_reduce(op, {"x": x, "y": [x, x * 2]})

    expected = _sum_of_ids(n) / (n if str(op).lower().endswith("mean") else 1)
    for result in strategy.experimental_local_results(strategy.run(fn)):
        np.testing.assert_allclose(to_numpy(result["x"]), np.full((2, 3), expected))
        np.testing.assert_allclose(to_numpy(result["y"][1]), np.full((2, 3), 2 * expected))


@pytest.mark.parametrize(
    ("kind", "op"),
    [
        (k, op)
        for k in ("contiguous", "strided", "scalar", "int64", "bool")
        for op in ("sum", "mean")
    ],
)
def test_all_reduce_of_one_bare_leaf(strategy: Any, backend: Any, kind: str, op: str) -> None:
    # One array, not a nest: the per-step shape of a loss or a metric, with its own fast
    # path for contiguous NumPy; every other kind of leaf must give the same answers.
    n = strategy.num_replicas_in_sync

    def leaf(r: int) -> Any:
        base = np.arange(8, dtype=np.float32) + r
        if kind == "strided":
            return backend.make(np.repeat(base, 2))[::2]
        if kind == "scalar":
            return np.float32(r + 1) if backend.name == "numpy" else backend.make(base[0] + 1)
        if kind == "int64":
            return backend.make(base.astype(np.int64))
        if kind == "bool":
            return backend.make(base > 3)
        return backend.make(base)

    def fn() -> Any:
        ctx = cd.get_replica_context()
        return ctx.all_reduce(op, leaf(ctx.replica_id_in_sync_group))

    if kind == "bool":
        # A sum of booleans would be a logical or, in NumPy's `+` and torch's `add` alike:
        # refused, as TF's reduction kernels refuse bool (crossdevice._core.validate).
        with pytest.raises(TypeError, match=r"only numbers are reduced.*bool"):
            strategy.run(fn)
        return
    parts = [to_numpy(leaf(r)) for r in range(n)]
    expected = parts[0]
    for p in parts[1:]:
        expected = expected + p
    if op == "mean":
        expected = expected / n
    for result in strategy.experimental_local_results(strategy.run(fn)):
        np.testing.assert_allclose(to_numpy(result), expected, rtol=1e-6)


def test_all_reduce_is_bitwise_reproducible(strategy: Any) -> None:
    rng = np.random.default_rng(0)
    data = rng.standard_normal((strategy.num_replicas_in_sync, 1000)).astype(np.float32)

    def fn() -> Any:
        ctx = cd.get_replica_context()
        return ctx.all_reduce("sum", data[ctx.replica_id_in_sync_group])

    first = to_numpy(strategy.experimental_local_results(strategy.run(fn))[0]).copy()
    expected = data[0].copy()
    for row in data[1:]:
        expected = expected + row  # replica order
    for _ in range(5):
        again = to_numpy(strategy.experimental_local_results(strategy.run(fn))[0])
        assert again.tobytes() == first.tobytes()
    np.testing.assert_allclose(first, expected, rtol=1e-6)


def test_all_gather_uneven(strategy: Any, backend: Any) -> None:
    n = strategy.num_replicas_in_sync

    def fn() -> Any:
        ctx = cd.get_replica_context()
        r = ctx.replica_id_in_sync_group
        return ctx.all_gather(backend.make(np.full((r + 1, 2), r, np.int32)), axis=0)

    expected = np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(n)])
    for result in strategy.experimental_local_results(strategy.run(fn)):
        np.testing.assert_array_equal(to_numpy(result), expected)


def test_merge_call_regroups_and_unpacks(strategy: Any) -> None:
    n = strategy.num_replicas_in_sync
    shared = object()
    seen: list[Any] = []

    def merge_fn(s: Any, per_replica: Any, same: Any) -> Any:
        assert cd.in_cross_replica_context()
        assert cd.get_replica_context() is None
        assert s is strategy
        seen.append((per_replica, same))
        return per_replica

    def fn() -> Any:
        ctx = cd.get_replica_context()
        return ctx.merge_call(merge_fn, args=(ctx.replica_id_in_sync_group * 10, shared))

    result = strategy.run(fn)
    assert len(seen) == 1  # merge_fn ran once
    assert seen[0][1] is shared
    assert list(strategy.experimental_local_results(result)) == [10 * i for i in range(n)]


def test_run_inside_merge_fn(strategy: Any, backend: Any) -> None:
    """TF runs a nested `strategy.run` from merge_fn on fresh replicas (issue 23: one
    replica hung); each outer replica gets its own component of the nested result."""
    n = strategy.num_replicas_in_sync

    def inner() -> Any:
        ctx = cd.get_replica_context()
        one = backend.make(np.ones(2, np.float32))
        return ctx.replica_id_in_sync_group, ctx.all_reduce("sum", one)

    def step() -> Any:
        return cd.get_replica_context().merge_call(lambda s: s.run(inner))

    results = within(10.0, lambda: strategy.experimental_local_results(strategy.run(step)))
    assert [r for r, _ in results] == list(range(n))
    for _, reduced in results:
        np.testing.assert_array_equal(to_numpy(reduced), np.full(2, float(n)))


def test_reduce_with_and_without_axis(strategy: Any, backend: Any) -> None:
    n = strategy.num_replicas_in_sync
    value = _replica_value(strategy, backend, shape=(4,))
    if n == 1:
        np.testing.assert_array_equal(to_numpy(strategy.reduce("sum", value, axis=None)), 1.0)
    else:
        summed = strategy.reduce("sum", value, axis=None)
        np.testing.assert_array_equal(to_numpy(summed), np.full(4, _sum_of_ids(n)))
    assert float(to_numpy(strategy.reduce("sum", value, axis=0))) == 4 * _sum_of_ids(n)
    assert float(to_numpy(strategy.reduce("mean", value, axis=0))) == pytest.approx(
        _sum_of_ids(n) / n
    )


def test_gather(strategy: Any, backend: Any) -> None:
    n = strategy.num_replicas_in_sync
    value = _replica_value(strategy, backend, shape=(2,))
    gathered = to_numpy(strategy.gather(value, axis=0))
    np.testing.assert_array_equal(gathered, np.repeat(np.arange(1.0, n + 1), 2))


def test_contexts(strategy: Any) -> None:
    assert not cd.in_cross_replica_context()
    assert cd.get_replica_context() is not None  # the default replica context
    assert not cd.has_strategy()
    with strategy.scope():
        assert cd.in_cross_replica_context()
        assert cd.get_replica_context() is None
        assert cd.get_cross_replica_context() is strategy
        assert cd.get_strategy() is strategy
        assert cd.has_strategy()

    def fn() -> Any:
        ctx = cd.get_replica_context()
        assert ctx is not None
        assert ctx.strategy is strategy
        assert not cd.in_cross_replica_context()
        assert cd.get_strategy() is strategy
        return ctx.num_replicas_in_sync, ctx.devices

    results = strategy.experimental_local_results(strategy.run(fn))
    for i, (num, devices) in enumerate(results):
        assert num == strategy.num_replicas_in_sync
        assert devices == (strategy.extended.worker_devices[i],)
    assert cd.get_strategy() is not strategy


def test_variable_cross_replica_assign(strategy: Any, backend: Any) -> None:
    with strategy.scope():
        v = cd.Variable(backend.make(np.zeros(3, np.float32)))
    assert strategy.extended.variable_created_in_scope(v)
    assert isinstance(v, cd.Variable)
    v.assign(backend.make(np.ones(3, np.float32)))
    v.assign_add(backend.make(np.full(3, 2.0, np.float32)))
    v.assign_sub(backend.make(np.full(3, 0.5, np.float32)))
    for component in strategy.experimental_local_results(v):
        np.testing.assert_array_equal(to_numpy(component), np.full(3, 2.5))
    np.testing.assert_array_equal(v.numpy(), np.full(3, 2.5))


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("sum", _sum_of_ids),
        ("mean", lambda n: _sum_of_ids(n) / n),
        ("only_first_replica", lambda n: 1.0),
    ],
)
def test_variable_replica_assign_add_aggregates(
    strategy: Any, backend: Any, aggregation: str, expected: Any
) -> None:
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = cd.Variable(backend.make(np.zeros(2, np.float32)), aggregation=aggregation)

    def fn() -> None:
        r = cd.get_replica_context().replica_id_in_sync_group
        v.assign_add(backend.make(np.full(2, r + 1.0, np.float32)))

    strategy.run(fn)
    for component in strategy.experimental_local_results(v):
        np.testing.assert_allclose(to_numpy(component), np.full(2, expected(n)))


def test_update_applies_per_replica_values(strategy: Any, backend: Any) -> None:
    with strategy.scope():
        v = cd.Variable(backend.make(np.zeros(2, np.float32)))
    delta = strategy.reduce("mean", _replica_value(strategy, backend, (2,)), axis=None)
    strategy.extended.update(v, lambda var, d: var.assign_add(d), args=(delta,))
    n = strategy.num_replicas_in_sync
    for component in strategy.experimental_local_results(v):
        np.testing.assert_allclose(to_numpy(component), np.full(2, _sum_of_ids(n) / n))
    per_component = strategy.extended.update(v, lambda var: var.read_value(), group=False)
    assert isinstance(per_component, tuple)


def test_distribute_values_from_function(strategy: Any) -> None:
    n = strategy.num_replicas_in_sync
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync)
    )
    assert list(strategy.experimental_local_results(value)) == [(i, n) for i in range(n)]


def test_next_run_after_many_runs(strategy: Any) -> None:
    n = strategy.num_replicas_in_sync
    for step in range(50):
        result = strategy.run(
            lambda s: cd.get_replica_context().all_reduce("sum", np.float32(s)), args=(step,)
        )
        for x in strategy.experimental_local_results(result):
            assert float(x) == step * n
