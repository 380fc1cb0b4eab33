"""Rank 1's program ends between steps: `python -m tests.multi_worker.ending_worker HOW`.

Run under torchrun's variables, two workers. Both run a step; then rank 1's program ends
outside `strategy.run`, HOW: `raise` (an uncaught `ValueError`), `sigint` (Ctrl-C: an
uncaught `KeyboardInterrupt`) or `exit` (`sys.exit(3)`, a deliberate end). Rank 0 runs
the next step and prints the error it gets as its last line (`ERROR <type>: <message>`).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import crossdevice as cd


def main(how: str) -> None:
    strategy = cd.MultiWorkerMirroredStrategy(
        communication_options=cd.experimental.CommunicationOptions(timeout_seconds=30.0),
    )

    def step() -> object:
        return cd.get_replica_context().all_reduce("sum", np.float32(1))

    strategy.run(step)
    if int(os.environ["RANK"]) == 1:
        if how == "raise":
            raise ValueError("the config file is unreadable")
        if how == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(10.0)  # the KeyboardInterrupt comes first
        sys.exit(3)
    try:
        strategy.run(step)
    except Exception as err:
        print(f"ERROR {type(err).__name__}: {err}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
