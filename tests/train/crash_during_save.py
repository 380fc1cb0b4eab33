"""`python -m tests.train.crash_during_save DIR`: a job that dies in the middle of a save.

It saves `ckpt-1` (value 1.0) and waits for it, then starts `ckpt-2` (value 2.0) with a
write that puts half of its data on disk and then stops; it prints `writing` and sleeps
until the test kills it with SIGKILL. That is a crash at the worst moment: after the
data files were started, before the checkpoint was complete.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import crossdevice as cd
from crossdevice._train import storage


def main(directory: str) -> None:
    value = cd.Variable(np.full(1000, 1.0, np.float32))
    manager = cd.train.CheckpointManager(cd.train.Checkpoint(value=value), directory, 3)
    manager.save()
    manager.sync()

    def stuck_write(tmp: Path, arrays: Any) -> None:
        (tmp / "arrays.npz").write_bytes(b"PK\x03\x04 half of the data")
        print("writing", flush=True)
        time.sleep(600)

    storage._write_npz = stuck_write  # type: ignore[assignment]
    value.assign(np.full(1000, 2.0, np.float32))
    manager.save()
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1])
