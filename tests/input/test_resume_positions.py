"""A mid-epoch resume trains each example once, in the order of the uninterrupted run.

Shuffling DataLoaders in every form that draws differently (in process, worker
processes, persistent workers whose first `iter()` draws a base seed that later ones do
not, a generator of the loader's own), saved at epochs 0, 1 and 2 and restored into a
fresh loader (a new process's) on 3 and on 2 replicas; and datasets from a function
restored on another number of local replicas (the bug hunt of session 58, findings 2, 3).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._input.distributed import DistributedDatasetsFromFunction

pytestmark = pytest.mark.torch

NUM_EXAMPLES, BATCH, EPOCHS, SAVED_AFTER = 23, 5, 3, 2

#: num_workers, persistent_workers, a generator of the loader's own
LOADERS = {
    "in process": (0, False, False),
    "2 workers": (2, False, False),
    "2 persistent workers": (2, True, False),
    "2 persistent workers, own generator": (2, True, True),
}


def _loader(torch: Any, kind: str) -> Any:
    workers, persistent, own = LOADERS[kind]
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(NUM_EXAMPLES)),
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        persistent_workers=persistent,
        generator=torch.Generator().manual_seed(5) if own else None,
    )


def _mirrored(n: int) -> Any:
    return cd.MirroredStrategy([f"CPU:{i}" for i in range(n)])


def _step_ids(strategy: Any, batch: Any) -> list[int]:
    """The global batch's example ids, replica by replica (what each replica trains on)."""
    (ids,) = batch
    return [int(i) for part in strategy.experimental_local_results(ids) for i in part]


def _run(torch: Any, kind: str, save_at: int, path: Path) -> tuple[list[list[list[int]]], Any]:
    """The uninterrupted run's epochs (global batches of ids), saved at `save_at`'s step 2."""
    torch.manual_seed(0)
    strategy = _mirrored(3)
    dist = strategy.experimental_distribute_dataset(_loader(torch, kind))
    ckpt = cd.train.Checkpoint(data=dist)
    epochs, saved = [], None
    for epoch in range(EPOCHS):
        steps = []
        for batch in dist:
            steps.append(_step_ids(strategy, batch))
            if epoch == save_at and len(steps) == SAVED_AFTER:
                saved = ckpt.save(path / "ckpt")
        epochs.append(steps)
    return epochs, saved


@pytest.mark.parametrize("after", [3, 2])
@pytest.mark.parametrize("epoch", [0, 1, 2])
@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_a_mid_epoch_resume_trains_each_example_once_in_the_uninterrupted_order(
    torch_module: Any, tmp_path: Path, kind: str, epoch: int, after: int
) -> None:
    torch = torch_module
    full, saved = _run(torch, kind, epoch, tmp_path)
    torch.manual_seed(123)  # a new process: another random state until the restore
    strategy = _mirrored(after)
    again = strategy.experimental_distribute_dataset(_loader(torch, kind))  # never iterated
    cd.train.Checkpoint(data=again).restore(saved).assert_consumed()
    assert again.epoch == epoch
    rest = [[_step_ids(strategy, b) for b in again] for _ in range(epoch, EPOCHS)]

    resumed = full[epoch][:SAVED_AFTER] + rest[0]
    ids = sorted(i for step in resumed for i in step)
    assert ids == list(range(NUM_EXAMPLES)), "an example repeated or skipped"
    assert resumed == full[epoch]  # the uninterrupted order
    assert rest[1:] == full[epoch + 1 :]  # and the epochs after it


def test_an_epoch_restored_at_its_start_draws_as_a_later_iter(
    torch_module: Any, tmp_path: Path
) -> None:
    """Saved at epoch 0's end, the restored epoch 1 is a persistent loader's later iter()."""
    torch = torch_module
    torch.manual_seed(0)
    strategy = _mirrored(3)
    dist = strategy.experimental_distribute_dataset(_loader(torch, "2 persistent workers"))
    ckpt = cd.train.Checkpoint(data=dist)
    first = [_step_ids(strategy, b) for b in dist]
    saved = ckpt.save(tmp_path / "ckpt")
    second = [_step_ids(strategy, b) for b in dist]
    assert sorted(i for s in first for i in s) == list(range(NUM_EXAMPLES))

    torch.manual_seed(123)
    again = strategy.experimental_distribute_dataset(_loader(torch, "2 persistent workers"))
    cd.train.Checkpoint(data=again).restore(saved).assert_consumed()
    assert again.epoch == 1
    assert [_step_ids(strategy, b) for b in again] == second


