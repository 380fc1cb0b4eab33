"""Multi-worker benchmarks: start their workers on this host, time them taking turns.

`launch` runs `python -m MODULE ARGS --worker` in each worker with torchrun's variables
(`RANK`, `WORLD_SIZE`, `MASTER_ADDR=127.0.0.1`, ...) and one OpenMP thread (torchrun's
default); all are killed at the deadline. `take_turns` times implementations in the
workers, interleaved.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = ["launch", "launch_or_work", "take_turns"]


def launch_or_work(
    module: str,
    parser: argparse.ArgumentParser,
    argv: list[str],
    worker: Callable[[argparse.Namespace], None],
    deadline: float,
) -> int:
    """Parse `argv` (adding `--workers` and `--deadline`); be a worker, or launch them."""
    parser.add_argument("--workers", type=int, default=2, help="processes to launch (2)")
    parser.add_argument("--deadline", type=float, default=deadline, help="kill after (s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return launch(module, args.workers, [a for a in argv if a != "--worker"], args.deadline)


def launch(module: str, workers: int, argv: list[str], deadline: float) -> int:
    """Run `workers` processes of `module` (with `--worker`); the worst exit code."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(workers):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(workers),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(workers),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        command = [sys.executable, "-m", module, *argv, "--worker"]
        procs.append(subprocess.Popen(command, env=env))
    end = time.monotonic() + deadline
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(1.0, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return max(codes)


def take_turns(
    calls: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int,
    barrier: Callable[[], object],
    repeat: int = 1,
    until_all: bool = False,
) -> dict[str, list[float]]:
    """Seconds per call of each of `calls`, `rounds` samples each after `warmup` untimed.

    Each sample is `repeat` calls back to back after `barrier()` (every worker starts
    together); `until_all` also waits at a barrier before the clock stops (the slowest
    worker's time). The implementations take turns in a rotating order (A B C, B C A,
    ...), so that drifts of a shared machine reach every one alike.
    """
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + rounds):
        turn = i % len(names)
        for name in names[turn:] + names[:turn]:
            barrier()
            start = time.perf_counter()
            for _ in range(repeat):
                calls[name]()
            if until_all:
                barrier()
            if i >= warmup:
                times[name].append((time.perf_counter() - start) / repeat)
    return times
