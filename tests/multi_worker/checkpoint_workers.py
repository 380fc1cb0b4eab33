"""Worker side of the multi-worker checkpoint tests (module level, for the harness)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np

from tests.train.test_data_position import ShuffledBatches


def _strategy(local: int) -> Any:
    import crossdevice as cd

    cd.config.set_logical_cpu_devices(max(local, 2))
    options = cd.experimental.CommunicationOptions(timeout_seconds=60)
    return cd.MultiWorkerMirroredStrategy(
        communication_options=options, devices=[f"CPU:{i}" for i in range(local)]
    )


def _job(strategy: Any, directory: str) -> tuple[Any, Any, Any]:
    import crossdevice as cd

    with strategy.scope():
        w = cd.Variable(np.zeros(2, np.float32))
        seen = cd.Variable(np.float32(0), synchronization="on_read", aggregation="sum")
    dist = strategy.experimental_distribute_dataset(ShuffledBatches(8))
    ckpt = cd.train.Checkpoint(w=w, seen=seen, data=dist)
    return cd.train.CheckpointManager(ckpt, directory, max_to_keep=3), dist, (w, seen)


def train_save_train(rank: int, world_size: int, directory: str, local: int) -> dict[str, Any]:
    """Train 4 steps, save (every worker takes part, the chief writes), finish the epoch.

    Returns the example ids each step gave this worker's replicas, before and after the
    save, and the values saved.
    """
    import crossdevice as cd

    np.random.seed(0)  # every worker reads the same global batches
    strategy = _strategy(local)
    manager, dist, (w, seen) = _job(strategy, directory)

    def step(batch: dict[str, Any]) -> None:
        ctx = cd.get_replica_context()
        w.assign_add(ctx.all_reduce("sum", np.asarray([batch["x"].sum(), len(batch["x"])])))
        seen.assign_add(np.float32(len(batch["x"])))

    log = []
    for batch in dist:
        strategy.run(step, args=(batch,))
        log.append([p.tolist() for p in strategy.experimental_local_results(batch["id"])])
        if len(log) == 4:
            np.random.seed(100 + rank)  # workers' random states differ from here on
            path = manager.save()
            saved = (w.numpy().tolist(), float(seen.numpy()), np.random.rand())
    manager.sync()
    return {"log": log, "path": path, "saved": saved}


def preempted_by_a_dead_peer(rank: int, world_size: int, directory: str) -> None:
    """Rank 1 dies (SIGKILL) at step 3; rank 0 must exit with the restart code, not hang."""
    import crossdevice as cd

    np.random.seed(0)
    strategy = _strategy(1)
    manager, dist, (w, _) = _job(strategy, directory)
    handler = cd.experimental.PreemptionCheckpointHandler(None, manager)

    def step(batch: dict[str, Any]) -> None:
        ctx = cd.get_replica_context()
        w.assign_add(ctx.all_reduce("sum", np.asarray([batch["x"].sum(), 1.0], np.float32)))

    with handler.watch_preemption_scope():  # also next(batches), which is a collective
        for batch in dist:
            handler.run(strategy.run, step, args=(batch,))
            if handler.total_run_calls == 2:
                manager.save()
            if handler.total_run_calls == 3 and rank == 1:
                manager.sync()
                os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError(f"rank {rank} finished the epoch: its dead peer went unnoticed")


def listing(directory: str) -> list[str]:
    """The checkpoint directory's entries (for the parent's checks)."""
    return sorted(p.name for p in Path(directory).iterdir())


def restore_from_each_workers_directory(
    rank: int, world_size: int, phases: list[list[str]]
) -> list[Any]:
    """For each phase, restore the latest checkpoint of `phase[rank]` (a directory).

    Returns, per phase, the restored value of `w` and the path, or the error's message.
    """
    import crossdevice as cd

    strategy = _strategy(1)
    with strategy.scope():
        w = cd.Variable(np.zeros(2, np.float32))
    ckpt = cd.train.Checkpoint(w=w)
    outcomes: list[Any] = []
    for directories in phases:
        w.assign(np.zeros(2, np.float32))
        manager = cd.train.CheckpointManager(ckpt, directories[rank], max_to_keep=3)
        try:
            path = manager.restore_or_initialize()
            outcomes.append((w.numpy().tolist(), path))
        except (RuntimeError, ValueError) as err:
            outcomes.append(f"{type(err).__name__}: {err}")
        manager.close()
    return outcomes


def save_on_the_chief_only(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Train 3 steps; then only the chief saves (`if rank == 0: save()`), the other ends.

    The other worker's program ends as any does: its exit handlers run (the strategy
    closes its communicator there), then it exits. Returns the chief's error.
    """
    import atexit
    import time

    import crossdevice as cd

    strategy = _strategy(1)
    with strategy.scope():
        w = cd.Variable(np.zeros(2, np.float32))
    manager = cd.train.CheckpointManager(cd.train.Checkpoint(w=w), directory, max_to_keep=2)
    for _ in range(3):
        strategy.run(lambda: w.assign_add(cd.get_replica_context().all_reduce("sum", w + 1)))
    if rank != 0:
        atexit._run_exitfuncs()  # what the interpreter does at the end of the program
        return {}
    start = time.monotonic()
    try:
        manager.save()
    except Exception as err:
        return {"type": type(err).__name__, "message": str(err), "at": time.monotonic() - start}
    return {"type": None, "counter": int(manager.checkpoint.save_counter.numpy())}
