"""A user's training script whose rank 0 dies: `python -m tests.multi_worker.dying_chief`.

Run under torchrun's variables. Every rank all-reduces once; then rank 0 kills itself
(SIGKILL: the process serving the c10d store is gone) and the others all-reduce again,
with nothing catching the error: what they print is what a user sees.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

import crossdevice as cd


def main() -> None:
    local = int(os.environ.get("LOCAL_REPLICAS", "1"))
    cd.config.set_logical_cpu_devices(max(local, 2))
    strategy = cd.MultiWorkerMirroredStrategy(
        devices=[f"CPU:{i}" for i in range(local)],
        communication_options=cd.experimental.CommunicationOptions(timeout_seconds=30.0),
    )

    def step() -> object:
        return cd.get_replica_context().all_reduce("sum", np.float32(1))

    strategy.run(step)
    if int(os.environ["RANK"]) == 0:
        # Die while the others wait for this worker in the next step, polling the store
        # it serves: their store calls in flight fail.
        time.sleep(float(os.environ.get("DIE_AFTER", "1.0")))
        os.kill(os.getpid(), signal.SIGKILL)
    strategy.run(step)  # raises WorkerFailedError on the survivors


if __name__ == "__main__":
    main()
