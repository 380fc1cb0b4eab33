"""`DistributedIterator.get_next_as_optional` and `experimental.Optional` (TF's semantics).

Ported from TF `input_lib_test.DistributedIteratorTest.testGetNextAsOptional` and
`optional_test` (`has_value`, `get_value`, `Optional.from_value`, `Optional.empty`).
"""

from __future__ import annotations

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._input.distributed import DistributedDataset, DistributedDatasetsFromFunction


def test_get_next_as_optional_until_the_end() -> None:
    """TF `testGetNextAsOptional`: values while there is data, then an empty Optional."""
    dataset = DistributedDataset([np.arange(4.0), np.arange(4.0, 8.0)], devices=("CPU:0", "CPU:1"))
    iterator = iter(dataset)
    seen = []
    for _ in range(10):  # bounded: an iterator that never ends fails instead of hanging
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        seen.append([v.tolist() for v in optional.get_value().values])
    else:
        pytest.fail(f"get_next_as_optional still had values after 10 steps: {seen}")
    assert seen == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]]]
    # Exhausted stays exhausted, and get_value on an empty Optional is an error.
    empty = iterator.get_next_as_optional()
    assert not empty.has_value()
    with pytest.raises(ValueError, match="has no value"):
        empty.get_value()
    with pytest.raises(StopIteration):
        next(iterator)


def test_get_next_as_optional_from_function() -> None:
    dataset = DistributedDatasetsFromFunction(
        lambda ctx: [np.arange(2.0)] * 3,
        devices=("CPU:0", "CPU:1"),
        num_replicas_in_sync=2,
    )
    iterator = iter(dataset)
    assert iterator.get_next_as_optional().has_value()
    # The third element goes to replica 0; replica 1 gets the empty batch (partial step).
    last = iterator.get_next_as_optional()
    assert [v.shape for v in last.get_value().values] == [(2,), (0,)]
    assert not iterator.get_next_as_optional().has_value()


def test_optional_class() -> None:
    """TF `optional_test`: from_value / empty / has_value / get_value."""
    value = {"x": np.arange(3)}
    full = cd.experimental.Optional.from_value(value)
    assert full.has_value()
    assert full.get_value() is value
    assert bool(full) is True
    empty = cd.experimental.Optional.empty()
    assert not empty.has_value()
    assert bool(empty) is False
    with pytest.raises(ValueError, match="has no value"):
        empty.get_value()
    none = cd.experimental.Optional.from_value(None)
    assert none.has_value()
    assert none.get_value() is None
    assert "has_value=False" in repr(empty)
    assert "has_value=True" in repr(full)


def test_get_next_as_optional_with_a_strategy() -> None:
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    iterator = iter(strategy.experimental_distribute_dataset([np.arange(4.0)]))
    optional = iterator.get_next_as_optional()
    total = strategy.reduce("sum", strategy.run(np.sum, args=(optional.get_value(),)), axis=None)
    assert float(total) == 6.0
    assert not iterator.get_next_as_optional().has_value()
