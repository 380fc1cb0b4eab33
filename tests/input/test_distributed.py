"""DistributedDataset and DistributedDatasetsFromFunction: what each replica receives."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._core.devices import canonicalize
from crossdevice._input.distributed import DistributedDataset, DistributedDatasetsFromFunction
from crossdevice._input.input_context import InputContext, InputOptions
from crossdevice._values.values import PerReplica
from tests.conftest import Backend
from tests.helpers import to_numpy

TWO = ("CPU:0", "CPU:1")
THREE = ("CPU:0", "CPU:1", "CPU:2")


def batches(n: int, size: int, make: Any = np.asarray) -> list[Any]:
    """`range(n).batch(size)` as a list of arrays."""
    return [make(np.arange(i, min(i + size, n))) for i in range(0, n, size)]


def lists(step: Any) -> list[list[Any]]:
    assert isinstance(step, PerReplica)
    return [to_numpy(v).tolist() for v in step.values]


def test_even_batches(backend: Backend) -> None:
    dist = DistributedDataset(batches(8, 4, backend.make), devices=TWO)
    assert [lists(step) for step in dist] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_partial_last_batch_9_by_4_over_2(backend: Backend) -> None:
    dist = DistributedDataset(batches(9, 4, backend.make), devices=TWO)
    steps = list(dist)
    assert [lists(step) for step in steps] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]
    empty = steps[-1].values[1]
    assert tuple(empty.shape) == (0,)
    assert empty.dtype == steps[-1].values[0].dtype
    assert type(empty) is type(steps[-1].values[0])


def test_uneven_batch_7_over_3(backend: Backend) -> None:
    # TF 2.21: [0, 1, 2] / [3, 4, 5] / [6] (not 3/2/2, as our docs once said).
    dist = DistributedDataset([backend.make(np.arange(7))], devices=THREE)
    assert [lists(step) for step in dist] == [[[0, 1, 2], [3, 4, 5], [6]]]


#: (replicas, examples, global batch, drop_remainder, each step's per-replica sizes), as
#: TF 2.21's `experimental_distribute_dataset(tf.data.Dataset.range(examples).batch(
#: global_batch, drop_remainder))` gave them on that many logical CPUs.
TF_SPLITS = [
    (2, 7, 7, False, [[4, 3]]),
    (2, 4, 4, False, [[2, 2]]),
    (2, 6, 6, False, [[3, 3]]),
    (2, 5, 5, False, [[3, 2]]),
    (2, 9, 9, False, [[5, 4]]),
    (2, 10, 4, False, [[2, 2], [2, 2], [1, 1]]),
    (2, 10, 4, True, [[2, 2], [2, 2]]),
    (2, 14, 8, False, [[4, 4], [3, 3]]),
    (2, 13, 6, True, [[3, 3], [3, 3]]),
    (2, 3, 3, False, [[2, 1]]),
    (2, 1, 1, False, [[1, 0]]),
    (2, 11, 5, False, [[3, 2], [3, 2], [1, 0]]),
    (2, 17, 10, False, [[5, 5], [4, 3]]),
    (3, 7, 7, False, [[3, 3, 1]]),
    (3, 4, 4, False, [[2, 2, 0]]),
    (3, 6, 6, False, [[2, 2, 2]]),
    (3, 5, 5, False, [[2, 2, 1]]),
    (3, 9, 9, False, [[3, 3, 3]]),
    (3, 10, 4, False, [[2, 2, 0], [2, 2, 0], [1, 1, 0]]),
    (3, 10, 4, True, [[2, 2, 0], [2, 2, 0]]),
    (3, 14, 8, False, [[3, 3, 2], [2, 2, 2]]),
    (3, 13, 6, True, [[2, 2, 2], [2, 2, 2]]),
    (3, 3, 3, False, [[1, 1, 1]]),
    (3, 1, 1, False, [[1, 0, 0]]),
    (3, 11, 5, False, [[2, 2, 1], [2, 2, 1], [1, 0, 0]]),
    (3, 17, 10, False, [[4, 4, 2], [3, 3, 1]]),
    (4, 7, 7, False, [[2, 2, 2, 1]]),
    (4, 4, 4, False, [[1, 1, 1, 1]]),
    (4, 6, 6, False, [[2, 2, 2, 0]]),
    (4, 5, 5, False, [[2, 2, 1, 0]]),
    (4, 9, 9, False, [[3, 3, 3, 0]]),
    (4, 10, 4, False, [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]),
    (4, 10, 4, True, [[1, 1, 1, 1], [1, 1, 1, 1]]),
    (4, 14, 8, False, [[2, 2, 2, 2], [2, 2, 2, 0]]),
    (4, 13, 6, True, [[2, 2, 2, 0], [2, 2, 2, 0]]),
    (4, 3, 3, False, [[1, 1, 1, 0]]),
    (4, 1, 1, False, [[1, 0, 0, 0]]),
    (4, 11, 5, False, [[2, 2, 1, 0], [2, 2, 1, 0], [1, 0, 0, 0]]),
    (4, 17, 10, False, [[3, 3, 3, 1], [2, 2, 2, 1]]),
]


@pytest.mark.parametrize(("replicas", "examples", "global_batch", "drop", "expected"), TF_SPLITS)
def test_batches_split_as_tf_splits_them(
    replicas: int, examples: int, global_batch: int, drop: bool, expected: list[list[int]]
) -> None:
    data = [
        np.arange(start, min(start + global_batch, examples))
        for start in range(0, examples, global_batch)
    ]
    if drop:
        data = [batch for batch in data if len(batch) == global_batch]
    devices = tuple(f"CPU:{i}" for i in range(replicas))
    steps = [lists(step) for step in DistributedDataset(data, devices=devices)]
    assert [[len(part) for part in step] for step in steps] == expected
    assert [[x for part in step for x in part] for step in steps] == [b.tolist() for b in data]


def test_mean_of_replica_means_is_tfs() -> None:
    # TF 2.21, range(12).batch(7) on 3 replicas: [0,1,2]/[3,4,5]/[6] then [7,8]/[9,10]/[11];
    # the mean of the per-replica means is 3.6667 and 9.3333 (3.3333 with 3/2/2).
    strategy = cd.MirroredStrategy(list(THREE))
    data = [np.arange(7.0), np.arange(7.0, 12.0)]
    means = []
    for step in strategy.experimental_distribute_dataset(data):
        per_replica = strategy.run(lambda x: x.mean(), args=(step,))
        means.append(float(strategy.reduce("mean", per_replica, axis=None)))
    assert means == pytest.approx([11 / 3, 28 / 3])


def test_components_carry_the_replica_devices() -> None:
    step = next(iter(DistributedDataset(batches(4, 4), devices=TWO)))
    assert step._devices == (canonicalize("CPU:0"), canonicalize("CPU:1"))


def test_nested_batches_keep_their_structure(backend: Backend) -> None:
    data = [
        {"image": backend.make(np.arange(12).reshape(6, 2)), "label": backend.make(np.arange(6))},
        {"image": backend.make(np.arange(4).reshape(2, 2)), "label": backend.make(np.arange(2))},
    ]
    first, second = DistributedDataset(data, devices=THREE)
    assert set(first) == {"image", "label"}
    assert lists(first["label"]) == [[0, 1], [2, 3], [4, 5]]
    assert lists(first["image"])[2] == [[8, 9], [10, 11]]
    assert lists(second["label"]) == [[0], [1], []]
    assert tuple(second["image"].values[2].shape) == (0, 2)


def test_tuple_batches_and_generators() -> None:
    def generate() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for i in range(0, 6, 3):
            yield np.arange(i, i + 3), np.arange(i, i + 3) * 10

    steps = list(DistributedDataset(generate(), devices=TWO))
    assert len(steps) == 2
    x, y = steps[1]
    assert lists(x) == [[3, 4], [5]]
    assert lists(y) == [[30, 40], [50]]


def test_list_dataset_can_be_iterated_twice() -> None:
    dist = DistributedDataset(batches(4, 2), devices=TWO)
    assert [lists(s) for s in dist] == [lists(s) for s in dist]


def test_torch_dataloader(torch_module: Any) -> None:
    torch = torch_module
    data = torch.utils.data.TensorDataset(torch.arange(10), torch.arange(10) * 2)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    steps = list(DistributedDataset(loader, devices=TWO))
    assert len(steps) == 3
    x, y = steps[2]
    assert all(isinstance(v, torch.Tensor) for v in x.values)
    assert lists(x) == [[8], [9]]
    assert lists(y) == [[16], [18]]


def test_single_replica_yields_the_plain_batch() -> None:
    # TF's input_lib regroups with always_wrap=False on one worker with one device.
    data = batches(5, 4)
    steps = list(DistributedDataset(data, devices=("CPU:0",)))
    assert not isinstance(steps[0], PerReplica)
    assert [s.tolist() for s in steps] == [[0, 1, 2, 3], [4]]


def test_multi_worker_keeps_its_own_replicas() -> None:
    # MWMS 2x1, DATA sharding: the last 6 of range(14).batch(8) split [8,9,10]/[11,12,13].
    data = batches(14, 8)
    worker0 = list(DistributedDataset(data, devices=("CPU:0",), num_workers=2, worker_index=0))
    worker1 = list(DistributedDataset(data, devices=("CPU:0",), num_workers=2, worker_index=1))
    # Multi-worker always wraps, even with one local replica (TF's _always_wrap).
    assert [lists(s) for s in worker0] == [[[0, 1, 2, 3]], [[8, 9, 10]]]
    assert [lists(s) for s in worker1] == [[[4, 5, 6, 7]], [[11, 12, 13]]]


def test_multi_worker_two_local_replicas() -> None:
    data = [np.arange(6)]  # 6 over 4 global replicas: 2/2/2/0 (TF's split on one worker)
    w0 = next(iter(DistributedDataset(data, devices=TWO, num_workers=2, worker_index=0)))
    w1 = next(iter(DistributedDataset(data, devices=TWO, num_workers=2, worker_index=1)))
    assert lists(w0) == [[0, 1], [2, 3]]
    assert lists(w1) == [[4, 5], []]


def test_bad_batch_is_reported_before_anything_is_yielded() -> None:
    data = [np.arange(4), {"x": np.arange(4), "y": np.arange(3)}]
    iterator = iter(DistributedDataset(data, devices=TWO))
    assert lists(next(iterator)) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="disagree on the batch size"):
        next(iterator)


def test_unbatched_dataset_error_names_the_replica_count() -> None:
    iterator = iter(DistributedDataset([np.float32(1.0)], devices=THREE))
    with pytest.raises(ValueError, match="split your input across 3 replicas"):
        next(iterator)


@pytest.mark.parametrize(
    ("dataset", "match"),
    [
        (np.arange(8), r"got a single array of shape \(8,\)"),
        ({"x": np.arange(8)}, "got a dict"),
        ("abc", "must be an iterable of batches"),
        (3, "must be an iterable of batches"),
    ],
)
def test_dataset_that_is_not_an_iterable_of_batches(dataset: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        DistributedDataset(dataset, devices=TWO)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"devices": ()}, ValueError, "devices must be a non-empty sequence"),
        ({"devices": "CPU:0"}, ValueError, "devices must be a non-empty sequence"),
        ({"devices": TWO, "num_workers": 0}, ValueError, "num_workers must be an int >= 1"),
        ({"devices": TWO, "num_workers": 2, "worker_index": 2}, ValueError, "worker_index"),
        (
            {"devices": TWO, "options": InputOptions(experimental_replication_mode="PER_REPLICA")},
            NotImplementedError,
            "PER_REPLICA is only supported",
        ),
    ],
)
def test_distributed_dataset_rejects_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        DistributedDataset(batches(4, 2), **kwargs)


# --- distribute_datasets_from_function --------------------------------------------------


def test_from_function_per_worker() -> None:
    contexts: list[InputContext] = []

    def dataset_fn(ctx: InputContext) -> list[np.ndarray]:
        contexts.append(ctx)
        size = ctx.get_per_replica_batch_size(6)
        return batches(10, size)  # per-replica batches of 3: [0..2] [3..5] [6..8] [9]

    dist = DistributedDatasetsFromFunction(dataset_fn, devices=TWO, num_replicas_in_sync=2)
    assert contexts == [InputContext(1, 0, 2)]  # called once, when distributed
    steps = [lists(s) for s in dist]
    assert steps == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9]]]
    assert len(contexts) == 1


def test_from_function_pads_a_short_last_step() -> None:
    dist = DistributedDatasetsFromFunction(
        lambda ctx: batches(7, 2), devices=THREE, num_replicas_in_sync=3
    )
    steps = list(dist)
    assert [lists(s) for s in steps] == [[[0, 1], [2, 3], [4, 5]], [[6], [], []]]
    assert tuple(steps[1].values[2].shape) == (0,)


def test_from_function_multi_worker_input_context() -> None:
    seen: list[InputContext] = []

    def dataset_fn(ctx: InputContext) -> list[dict[str, np.ndarray]]:
        seen.append(ctx)
        shard = np.arange(16)[ctx.input_pipeline_id :: ctx.num_input_pipelines]
        size = ctx.get_per_replica_batch_size(8)
        return [{"x": shard[i : i + size]} for i in range(0, len(shard), size)]

    dist = DistributedDatasetsFromFunction(
        dataset_fn, devices=TWO, num_workers=2, worker_index=1, num_replicas_in_sync=4
    )
    assert seen == [
        InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    ]
    assert dist.input_contexts == tuple(seen)
    assert [lists(s["x"]) for s in dist] == [[[1, 3], [5, 7]], [[9, 11], [13, 15]]]


def test_from_function_per_replica_mode() -> None:
    seen: list[InputContext] = []

    def dataset_fn(ctx: InputContext) -> list[np.ndarray]:
        seen.append(ctx)
        return [
            np.full(2, ctx.input_pipeline_id * 10 + step)
            for step in range(2 + ctx.input_pipeline_id)
        ]

    options = InputOptions(experimental_replication_mode="PER_REPLICA")
    dist = DistributedDatasetsFromFunction(
        dataset_fn, devices=TWO, num_replicas_in_sync=2, options=options
    )
    assert seen == [InputContext(2, 0, 2), InputContext(2, 1, 2)]
    # Replica 0 runs dry first; it gets empty batches until replica 1 has none either.
    assert [lists(s) for s in dist] == [[[0, 0], [10, 10]], [[1, 1], [11, 11]], [[], [12, 12]]]


def test_from_function_single_replica_is_plain() -> None:
    dist = DistributedDatasetsFromFunction(
        lambda ctx: batches(4, 2), devices=("CPU:0",), num_replicas_in_sync=1
    )
    assert [s.tolist() for s in dist] == [[0, 1], [2, 3]]


def test_from_function_errors() -> None:
    with pytest.raises(TypeError, match="dataset_fn must be a function"):
        DistributedDatasetsFromFunction([1], devices=TWO, num_replicas_in_sync=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="result must be an iterable of batches"):
        DistributedDatasetsFromFunction(lambda ctx: 5, devices=TWO, num_replicas_in_sync=2)  # type: ignore[arg-type,return-value]
    mismatched = DistributedDatasetsFromFunction(
        lambda ctx: [{"a": np.arange(2)}, {"b": np.arange(2)}], devices=TWO, num_replicas_in_sync=2
    )
    with pytest.raises(ValueError, match="must share one structure"):
        next(iter(mismatched))
    unbatched = DistributedDatasetsFromFunction(
        lambda ctx: [np.float32(1.0)], devices=TWO, num_replicas_in_sync=2
    )
    with pytest.raises(ValueError, match="replica 1 has no data for this step"):
        next(iter(unbatched))
