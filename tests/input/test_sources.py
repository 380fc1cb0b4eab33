"""Where a distributed dataset's passes read from: one-shot iterators, and `element_spec`.

A generator cannot start over as a `tf.data.Dataset` does: before the fix, the second
pass over `experimental_distribute_dataset(generator)` (the second epoch) silently
yielded nothing. It is an error now, naming what to pass instead: an epoch loop that
trains on one epoch out of many is a wrong answer, never what the program means.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._input.source import ArraySpec, PerReplicaSpec


@pytest.fixture
def strategy() -> Any:
    return cd.MirroredStrategy(["CPU:0", "CPU:1"])


def _generator() -> Iterator[np.ndarray]:
    return (np.arange(i, i + 2) for i in range(0, 6, 2))


def _steps(strategy: Any, dataset: Any) -> list[list[list[int]]]:
    return [
        [np.asarray(x).tolist() for x in strategy.experimental_local_results(step)]
        for step in dataset
    ]


def test_a_second_pass_over_an_exhausted_generator_is_an_error(strategy: Any) -> None:
    dist = strategy.experimental_distribute_dataset(_generator())
    assert _steps(strategy, dist) == [[[0], [1]], [[2], [3]], [[4], [5]]]
    with pytest.raises(ValueError, match=r"one-shot iterator.*Pass a list of batches"):
        _steps(strategy, dist)


def test_a_generator_read_in_parts_goes_on_where_it_stopped(strategy: Any) -> None:
    dist = strategy.experimental_distribute_dataset(_generator())
    first = iter(dist)
    next(first)
    # A new pass before the end continues the generator (no error: it has batches).
    assert _steps(strategy, dist) == [[[2], [3]], [[4], [5]]]


@pytest.mark.parametrize(
    "dataset",
    [
        lambda: [np.arange(i, i + 2) for i in range(0, 6, 2)],
        type("Batches", (), {"__iter__": lambda self: _generator()}),
    ],
    ids=["list", "re_iterable"],
)
def test_re_iterable_datasets_give_every_epoch(strategy: Any, dataset: Any) -> None:
    dist = strategy.experimental_distribute_dataset(dataset())
    assert _steps(strategy, dist) == _steps(strategy, dist) == [[[0], [1]], [[2], [3]], [[4], [5]]]


def test_a_dataset_fn_returning_a_generator_is_refused_on_its_second_pass(strategy: Any) -> None:
    dist = strategy.distribute_datasets_from_function(lambda ctx: _generator())
    assert len(_steps(strategy, dist)) == 2  # two elements a step, one per replica
    with pytest.raises(ValueError, match="dataset_fn's result was given a one-shot iterator"):
        _steps(strategy, dist)


def test_element_spec_of_a_list_describes_the_per_replica_components(strategy: Any) -> None:
    batch = {"x": np.zeros((4, 3), np.float32), "y": np.arange(4)}
    dist = strategy.experimental_distribute_dataset([batch])
    spec = dist.element_spec
    # TF 2.21: PerReplicaSpec(TensorSpec(shape=(None, 3), dtype=tf.float32), ...) per leaf.
    x = ArraySpec((None, 3), np.dtype(np.float32))
    assert spec == {
        "x": PerReplicaSpec(x, x),
        "y": PerReplicaSpec(*[ArraySpec((None,), batch["y"].dtype)] * 2),
    }
    assert iter(dist).element_spec == spec
    assert repr(spec["x"]) == (
        "PerReplicaSpec(ArraySpec(shape=(None, 3), dtype=float32), "
        "ArraySpec(shape=(None, 3), dtype=float32))"
    )


def test_element_spec_unwrapped_with_one_replica() -> None:
    s = cd.OneDeviceStrategy("CPU:0")
    assert s.experimental_distribute_dataset([np.zeros((2, 5))]).element_spec == ArraySpec(
        (None, 5), np.dtype(np.float64)
    )


def test_element_spec_of_a_generator_waits_for_the_first_step(strategy: Any) -> None:
    dist = strategy.experimental_distribute_dataset(_generator())
    with pytest.raises(ValueError, match="ask after the first step"):
        dist.element_spec  # noqa: B018 - the property raises
    iterator = iter(dist)
    next(iterator)
    assert iterator.element_spec == PerReplicaSpec(*[ArraySpec((None,), np.dtype(np.int64))] * 2)


def test_element_spec_from_function(strategy: Any, request: pytest.FixtureRequest) -> None:
    from tests.conftest import require_torch

    torch = require_torch(request)
    dist = strategy.distribute_datasets_from_function(lambda ctx: [torch.zeros(3, 2)] * 4)
    spec = ArraySpec((None, 2), torch.float32)
    assert dist.element_spec == PerReplicaSpec(spec, spec)