def test_a_replay_a_used_persistent_loader_cannot_draw_is_refused(
    torch_module: Any, tmp_path: Path
) -> None:
    """Epoch 0 was the loader's first iter(); a loader iterated already cannot replay it."""
    torch = torch_module
    _, saved = _run(torch, "2 persistent workers", 0, tmp_path)
    strategy = _mirrored(3)
    used = strategy.experimental_distribute_dataset(_loader(torch, "2 persistent workers"))
    for _ in used:  # its workers are made
        pass
    cd.train.Checkpoint(data=used).restore(saved)
    with pytest.raises(ValueError, match="first iter\\(\\) of a DataLoader with persistent_wo"):
        next(iter(used))


def _fixed(ctx: Any) -> list[np.ndarray]:
    """Per-replica batches of 2 of this pipeline's shard of 36 example ids."""
    ids = np.arange(36)[ctx.input_pipeline_id :: ctx.num_input_pipelines]
    return [ids[i : i + 2] for i in range(0, len(ids), 2)]


def _derived(ctx: Any) -> list[np.ndarray]:
    """The same shard, batched by the replicas' share of a global batch of 12."""
    size = ctx.get_per_replica_batch_size(12)
    ids = np.arange(36)[ctx.input_pipeline_id :: ctx.num_input_pipelines]
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _worker(fn: Any, workers: int, index: int, local: int) -> Any:
    devices = tuple(f"CPU:{i}" for i in range(local))
    return DistributedDatasetsFromFunction(
        fn,
        devices=devices,
        num_workers=workers,
        worker_index=index,
        num_replicas_in_sync=workers * local,
    )


def _ids_of(steps: Any, count: int | None = None) -> list[int]:
    out: list[int] = []
    for taken, step in enumerate(steps, 1):
        parts = step.values if hasattr(step, "values") else (step,)
        out += [int(i) for part in parts for i in part]
        if taken == count:
            break
    return out


@pytest.mark.parametrize("fn", [_fixed, _derived], ids=["fixed batch", "derived batch"])
@pytest.mark.parametrize(
    ("workers", "before", "after"), [(1, 2, 3), (1, 3, 2), (1, 2, 1), (2, 2, 3), (2, 3, 2)]
)
def test_datasets_from_a_function_resume_on_another_local_replica_count(
    fn: Any, workers: int, before: int, after: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Each worker's pipeline goes on after the examples it handed out, on any replicas."""
    for index in range(workers):  # each worker's own pipeline and position
        shard = set(_ids_of(_worker(fn, workers, index, 1)))
        saving = _worker(fn, workers, index, before)
        it = iter(saving)
        seen = _ids_of(it, 2)
        state = it.state_dict()
        again = _worker(fn, workers, index, after)
        with caplog.at_level(logging.WARNING, logger="crossdevice"):
            again.load_state_dict(state)
            rest = _ids_of(again)
        assert sorted(seen + rest) == sorted(shard), (index, seen, rest)
        assert "input pipelines" not in caplog.text


def test_an_older_from_function_position_replays_its_steps_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A position of steps alone (examples 0) is replayed in steps, with a log line."""
    saving = _worker(_fixed, 1, 0, 2)
    it = iter(saving)
    seen = _ids_of(it, 2)
    state = {**it.state_dict(), "examples": 0}  # as written before examples were counted
    again = _worker(_fixed, 1, 0, 2)
    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        again.load_state_dict(state)
        rest = _ids_of(again)
    assert sorted(seen + rest) == list(range(36))
    assert "counts 2 steps and not the elements" in caplog.text
