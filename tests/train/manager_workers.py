"""Worker side of the multi-worker manager tests (module level, for the harness)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _names(paths: list[str]) -> list[str]:
    return [Path(p).name for p in paths]


def save_four_keep_two(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Save 4 checkpoints keeping 2; every worker's view, then a restarted manager's.

    Then saves inside `strategy.run`, which must fail on every worker before anything
    changes.
    """
    import crossdevice as cd

    del rank, world_size
    strategy = cd.MultiWorkerMirroredStrategy(devices=["CPU:0"])
    with strategy.scope():
        w = cd.Variable(np.zeros(2, np.float32))
    ckpt = cd.train.Checkpoint(w=w)
    manager = cd.train.CheckpointManager(ckpt, directory, max_to_keep=2)
    for _ in range(4):
        w.assign_add(np.ones(2, np.float32))
        manager.save()
    manager.sync()
    strategy.reduce(cd.ReduceOp.SUM, np.zeros(1), axis=None)  # the chief's record is on disk
    seen = {"checkpoints": _names(manager.checkpoints), "latest": manager.latest_checkpoint}
    manager.close()
    again = cd.train.CheckpointManager(ckpt, directory, max_to_keep=2)
    seen["restarted"] = _names(again.checkpoints)
    seen["restored"] = Path(again.restore_or_initialize() or "").name
    again.save()
    again.sync()
    seen["after_save"] = _names(again.checkpoints)
    # Last: a step that raises breaks the strategy's collectives (by design).
    try:
        strategy.run(again.save)
    except RuntimeError as err:
        seen["inside_run"] = str(err)
    seen["after_inside_run"] = (int(ckpt.save_counter.numpy()), w.numpy().tolist())
    return seen
