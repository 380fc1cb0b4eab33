"""Shared helpers for the benchmark scripts: timing, workloads, replica threads, output.

Every script reports medians of at least five runs, and ratios between numbers measured
in the same run. The workloads and the timing loop live in `_workloads` (NumPy only), so
that `tf_reference.py`, run by TensorFlow's interpreter, times the same work the same way.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import crossdevice
from benchmarks._workloads import batch_sizes, median_seconds
from crossdevice._arrays.host_kernels import available_cpus
from crossdevice._cli.bench.impls import ReplicaThreads

__all__ = [
    "REPLICAS",
    "batch_sizes",
    "median_seconds",
    "parser",
    "replica_median_seconds",
    "report",
    "setup_devices",
    "versions",
]

#: Logical CPU devices (replicas) of every workload, as in the issue's TF runs.
REPLICAS = 4


def replica_median_seconds(
    threads: ReplicaThreads,
    step: Callable[[int], Any],
    runs: int = 9,
    inner: int = 1,
    warmup: int = 2,
) -> tuple[float, list[float]]:
    """Like `median_seconds` for a collective made by every replica thread.

    Each run is `inner` back-to-back calls of `step(replica_id)` on every replica thread,
    timed from the start signal to the last replica's return.
    """

    def block(count: int) -> Callable[[int], None]:
        def body(r: int) -> None:
            for _ in range(count):
                step(r)

        return body

    threads.run(block(warmup))
    times = []
    body = block(inner)
    for _ in range(runs):
        start = time.perf_counter()
        threads.run(body)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times), times


def versions() -> dict[str, Any]:
    """Versions and machine facts for the JSON output."""
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "crossdevice": crossdevice.__version__,
        "cpus": available_cpus(),
        "platform": platform.platform(),
    }
    if "torch" in sys.modules:
        out["torch"] = sys.modules["torch"].__version__
    return out


def parser(description: str) -> argparse.ArgumentParser:
    """The common command line: `--runs` and `--json FILE`."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--runs", type=int, default=9, help="timed runs; medians are reported (9)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    return p


def report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Write `results` (plus versions) to `args.json` when asked."""
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": versions(), "runs": args.runs, "results": results}, f, indent=2)
        print(f"wrote {args.json}")


def setup_devices(n: int = REPLICAS) -> list[str]:
    """Offer `n` logical CPU devices (TF: `set_logical_device_configuration`)."""
    if crossdevice.config.get_logical_cpu_devices() < n:
        crossdevice.config.set_logical_cpu_devices(n)
    return [f"CPU:{i}" for i in range(n)]
