"""The data position in a checkpoint: no example repeated or skipped, on any layout."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crossdevice as cd

NUM_EXAMPLES = 80


class ShuffledBatches:
    """Global batches of example ids, reshuffled from NumPy's global generator per epoch.

    The order is drawn when iteration starts, as a shuffling DataLoader draws it, so a
    resumed epoch has its order only if the pipeline is recreated under the random state
    of the epoch's start.
    """

    def __init__(self, batch_size: int, num_examples: int = NUM_EXAMPLES) -> None:
        self.batch_size = batch_size
        self.num_examples = num_examples

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        order = np.random.permutation(self.num_examples)
        for start in range(0, self.num_examples, self.batch_size):
            ids = order[start : start + self.batch_size]
            yield {"id": ids, "x": ids.astype(np.float32)[:, None]}

    def __len__(self) -> int:
        return math.ceil(self.num_examples / self.batch_size)


def _mirrored(n: int) -> Any:
    return cd.MirroredStrategy([f"CPU:{i}" for i in range(n)])


def _ids(strategy: Any, batch: dict[str, Any]) -> list[int]:
    """The step's example ids, replica by replica (what each replica trains on)."""
    return [int(i) for part in strategy.experimental_local_results(batch["id"]) for i in part]


def _train(strategy: Any, dist: Any, steps: int | None = None) -> list[list[int]]:
    """Iterate `dist` (through `strategy.run`, as training does) and log each step's ids."""
    log: list[list[int]] = []
    it = iter(dist)
    for batch in it:
        strategy.run(lambda b: b["x"].sum(), args=(batch,))
        log.append(_ids(strategy, batch))
        if steps is not None and len(log) == steps:
            break
    return log


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (4, 3)])
def test_a_restored_epoch_goes_on_at_the_next_global_batch(
    tmp_path: Path, before: int, after: int
) -> None:
    np.random.seed(0)
    reference = _mirrored(before)
    full = _train(reference, reference.experimental_distribute_dataset(ShuffledBatches(8)))

    np.random.seed(0)
    strategy = _mirrored(before)
    dist = strategy.experimental_distribute_dataset(ShuffledBatches(8))
    ckpt = cd.train.Checkpoint(data=dist)
    seen = _train(strategy, dist, steps=4)
    path = ckpt.save(tmp_path / "ckpt")
    np.random.rand(5)  # the job goes on drawing, then dies

    np.random.seed(123)  # a new process: another random state until the restore
    resumed = _mirrored(after)
    again = resumed.experimental_distribute_dataset(ShuffledBatches(8))
    cd.train.Checkpoint(data=again).restore(path).assert_consumed()
    assert again.epoch == 0
    rest = _train(resumed, again)

    assert seen + rest == full  # the same global batches, in the same order
    ids = [i for step in seen + rest for i in step]
    assert sorted(ids) == list(range(NUM_EXAMPLES))  # 0 repeated, 0 skipped


def test_the_next_epochs_continue_too(tmp_path: Path) -> None:
    np.random.seed(1)
    strategy = _mirrored(2)
    dist = strategy.experimental_distribute_dataset(ShuffledBatches(16))
    ckpt = cd.train.Checkpoint(data=dist)
    epochs = [_train(strategy, dist)]
    ckpt.save(tmp_path / "ckpt")  # at the end of epoch 0
    epochs.append(_train(strategy, dist))

    np.random.seed(7)
    other = _mirrored(4)
    again = other.experimental_distribute_dataset(ShuffledBatches(16))
    cd.train.Checkpoint(data=again).restore(cd.train.latest_checkpoint(tmp_path))
    assert again.epoch == 1  # a finished epoch restores as the start of the next
    assert _train(other, again) == epochs[1]
    assert dist.epoch == again.epoch == 2


