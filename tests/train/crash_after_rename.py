"""`python -m tests.train.crash_after_rename DIR`: a job that dies between commit and record.

It saves `ckpt-1` (value 1.0), then `ckpt-2` (value 2.0), and is killed with SIGKILL
right after `ckpt-2` was renamed into place, before the `checkpoint` file records it:
`ckpt-2` is complete on disk and not listed. It also leaves a `checkpoint` temp file, as
a crash in the middle of replacing that file does.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

import crossdevice as cd
from crossdevice._train import manager as manager_module


def main(directory: str) -> None:
    value = cd.Variable(np.full(10, 1.0, np.float32))
    manager = cd.train.CheckpointManager(cd.train.Checkpoint(value=value), directory, 3)
    manager.save()
    manager.sync()

    def dying_write_state(*args: Any, **kwargs: Any) -> None:  # after os.rename(tmp, ckpt-2)
        (Path(directory) / f".checkpoint.tmp-{os.getpid()}").write_text("model_checkpoint_pa")
        os.kill(os.getpid(), signal.SIGKILL)

    manager_module.write_state = dying_write_state  # type: ignore[assignment]
    value.assign(np.full(10, 2.0, np.float32))
    manager.save()
    manager.sync()


if __name__ == "__main__":
    main(sys.argv[1])
