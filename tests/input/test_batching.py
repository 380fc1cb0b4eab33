"""The split rule for global batches: TF's `ceil(B / N)` per replica in order, empty slices.

The expected splits were measured with TF 2.21 (`experimental_distribute_dataset` of
`tf.data.Dataset.range(n).batch(B)` on N logical CPUs); the old rule here (balanced
sizes, remainder first: 7 over 3 as 3/2/2) was not what TF does.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossdevice._input.batching import batch_size_of, split_batch, split_bounds, split_sizes
from tests.conftest import Backend
from tests.helpers import to_numpy

Pair = collections.namedtuple("Pair", ["x", "y"])


@pytest.mark.parametrize(
    ("batch", "replicas", "expected"),
    [
        (8, 2, (4, 4)),
        (7, 2, (4, 3)),
        (5, 2, (3, 2)),
        (7, 3, (3, 3, 1)),
        (4, 3, (2, 2, 0)),
        (5, 3, (2, 2, 1)),
        (10, 3, (4, 4, 2)),
        (6, 4, (2, 2, 2, 0)),
        (5, 4, (2, 2, 1, 0)),
        (9, 4, (3, 3, 3, 0)),
        (3, 4, (1, 1, 1, 0)),
        (7, 4, (2, 2, 2, 1)),
        (1, 2, (1, 0)),
        (1, 3, (1, 0, 0)),
        (0, 3, (0, 0, 0)),
        (5, 8, (1,) * 5 + (0,) * 3),
    ],
)
def test_split_sizes(batch: int, replicas: int, expected: tuple[int, ...]) -> None:
    assert split_sizes(batch, replicas) == expected


@settings(deadline=None)  # a stall of the shared CI machine is not a failure
@given(st.integers(0, 500), st.integers(1, 33))
def test_split_sizes_ceil_in_order(batch: int, replicas: int) -> None:
    sizes = split_sizes(batch, replicas)
    assert len(sizes) == replicas
    assert sum(sizes) == batch
    assert list(sizes) == sorted(sizes, reverse=True)
    full = -(-batch // replicas)
    # ceil(B / N) each, in order, then at most one short slice, then empty ones.
    whole = sum(1 for size in sizes if size == full)
    assert sizes[:whole] == (full,) * whole
    assert all(size < full for size in sizes[whole:])
    assert all(size == 0 for size in sizes[whole + 1 :])
    bounds = split_bounds(batch, replicas)
    assert bounds[0][0] == 0
    assert bounds[-1][1] == batch
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


def test_split_sizes_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="num_replicas must be an int >= 1, got 0"):
        split_sizes(4, 0)
    with pytest.raises(ValueError, match="batch_size must be an int >= 0, got -1"):
        split_sizes(-1, 2)


def test_split_batch_uneven_7_over_3(backend: Backend) -> None:
    # TF: [0, 1, 2] / [3, 4, 5] / [6].
    parts = split_batch(backend.make(np.arange(7 * 2).reshape(7, 2)), 3)
    assert [to_numpy(p)[:, 0].tolist() for p in parts] == [[0, 2, 4], [6, 8, 10], [12]]


def test_split_batch_empty_replica_keeps_dtype_and_trailing_shape(backend: Backend) -> None:
    batch = backend.make(np.ones((1, 3, 2), dtype=np.float32))
    first, second = split_batch(batch, 2)
    assert tuple(first.shape) == (1, 3, 2)
    assert tuple(second.shape) == (0, 3, 2)
    assert second.dtype == batch.dtype
    assert type(second) is type(batch)


def test_split_batch_nests_and_replica_ids() -> None:
    batch = {"image": np.arange(10).reshape(5, 2), "label": Pair(np.arange(5), [np.arange(5) * 10])}
    parts = split_batch(batch, 4, replica_ids=range(2, 4))  # 5 over 4: 2/2/1/0
    assert len(parts) == 2
    assert parts[0]["image"].tolist() == [[8, 9]]
    assert parts[0]["label"].x.tolist() == [4]
    assert parts[0]["label"].y[0].tolist() == [40]
    assert parts[1]["label"].x.tolist() == []
    assert isinstance(parts[0]["label"], Pair)
    with pytest.raises(ValueError, match=r"replica id 4 is out of range for 4 replicas"):
        split_batch(batch, 4, replica_ids=[4])


def test_batch_size_of_names_disagreeing_components() -> None:
    batch = {"x": np.zeros((4, 3)), "y": np.zeros(5)}
    with pytest.raises(ValueError, match="disagree on the batch size") as info:
        batch_size_of(batch, 2)
    message = str(info.value)
    assert "expected every component to have 4 examples like batch['x']" in message
    assert "batch['y']: 5" in message


@pytest.mark.parametrize(
    "batch",
    [np.float32(1.0), 3, {"x": np.arange(4), "w": np.array(2.0)}, [1, 2, 3]],
    ids=["numpy-scalar", "python-int", "0-d-array-in-dict", "list-of-numbers"],
)
def test_unbatched_input_is_a_clear_error(batch: object) -> None:
    with pytest.raises(
        ValueError, match=r"Call the batch method .* split your input across 3 replicas"
    ):
        split_batch(batch, 3)


def test_non_array_component_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"got str at batch\['name'\]"):
        split_batch({"name": "seven", "x": np.arange(3)}, 2)


def test_empty_structure_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one array"):
        split_batch({}, 2)


def test_split_batch_slices_are_views() -> None:
    batch = np.arange(6)
    first, _ = split_batch(batch, 2)
    assert np.shares_memory(first, batch)
