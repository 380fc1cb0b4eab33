"""Two processes: one serves a c10d store and dies; the other's `HealthBoard` then looks.

`python -m tests.multi_worker.store_host_exit serve PORT DIR` serves the store until the
file DIR/joined exists, then exits at once (`os._exit`, as a crashed rank 0).
`... look PORT DIR` joins as rank 1, creates DIR/joined, waits until DIR/gone exists (the
test creates it once the server has exited), runs `HealthBoard.check()` and prints what
it reports. Every call its board makes to the dead store fails; what reaches stderr is
what the test checks. Each wait is bounded (30 s).
"""

from __future__ import annotations

import datetime
import os
import sys
import time

_WAIT_SECONDS = 30.0


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + _WAIT_SECONDS
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {_WAIT_SECONDS} s")
        time.sleep(0.01)


def serve(port: int, directory: str) -> None:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    _wait_for(os.path.join(directory, "joined"))
    del store
    os._exit(0)


def look(port: int, directory: str) -> None:
    from torch.distributed import PrefixStore, TCPStore

    from crossdevice._comm.workers.health import HealthBoard

    def connect() -> object:
        timeout = datetime.timedelta(seconds=5)
        return PrefixStore("health/", TCPStore("127.0.0.1", port, 2, False, timeout=timeout))

    board = HealthBoard(connect, rank=1, world_size=2, store_host=0)
    open(os.path.join(directory, "joined"), "w").close()
    _wait_for(os.path.join(directory, "gone"))
    for failure in board.check():
        print(f"failure: rank {failure.rank} {failure.reason}", flush=True)
    board.stop()


if __name__ == "__main__":
    (serve if sys.argv[1] == "serve" else look)(int(sys.argv[2]), sys.argv[3])
