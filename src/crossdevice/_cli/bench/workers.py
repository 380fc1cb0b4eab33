"""`crossdevice bench --multi-worker`: all-reduce across worker processes.

Run one process per worker (`torchrun --standalone --nproc-per-node 2 -m crossdevice bench
--multi-worker`). For each size, every worker holds one float buffer and these ways of
all-reducing it are timed, interleaved call by call so drift on a shared machine hits all
of them alike:

* `torch`: `torch.distributed.all_reduce` on the buffer itself (the baseline);
* `torch+copy`: a copy of the input into a reused buffer, then `torch.distributed.
  all_reduce` of that: the floor for any all-reduce that leaves its input unmodified,
  as the strategy's must (its cost over `torch` is the copy's alone);
* `comm`: crossdevice's `ProcessGroupCommunicator.all_reduce` of a buffer it may reduce
  in place (`donate=True`), as the strategy's own buffers are;
* `strategy`: `MultiWorkerMirroredStrategy.extended.reduce_to` of a per-replica value to
  its own device, the path `ReplicaContext.all_reduce` takes (local sum, cross-worker
  all-reduce, local broadcast). Workers on one host reduce through shared memory
  (`_comm/workers/shared_memory.py`);
* `strategy-gloo`: the same on a strategy built with `CROSSDEVICE_SHARED_MEMORY=0`, as
  workers on different hosts run it (every byte through Gloo, plus the API's copy).

Each iteration times `-m` calls of one implementation back to back (nccl-tests'
`--agg_iters`: what a training loop's consecutive collectives see, without the skew a
barrier before every single call adds); the implementations take turns in a rotating
order. Rank 0 prints nccl-tests' columns (time, algbw = S/t, busbw = algbw * 2(n-1)/n) and each
implementation's overhead against `torch` as the median of the per-call time ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np

__all__ = ["run_multi_worker"]

SHARED_MEMORY_ENV = "CROSSDEVICE_SHARED_MEMORY"

_IMPLS = ("torch", "torch+copy", "comm", "strategy", "strategy-gloo")


def run_multi_worker(args: argparse.Namespace) -> int:
    """Benchmark cross-worker all-reduce on this worker; rank 0 prints the table."""
    import torch

    import crossdevice
    from crossdevice._cli.bench.common import DTYPES, REDOPS, sizes_between

    strategy = crossdevice.MultiWorkerMirroredStrategy(devices=["CPU:0"])
    extended: Any = strategy.extended
    comm = extended._worker_communicator
    gloo: Any = None
    if comm is not None:
        with mock.patch.dict(os.environ, {SHARED_MEMORY_ENV: "0"}):
            gloo = crossdevice.MultiWorkerMirroredStrategy(devices=["CPU:0"]).extended
    if comm is None:
        raise SystemExit(
            "bench --multi-worker needs several workers: launch it with "
            "`torchrun --standalone --nproc-per-node 2 -m crossdevice bench --multi-worker`"
        )
    dtype = np.dtype(DTYPES[args.datatype])
    op = REDOPS[args.op]
    chief = comm.rank == 0
    if chief:
        transport = "shared memory" if comm.shared_memory is not None else "Gloo"
        print(
            f"# crossdevice bench --multi-worker: {comm.world_size} workers, 1 replica each; "
            f"`strategy` all-reduces through {transport}, `strategy-gloo` through Gloo"
        )
        print(f"# torch {torch.__version__}, crossdevice {crossdevice.__version__}")
        print(
            f"# {'size':>12} {'count':>10} {'type':>7} {'redop':>5} {'impl':>13} "
            f"{'time(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'overhead':>9}"
        )
    rows: list[dict[str, Any]] = []
    for size in sizes_between(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes):
        for row in _measure(extended, gloo, size, dtype, op, args):
            rows.append(row)
            if chief:
                _print_row(row)
    if chief:
        _print_summary(rows, args.json)
    return 1 if any(r["wrong"] for r in rows) else 0


def _measure(
    extended: Any, gloo: Any, size: int, dtype: np.dtype, op: Any, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Time the implementations on one size, interleaved call by call."""
    import torch
    import torch.distributed as dist

    from crossdevice._values.values import PerReplica

    comm = extended._worker_communicator
    rank, world, group = comm.rank, comm.world_size, comm.host_group
    count = max(size // dtype.itemsize, 1)
    mine = np.full(count, rank + 1, dtype=dtype)
    expected = np.full(count, world * (world + 1) / 2, dtype=dtype)
    if op.name == "MEAN":
        expected = expected / world
    baseline = torch.from_numpy(mine.copy())
    value = PerReplica([mine], devices=[extended.worker_devices[0]])
    donated = mine.copy()
    scratch = torch.empty_like(baseline)
    source = torch.from_numpy(mine)

    def copy_then_reduce() -> Any:
        scratch.copy_(source)
        return dist.all_reduce(scratch, group=group)

    calls: dict[str, Callable[[], Any]] = {
        "torch": lambda: dist.all_reduce(baseline, group=group),
        "torch+copy": copy_then_reduce,
        "comm": lambda: comm.all_reduce([donated], op, donate=True)[0],
        "strategy": lambda: extended.reduce_to(op, value, destinations=value),
        "strategy-gloo": lambda: gloo.reduce_to(op, value, destinations=value),
    }
    times: dict[str, list[float]] = {name: [] for name in _IMPLS}
    batch = max(1, args.agg_iters)
    for i in range(args.warmup_iters + args.iters):
        turn = i % len(_IMPLS)
        for name in _IMPLS[turn:] + _IMPLS[:turn]:
            baseline.copy_(torch.from_numpy(mine))  # the in-place callers get fresh input
            donated[...] = mine
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(batch):
                calls[name]()
            if i >= args.warmup_iters:
                times[name].append((time.perf_counter() - start) / batch)
    rows = []
    for name in _IMPLS:
        baseline.copy_(torch.from_numpy(mine))
        donated[...] = mine
        result = np.asarray(calls[name]())
        if name in ("torch", "torch+copy"):
            reduced = baseline if name == "torch" else scratch
            result = reduced.numpy() / (world if op.name == "MEAN" else 1)
        median = statistics.median(times[name])
        ratios = [t / b for t, b in zip(times[name], times["torch"], strict=True)]
        algbw = size / median / 1e9
        rows.append(
            {
                "size": size,
                "count": count,
                "type": str(dtype),
                "redop": args.op,
                "impl": name,
                "time_us": median * 1e6,
                "algbw": algbw,
                "busbw": algbw * 2 * (world - 1) / world,
                "wrong": int(np.sum(result != expected)),
                "overhead_vs_torch": statistics.median(ratios) - 1.0,
                "workers": world,
            }
        )
    return rows


def _print_row(row: dict[str, Any]) -> None:
    print(
        f"  {row['size']:>12} {row['count']:>10} {row['type']:>7} {row['redop']:>5} "
        f"{row['impl']:>13} {row['time_us']:>10.1f} {row['algbw']:>7.3f} {row['busbw']:>7.3f} "
        f"{row['wrong']:>6} {row['overhead_vs_torch'] * 100:>8.1f}%",
        flush=True,
    )


def _print_summary(rows: list[dict[str, Any]], json_path: str | None) -> None:
    for name in _IMPLS[1:]:
        big = [r["overhead_vs_torch"] for r in rows if r["impl"] == name and r["size"] >= 1 << 20]
        if big:
            print(
                f"# {name}: largest overhead vs torch.distributed.all_reduce for sizes >= 1 MiB: "
                f"{max(big) * 100:.1f}% (median of per-call time ratios)"
            )
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"rows": rows}, fh, indent=1)
