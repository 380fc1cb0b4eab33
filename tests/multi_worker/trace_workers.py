"""Worker-side scenarios for the tracing tests (run in child processes)."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import numpy as np


def _strategy(local: int, timeout: float = 30.0) -> Any:
    import crossdevice as cd

    cd.config.set_logical_cpu_devices(max(local, 2))
    cd.config.set_replica_execution("threads")
    options = cd.experimental.CommunicationOptions(timeout_seconds=timeout)
    return cd.MultiWorkerMirroredStrategy(
        communication_options=options, devices=[f"CPU:{i}" for i in range(local)]
    )


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[tuple[int, str]] = []
        self.step = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((self.step, record.getMessage()))


def traced_steps(
    rank: int,
    world_size: int,
    local: int,
    slow_rank: int,
    delay: float,
    steps: int,
    k: int,
    path: str,
) -> dict[str, Any]:
    """`steps` training-like steps under `trace(path)`; worker `slow_rank` sleeps `delay` in each.

    Returns the straggler lines logged (with the step they came in) and the file written.
    """
    import crossdevice as cd

    strategy = _strategy(local)
    handler = _Lines()
    logging.getLogger("crossdevice").addHandler(handler)

    def step() -> Any:
        if rank == slow_rank:
            time.sleep(delay)
        return cd.get_replica_context().all_reduce("sum", np.ones(8, np.float32))

    strategy.run(step)  # the replica threads and the groups start: not traced
    with cd.experimental.trace(path, report_every=k) as session:
        for i in range(steps):
            handler.step = i + 1
            strategy.run(step)
    return {"lines": handler.lines, "written": session.written}


def traced_guesses(rank: int, world_size: int, path: str) -> list[tuple[int, int, str]]:
    """One replica per worker, traced: 6 steps all-reducing 8 floats, then 3 of 16.

    Returns (seq, bytes, guess) of every worker collective the trace recorded.
    """
    del rank, world_size
    import crossdevice as cd
    from crossdevice._trace.recorder import WORKER_LANE

    strategy = _strategy(1)

    def step(n: int) -> Any:
        return cd.get_replica_context().all_reduce("sum", np.ones(n, np.float32))

    with cd.experimental.trace(path) as session:
        for n in [8] * 6 + [16] * 3:
            strategy.run(step, args=(n,))
    data = json.loads(Path(session.written[0]).read_text())
    return [
        (e["args"]["seq"], e["args"]["bytes"], e["args"].get("guess", ""))
        for e in data["traceEvents"]
        if e["ph"] == "X" and e["tid"] == WORKER_LANE
    ]


def _report(message: str) -> dict[str, Any]:
    match = re.search(r"Flight recorder report: (\S+)\.txt", message)
    if match is None:
        return {"missing": message}
    data = json.loads(Path(match.group(1) + ".json").read_text())
    data["text"] = Path(match.group(1) + ".txt").read_text()
    return data


def stall_or_mismatch(rank: int, world_size: int, how: str) -> dict[str, Any]:
    """Three good steps of 2 local replicas, then worker 1 stalls (or all-reduces another shape)."""
    import crossdevice as cd

    strategy = _strategy(2, timeout=3.0)

    def good() -> Any:
        return cd.get_replica_context().all_reduce("sum", np.ones(4, np.float32))

    def bad() -> Any:
        if rank == 1 and how == "stall":
            time.sleep(30)  # stuck in user code
        n = 3 if rank == 1 and how == "mismatch" else 4
        return cd.get_replica_context().all_reduce("sum", np.ones(n, np.float32))

    for _ in range(3):
        strategy.run(good)
    try:
        strategy.run(bad)
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "report": _report(str(exc))}
    return {"type": None}
