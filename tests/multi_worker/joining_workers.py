"""Worker side of test_joining: some workers join, some never start, some come late.

`join(rank, world_size, plan, init_timeout, workdir)` does what `plan[rank]` says:

* `"join"` (the default): build a `MultiWorkerMirroredStrategy` and all-reduce once;
* `"absent"`: return at once, as a worker that was never started;
* `"late:S"`: join S seconds after the others (its imports done): a worker that
  starts later than the chief, so the chief gives up first;
* `"after:R"`: join once rank R has finished (its outcome recorded and its process
  about to exit): a worker that starts after the chief gave up and left;
* `"exit-when-joined:N"`: join, and exit the process (os._exit) once N workers have
  joined, as a chief that crashes while the others wait for a missing worker.

Every worker that tried to join leaves `done<rank>` in `workdir` when it has its outcome.
`init_timeout` (None: the environment's `CROSSDEVICE_INIT_TIMEOUT_SECONDS` or the
default) bounds the join.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from pathlib import Path
from typing import Any

#: No loop here waits longer than this (seconds); the harness kills the workers anyway.
_BOUND = 60.0


def _exit_when_joined(count: int) -> None:
    """Exit this process once `count` workers joined at its store (a daemon thread)."""
    from torch._C._distributed_c10d import TCPStore

    from crossdevice._core.cluster import resolve_cluster

    cluster = resolve_cluster()
    assert cluster is not None
    deadline = time.monotonic() + _BOUND
    client = None
    while time.monotonic() < deadline:
        try:
            if client is None:
                client = TCPStore(
                    cluster.master_addr,
                    cluster.master_port,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=1),
                    wait_for_workers=False,
                )
            if int(client.add("crossdevice/join/1/count", 0)) >= count:
                os._exit(3)
        except Exception:  # the store not up yet
            pass
        time.sleep(0.05)


def join(
    rank: int,
    world_size: int,
    plan: dict[int, str],
    init_timeout: float | None,
    workdir: str,
) -> dict[str, Any]:
    """This worker's part of `plan`: the outcome of building the strategy, timed."""
    del world_size
    action = plan.get(rank, "join")
    if action == "absent":
        return {"type": "absent"}
    if action.startswith("after:"):
        other = Path(workdir, f"done{action.split(':')[1]}")
        deadline = time.monotonic() + _BOUND
        while not other.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # its process exits right after
    import crossdevice as cd
    import crossdevice._comm.workers.communicator  # torch too: imported before the clock
    from crossdevice._core import tuning

    if init_timeout is not None:
        tuning.set_tuning(default_init_timeout_seconds=init_timeout)
    cd.config.set_logical_cpu_devices(1)
    if action.startswith("late:"):
        time.sleep(float(action.split(":")[1]))
    if action.startswith("exit-when-joined:"):
        count = int(action.split(":")[1])
        threading.Thread(target=_exit_when_joined, args=(count,), daemon=True).start()
    start = time.monotonic()
    try:
        strategy = cd.MultiWorkerMirroredStrategy(devices=["CPU:0"])
        value = float(strategy.run(lambda: cd.get_replica_context().all_reduce("sum", 1.0)))
        out: dict[str, Any] = {"type": None, "value": value}
    except Exception as err:
        out = {"type": type(err).__name__, "message": str(err)}
    out["elapsed"] = time.monotonic() - start
    Path(workdir, f"done{rank}").write_text("done")
    return out
