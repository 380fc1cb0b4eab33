"""Checkpoints of MultiWorkerMirroredStrategy jobs: written once, restored on any layout."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import crossdevice as cd
from crossdevice.experimental import RESTART_EXIT_CODE
from tests.multi_worker.checkpoint_workers import (
    preempted_by_a_dead_peer,
    restore_from_each_workers_directory,
    save_on_the_chief_only,
    train_save_train,
)
from tests.multi_worker.harness import run_workers
from tests.train.test_data_position import NUM_EXAMPLES, ShuffledBatches

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_2x2_saves_once_and_restores_on_1x4_at_the_next_global_batch(tmp_path: Path) -> None:
    results = [
        r.unwrap() for r in run_workers(train_save_train, 2, args=(str(tmp_path), 2), timeout=120)
    ]
    assert results[0]["path"] == results[1]["path"]
    # Written once per job: one checkpoint directory, the chief's.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "checkpoint", "ckpt-1"]
    # Each step's global batch: worker 0's two replicas, then worker 1's.
    steps = [r0 + r1 for r0, r1 in zip(results[0]["log"], results[1]["log"], strict=True)]

    strategy = cd.MirroredStrategy([f"CPU:{i}" for i in range(4)])
    with strategy.scope():
        w = cd.Variable(np.zeros(2, np.float32))
        seen = cd.Variable(np.float32(0), synchronization="on_read", aggregation="sum")
    dist = strategy.experimental_distribute_dataset(ShuffledBatches(8))
    ckpt = cd.train.Checkpoint(w=w, seen=seen, data=dist)
    np.random.seed(0)
    ckpt.restore(cd.train.latest_checkpoint(tmp_path)).assert_consumed()
    chief_w, chief_seen, chief_draw = results[0]["saved"]
    assert w.numpy().tolist() == chief_w
    assert float(seen.numpy()) == chief_seen == 32.0  # 4 steps of 8, summed over 4 replicas
    assert np.random.rand() == chief_draw  # worker 0's random state, on a 1-worker job
    rest = [
        [p.tolist() for p in strategy.experimental_local_results(batch["id"])] for batch in dist
    ]
    assert rest == steps[4:]  # the same global batches, now split 4 ways in one worker
    ids = [i for step in steps[:4] + rest for part in step for i in part]
    assert sorted(ids) == list(range(NUM_EXAMPLES))  # 0 repeated, 0 skipped


def test_a_dead_worker_makes_the_survivor_exit_with_the_restart_code(tmp_path: Path) -> None:
    start = time.monotonic()
    results = run_workers(preempted_by_a_dead_peer, 2, args=(str(tmp_path),), timeout=90)
    elapsed = time.monotonic() - start
    assert results[1].exitcode == -9, results[1].describe()
    assert results[0].exitcode == RESTART_EXIT_CODE, results[0].describe()
    assert "exiting with code 42 so the launcher restarts" in results[0].output
    assert elapsed < 60
    assert Path(cd.train.latest_checkpoint(tmp_path)).name == "ckpt-1"


def _save_one(directory: Path, value: list[float]) -> str:
    ckpt = cd.train.Checkpoint(w=cd.Variable(np.asarray(value, np.float32)))
    manager = cd.train.CheckpointManager(ckpt, directory, max_to_keep=1)
    path = manager.save()
    manager.close()
    assert path is not None
    return path


def test_workers_that_would_restore_different_checkpoints_all_fail(tmp_path: Path) -> None:
    # A checkpoint directory that is not on a shared file system: worker 1 sees another
    # directory (empty, or another run's ckpt-1 of the same name and save counter).
    shared, other, empty = tmp_path / "shared", tmp_path / "other", tmp_path / "empty"
    path = _save_one(shared, [1.0, 2.0])
    _save_one(other, [3.0, 4.0])
    empty.mkdir()
    damaged = tmp_path / "damaged"  # worker 0 cannot read its checkpoint: no one restores
    shutil.copytree(shared, damaged)
    data = next((damaged / "ckpt-1").glob("*.npz"))
    data.write_bytes(data.read_bytes()[:-1])
    phases = [[str(shared), str(empty)], [str(shared), str(shared)]]
    phases += [[str(shared), str(other)], [str(empty), str(empty)], [str(damaged), str(shared)]]
    results = run_workers(restore_from_each_workers_directory, 2, args=(phases,), timeout=60)
    outcomes = [r.unwrap() for r in results]
    for outcome in outcomes:
        assert "different checkpoints" in outcome[0]
        assert "worker 0: ckpt-1 (save_counter 1, save id " in outcome[0]
        assert "worker 1: no checkpoint (None)" in outcome[0]
        assert "shared file system" in outcome[0]
        assert outcome[1] == ([1.0, 2.0], path)  # the same checkpoint: restored
        assert "different checkpoints" in outcome[2]  # same name, another save
        assert outcome[2].count("ckpt-1 (save_counter 1, save id ") == 2
        assert outcome[3] == ([0.0, 0.0], None)
    assert outcomes[0][4].startswith("ValueError: ")
    assert "truncated" in outcomes[0][4]
    assert outcomes[1][4].startswith("RuntimeError: worker(s) [0] could not restore")


def test_a_save_on_the_chief_alone_says_the_peer_exited_without_calling_it(
    tmp_path: Path,
) -> None:
    # The other worker's program ended (its communicator closed at exit): it did not die,
    # and "Fix that worker's failure (see its log)" would send the user to a clean log.
    results = run_workers(save_on_the_chief_only, 2, args=(str(tmp_path),), timeout=90)
    assert results[1].unwrap() == {}
    out = results[0].unwrap()
    assert out["type"] == "WorkerFailedError", out
    message = out["message"]
    assert message.startswith(
        f"saving the checkpoint {str(tmp_path / 'ckpt-1')!r} did not finish: save() is "
        "collective, so every worker must call it"
    ), message
    assert "rank 1 (global replicas [1]) exited (closed its communicator) after its " in message
    assert "while this worker waited in all_reduce #" in message, message
    assert "died" not in message, message
    assert "Fix that worker" not in message, message
    assert out["at"] < 5.0  # at the next look at the board, not after a heartbeat timeout
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]  # nothing written
