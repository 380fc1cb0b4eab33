"""Multi-worker benchmarks: start their workers on this host, time them taking turns.

`launch` runs `python -m MODULE ARGS --worker` in each worker with torchrun's variables
(`RANK`, `WORLD_SIZE`, `MASTER_ADDR=127.0.0.1`, ...) and one OpenMP thread (torchrun's
default); all are killed at the deadline. `take_turns` times implementations in the
workers, interleaved. `size` and `knob` read sizes (`4M`) and tuning thresholds
(`ring_min_bytes=4M`) from a command line; `tuning_option` and `set_tunings` give a
benchmark its `--tuning`.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = [
    "balanced_orders",
    "knob",
    "launch",
    "launch_or_work",
    "set_tunings",
    "size",
    "take_turns",
    "tuning_option",
]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size(text: str) -> int:
    """`4M` -> 4194304."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1:] if text[-1:] in _UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * _UNITS[unit])


def knob(item: str) -> tuple[str, int | float]:
    """`ring_min_bytes=4M` -> ("ring_min_bytes", 4194304): a tuning threshold to set."""
    name, _, value = item.partition("=")
    return name, float(value) if name.endswith("_seconds") else size(value)


def tuning_option(parser: argparse.ArgumentParser, example: str) -> None:
    """Add `--tuning NAME=VALUE ...`: thresholds every worker sets (`set_tunings`)."""
    parser.add_argument(
        "--tuning",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help=f"thresholds to set in every worker (crossdevice._core.tuning), e.g. {example}",
    )


def set_tunings(items: list[str]) -> None:
    """In a worker: set the `--tuning` thresholds, to measure them against their defaults."""
    if items:
        from crossdevice._core import tuning

        tuning.set_tuning(**dict(knob(item) for item in items))


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
    worker's time). Every round runs each implementation once, in an order that changes
    from round to round (`balanced_orders`), so that drifts of a shared machine reach
    every one alike, and each comes right after each other equally often: the call just
    before a timed one moves its time (a rotation A B C, B C A, C A B puts B right after
    A in 2 rounds of 3 and never A right after B; the same code timed against itself
    that way took 0.92x, where balanced it took 0.98x at 1 MiB).
    """
    names = list(calls)
    orders = balanced_orders(len(names))
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + rounds):
        for k in orders[i % len(orders)]:
            name = names[k]
            barrier()
            start = time.perf_counter()
            for _ in range(repeat):
                calls[name]()
            if until_all:
                barrier()
            if i >= warmup:
                times[name].append((time.perf_counter() - start) / repeat)
    return times


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of `n` implementations in which each comes right after each other equally often.

    A Williams design: the first order is 0, 1, n-1, 2, n-2, ...; the others add 1, 2, ...
    to it (mod n), and for an odd `n` their reverses follow. Over all the orders, each
    ordered pair (a, b), a != b, is adjacent the same number of times (once; twice for
    an odd `n`).
    """
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    orders = [[(k + shift) % n for k in first] for shift in range(n)]
    if n % 2:
        orders += [order[::-1] for order in orders]
    return orders