def test_a_checkpointed_iterator_resumes_in_a_fresh_iterator(tmp_path: Path) -> None:
    strategy = _mirrored(2)
    data = [{"id": np.arange(i, i + 4), "x": np.zeros((4, 1), np.float32)} for i in range(0, 40, 4)]
    dist = strategy.experimental_distribute_dataset(data)
    it = iter(dist)
    ckpt = cd.train.Checkpoint(it=it)
    for _ in range(3):
        next(it)
    assert {k: it.state_dict()[k] for k in ("epoch", "steps", "examples")} == {
        "epoch": 0,
        "steps": 3,
        "examples": 12,
    }
    path = ckpt.save(tmp_path / "ckpt")
    fresh = iter(strategy.experimental_distribute_dataset(data))
    cd.train.Checkpoint(it=fresh).restore(path).assert_consumed()
    assert _ids(strategy, next(fresh)) == [12, 13, 14, 15]
    with pytest.raises(RuntimeError, match="repositions a fresh iterator: this one has handed"):
        fresh.load_state_dict(it.state_dict())


def test_another_global_batch_size_recomputes_the_position(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = [{"id": np.arange(i, min(i + 8, 40))} for i in range(0, 40, 8)]
    dist = cd.MirroredStrategy(["CPU:0", "CPU:1"]).experimental_distribute_dataset(data)
    it = iter(dist)
    for _ in range(3):  # 24 examples
        next(it)
    state = it.state_dict()

    def resume(batch: int) -> list[int]:
        batches = [{"id": np.arange(i, min(i + batch, 40))} for i in range(0, 40, batch)]
        fresh = iter(cd.MirroredStrategy(["CPU:0"]).experimental_distribute_dataset(batches))
        fresh.load_state_dict(state)
        return [int(i) for step in fresh for i in step["id"]]

    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        assert resume(4) == list(range(24, 40))  # 24 = 6 batches of 4: exact
    assert "written with global batch size 8 and this dataset's batches have 4" in caplog.text
    assert "so 6 batches are skipped" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        assert resume(16) == list(range(16, 40))  # the straddling batch is kept
    assert "1 batches are skipped and the first 8 examples of the next batch are seen again" in (
        caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        assert resume(8) == list(range(24, 40))
    assert caplog.text == ""  # the same batch size says nothing


def test_dataset_position_before_during_and_after_an_epoch() -> None:
    data = [np.arange(i, i + 2) for i in range(0, 8, 2)]
    dist = cd.MirroredStrategy(["CPU:0", "CPU:1"]).experimental_distribute_dataset(data)
    assert dist.epoch == 0
    assert dist.state_dict()["epoch"] == 0
    it = iter(dist)
    assert dist.epoch == 1  # the next iter() reads epoch 1
    next(it)
    assert (dist.state_dict()["epoch"], dist.state_dict()["steps"]) == (0, 1)
    for _ in it:
        pass
    assert (dist.state_dict()["epoch"], dist.state_dict()["steps"]) == (1, 0)
    dist.load_state_dict({**it.state_dict(), "exhausted": False, "steps": 2, "examples": 4})
    assert dist.epoch == 0
    assert [v.tolist() for step in dist for v in step.values] == [[4], [5], [6], [7]]
    with pytest.raises(ValueError, match=r"'steps' must be an int >= 0, got -1"):
        dist.load_state_dict({**it.state_dict(), "steps": -1})
    with pytest.raises(ValueError, match=r"lacks \['epoch'"):
        dist.load_state_dict({"steps": 1})


def test_datasets_from_a_function_resume_after_the_saved_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def dataset_fn(ctx: Any) -> list[np.ndarray]:
        size = ctx.get_per_replica_batch_size(4)
        return [np.arange(i, i + size) for i in range(0, 24, size)]

    strategy = _mirrored(2)
    dist = strategy.distribute_datasets_from_function(dataset_fn)
    it = iter(dist)
    first = [strategy.experimental_local_results(next(it)) for _ in range(2)]
    assert [[v.tolist() for v in step] for step in first] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    path = cd.train.Checkpoint(data=dist).save(tmp_path / "ckpt")
    again = strategy.distribute_datasets_from_function(dataset_fn)
    cd.train.Checkpoint(data=again).restore(path)
    rest = [[v.tolist() for v in strategy.experimental_local_results(step)] for step in again]
    assert rest[0] == [[8, 9], [10, 11]]
    assert len(rest) == 4

    per_replica = strategy.distribute_datasets_from_function(
        dataset_fn,
        cd.InputOptions(experimental_replication_mode=cd.InputReplicationMode.PER_REPLICA),
    )
    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        cd.train.Checkpoint(data=per_replica).restore(path)
        next(iter(per_replica))
    assert "saved with 1 input pipelines and this job has 2" in caplog.text
