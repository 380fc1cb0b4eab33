"""Namedtuple classes made inside the step function: one structure to TF, and to us.

Each replica runs the step, so each makes its own class; optree tells classes apart by
identity, TF's nest by name and field names. Before the fix `run` raised
StructureMismatchError "... PyTreeSpec(Out(loss=*, n=*)) vs PyTreeSpec(Out(loss=*, n=*))"
and `all_reduce` "the replicas passed different nest structures".
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import optree
import pytest

import crossdevice as cd
from crossdevice._core import nest
from tests.strategies.conftest import replica_execution

STRATEGIES = [
    ("mirrored2", lambda: cd.MirroredStrategy(["CPU:0", "CPU:1"]), "threads"),
    ("mirrored3_coop", lambda: cd.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"]), "cooperative"),
    (
        "central_storage2",
        lambda: cd.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"]),
        "threads",
    ),
]


@pytest.fixture(params=STRATEGIES, ids=[s[0] for s in STRATEGIES])
def strategy(request: pytest.FixtureRequest) -> Iterator[Any]:
    _, make, mode = request.param
    with replica_execution(mode):
        yield make()


def _replica_id() -> int:
    ctx = cd.get_replica_context()
    assert ctx is not None
    return int(ctx.replica_id_in_sync_group)


def test_run_returns_a_namedtuple_made_in_the_step(strategy: Any) -> None:
    classes: dict[int, type] = {}

    def step() -> Any:
        out = collections.namedtuple("Out", "loss n")  # one class per replica
        classes[_replica_id()] = out
        return out(np.float32(1.0), _replica_id())

    result = strategy.run(step)
    assert type(result) is classes[0]  # replica 0's class
    assert result._fields == ("loss", "n")
    assert list(strategy.experimental_local_results(result.n)) == list(
        range(strategy.num_replicas_in_sync)
    )


def test_all_reduce_of_a_namedtuple_made_in_the_step(strategy: Any) -> None:
    def step() -> Any:
        grads = collections.namedtuple("G", "w b")
        ctx = cd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("sum", grads(np.float32(1.0), np.float32(2.0)))

    n = strategy.num_replicas_in_sync
    for result in strategy.experimental_local_results(strategy.run(step)):
        assert result._fields == ("w", "b")
        assert (float(result.w), float(result.b)) == (n * 1.0, n * 2.0)


def test_merge_call_regroups_namedtuples_made_in_the_step(strategy: Any) -> None:
    def merge_fn(s: Any, value: Any) -> Any:
        return [float(np.asarray(x)) for x in s.experimental_local_results(value.a)]

    def step() -> Any:
        pair = collections.namedtuple("Pair", "a b")
        ctx = cd.get_replica_context()
        assert ctx is not None
        return ctx.merge_call(merge_fn, args=(pair(np.float32(_replica_id()), 0),))

    n = strategy.num_replicas_in_sync
    assert strategy.experimental_local_results(strategy.run(step))[0] == list(map(float, range(n)))


def test_different_fields_still_raise(strategy: Any) -> None:
    def returned() -> Any:
        out = collections.namedtuple("Out", "loss n" if _replica_id() == 0 else "loss m")
        return out(1.0, 2.0)

    with pytest.raises(ValueError, match="different structures"):
        strategy.run(returned)

    def reduced() -> Any:
        out = collections.namedtuple("Out", "w b" if _replica_id() == 0 else "w c")
        ctx = cd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("sum", out(np.float32(1.0), np.float32(2.0)))

    with pytest.raises(ValueError, match=r"b=float32\[\].*c=float32\[\]|c=float32\[\].*b="):
        strategy.run(reduced)


def _pair_class() -> type:
    """A node class registered with crossdevice's optree namespace: one per call."""

    class Pair:
        def __init__(self, a: Any, b: Any) -> None:
            self.a, self.b = a, b

    optree.register_pytree_node(
        Pair,
        lambda p: ((p.a, p.b), None, None),
        lambda _, children: Pair(*children),
        namespace="crossdevice",
    )
    return Pair


def test_structures_that_print_alike_say_where_they_differ() -> None:
    s = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    first, second = _pair_class(), _pair_class()

    def make() -> Any:
        return {"x": (first if _replica_id() == 0 else second)(np.float32(1.0), np.float32(2.0))}

    with pytest.raises(ValueError, match=r"print alike but differ at \['x'\]: class .*Pair"):
        s.run(make)

    def reduced() -> Any:
        ctx = cd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("sum", make())

    with pytest.raises(ValueError, match=r"print alike but differ at \['x'\]: class .*Pair"):
        s.run(reduced)


def _spec(tree: Any) -> Any:
    return nest.flatten(tree)[1]


@pytest.mark.parametrize(
    ("make_a", "make_b", "same"),
    [
        (
            lambda: collections.namedtuple("P", "x y"),
            lambda: collections.namedtuple("P", "x y"),
            True,
        ),
        (
            lambda: collections.namedtuple("P", "x y"),
            lambda: collections.namedtuple("Q", "x y"),
            False,
        ),
        (
            lambda: collections.namedtuple("P", "x y"),
            lambda: collections.namedtuple("P", "y x"),
            False,
        ),
    ],
    ids=["same_name_and_fields", "other_name", "other_fields"],
)
def test_same_structure_compares_namedtuples_by_name_and_fields(
    make_a: Callable[[], type], make_b: Callable[[], type], same: bool
) -> None:
    a, b = make_a(), make_b()
    tree_a, tree_b = {"k": [a(1, (2, 3))]}, {"k": [b(4, (5, 6))]}
    assert nest.same_structure(_spec(tree_a), _spec(tree_b)) is same
    assert (nest.Structure(_spec(tree_a)) == nest.Structure(_spec(tree_b))) is same
    if same:
        nest.assert_same_structure(tree_a, tree_b)
    else:
        with pytest.raises(ValueError, match="Tree structure mismatch"):
            nest.assert_same_structure(tree_a, tree_b)


def test_structure_difference_names_the_path() -> None:
    where = nest.structure_difference(_spec({"a": [1, {"b": 2}]}), _spec({"a": [1, {"c": 2}]}))
    assert where is not None
    assert where.startswith("at ['a'][1]: ")
    assert nest.structure_difference(_spec([1, 2]), _spec([3, 4])) is None
