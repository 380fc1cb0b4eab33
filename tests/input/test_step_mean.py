"""The step-mean rule with a real strategy: `reduce(MEAN, per_replica, axis=0)` is the
mean over the global batch, also when the last batch is short or a replica gets nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import crossdevice
from tests.conftest import Backend
from tests.helpers import to_numpy


def range_batches(n: int, size: int, make: Any) -> list[Any]:
    return [make(np.arange(i, min(i + size, n), dtype=np.float32)) for i in range(0, n, size)]


def per_example_loss(x: Any) -> Any:
    return x * 1.5 + 1.0


@pytest.mark.parametrize(
    ("n", "batch", "replicas"),
    [(8, 4, 2), (9, 4, 2), (7, 7, 3), (10, 4, 3), (3, 8, 4)],
    ids=["even", "partial-9-4-2", "uneven-7-3", "partial-10-4-3", "fewer-than-replicas"],
)
def test_reduce_mean_axis0_is_the_global_batch_mean(
    backend: Backend, n: int, batch: int, replicas: int
) -> None:
    strategy = crossdevice.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    global_batches = range_batches(n, batch, backend.make)
    dist = strategy.experimental_distribute_dataset(global_batches)
    steps = 0
    for global_batch, per_replica in zip(global_batches, dist, strict=True):
        losses = strategy.run(per_example_loss, args=(per_replica,))
        mean = strategy.reduce(crossdevice.ReduceOp.MEAN, losses, axis=0)
        total = strategy.reduce("sum", losses, axis=0)
        expected = per_example_loss(to_numpy(global_batch))
        np.testing.assert_allclose(to_numpy(mean), expected.mean(), rtol=1e-6)
        np.testing.assert_allclose(to_numpy(total), expected.sum(), rtol=1e-6)
        steps += 1
    assert steps == len(global_batches)


def test_reduce_mean_without_axis_is_not_the_global_mean_for_a_partial_batch() -> None:
    # Why the axis matters: averaging the replicas' own means weights [8] and [] wrongly.
    strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
    last = list(strategy.experimental_distribute_dataset(range_batches(9, 4, np.asarray)))[-1]
    means = strategy.run(lambda x: np.asarray(x.sum() / max(len(x), 1), dtype=np.float32), (last,))
    naive = strategy.reduce("mean", means, axis=None)
    right = strategy.reduce("mean", last, axis=0)
    assert float(to_numpy(right)) == 8.0
    assert float(to_numpy(naive)) == 4.0


def test_distribute_datasets_from_function_through_the_strategy() -> None:
    strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
    seen: list[crossdevice.InputContext] = []

    def dataset_fn(ctx: crossdevice.InputContext) -> list[np.ndarray]:
        seen.append(ctx)
        size = ctx.get_per_replica_batch_size(4)
        return range_batches(6, size, np.asarray)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    assert seen == [crossdevice.InputContext(1, 0, 2)]
    sums = [float(to_numpy(strategy.reduce("sum", step, axis=0))) for step in dist]
    assert sums == [0 + 1 + 2 + 3, 4 + 5]
