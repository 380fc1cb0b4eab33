"""The per-step path of `run` and `ReplicaContext.all_reduce`: shortcuts that keep meaning.

The common step takes plain arguments (`args=(batch,)`), and its replica calls its own
context. The checks behind both stay, for what is not plain or not its own: a value of
another strategy, a context used outside its replica.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
import optree
import pytest

import crossdevice as cd
from crossdevice._core import nest
from tests.helpers import within

FACTORIES = {
    "mirrored1": lambda: cd.MirroredStrategy(["CPU:0"]),
    "mirrored2": lambda: cd.MirroredStrategy(["CPU:0", "CPU:1"]),
    "one_device": lambda: cd.OneDeviceStrategy("CPU:0"),
}


@pytest.fixture(params=sorted(FACTORIES))
def strategy(request: pytest.FixtureRequest) -> Iterator[Any]:
    with FACTORIES[request.param]() as strategy:
        yield strategy


@pytest.fixture
def flattens() -> Iterator[list[str]]:
    """Every optree walk the code makes while the test runs, by name."""
    calls: list[str] = []

    def counted(name: str) -> Any:
        original = getattr(optree, name)

        def walk(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return original(*args, **kwargs)

        return walk

    names = ("tree_flatten", "tree_leaves", "tree_flatten_with_path")
    with mock.patch.multiple(optree, **{name: counted(name) for name in names}):
        yield calls


def test_plain_arguments_are_not_flattened(strategy: Any, flattens: list[str]) -> None:
    # One array, a number, None: nothing in them can be a distributed value.
    x = np.arange(4.0)
    strategy.run(lambda a, b, c: a, args=(x, 2, None))
    assert flattens == []


def test_torch_tensors_are_plain_arguments(strategy: Any, flattens: list[str]) -> None:
    torch = pytest.importorskip("torch")
    result = strategy.run(lambda t: t + 1, args=(torch.arange(4.0),))
    assert flattens == []
    for replica in strategy.experimental_local_results(result):
        assert replica.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_distributed_arguments_are_still_split(strategy: Any) -> None:
    def values() -> Any:
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1)
        )

    expected = tuple(np.float32(i + 11) for i in range(strategy.num_replicas_in_sync))
    for args, kwargs in [((values(),), {}), (([values()],), {}), ((), {"v": values()})]:

        def fn(*a: Any, **k: Any) -> Any:
            (found,) = [*a, *k.values()]
            mine = found[0] if isinstance(found, list) else found
            assert type(mine) is np.float32  # this replica's component, not the value
            return mine + np.float32(10)

        got = strategy.experimental_local_results(strategy.run(fn, args=args, kwargs=kwargs))
        assert got == expected


def test_another_strategys_value_is_still_refused(strategy: Any) -> None:
    other = cd.MirroredStrategy(["CPU:2", "CPU:3"][: strategy.num_replicas_in_sync])
    value = other.experimental_distribute_values_from_function(lambda ctx: np.float32(1))
    with pytest.raises(ValueError, match="it was made by another strategy"):
        strategy.run(lambda v: v, args=(value,))


def test_plain_leaves() -> None:
    assert nest.plain_leaves([np.zeros(2), 1, 2.5, 1j, True, "s", b"b", None])
    assert nest.plain_leaves([])
    # Containers, NumPy scalars and anything else are no verdict: the caller flattens.
    for item in ([np.zeros(2)], (1,), {"a": 1}, np.float32(1), object()):
        assert not nest.plain_leaves([item])
    pr = cd.PerReplica([np.float32(1), np.float32(2)])
    assert not nest.plain_leaves([np.zeros(2), pr])


def test_a_context_is_used_in_its_own_replica_only(strategy: Any) -> None:
    mismatch = "Mismatching ReplicaContext: this method must be called in the replica context"
    n = strategy.num_replicas_in_sync
    contexts: dict[int, Any] = {}

    def remember() -> None:
        ctx = cd.get_replica_context()
        contexts[ctx.replica_id_in_sync_group] = ctx

    def refused(fn: Any) -> None:
        # Bounded: a context that went unchecked would wait for peers that never come.
        with pytest.raises(RuntimeError, match=mismatch):
            within(10.0, fn)

    def in_scope() -> None:
        with strategy.scope():
            contexts[0].all_reduce("sum", np.float32(1))

    strategy.run(remember)
    # After its run: in cross-replica context and in the default context.
    refused(in_scope)
    refused(lambda: contexts[0].all_reduce("sum", np.float32(1)))
    # In a run, the context of another strategy's replica, of the default strategy's,
    # of a peer: every replica raises before it meets the others, so none waits.
    with FACTORIES["mirrored1"]() as other:
        other.run(lambda: contexts.__setitem__(-1, cd.get_replica_context()))
    default = cd.get_replica_context()
    strangers = [lambda i: contexts[-1], lambda i: default]
    if n > 1:
        strangers.append(lambda i: contexts[(i + 1) % n])
    for stranger in strangers:

        def step(stranger: Any = stranger) -> Any:
            i = cd.get_replica_context().replica_id_in_sync_group
            return stranger(i).all_reduce("sum", np.float32(1))

        refused(lambda step=step: strategy.run(step))

    # Its own replica still reduces, in any later run (a replica keeps its context).
    def own() -> Any:
        i = cd.get_replica_context().replica_id_in_sync_group
        return contexts[i].all_reduce("sum", np.float32(1))

    for _ in range(2):
        total = strategy.experimental_local_results(strategy.run(own))
        assert [float(v) for v in total] == [n] * n
