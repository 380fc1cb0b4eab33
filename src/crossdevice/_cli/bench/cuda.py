"""`crossdevice bench --cuda`: the cross-device ops on CUDA GPUs against raw NCCL.

For each size (bytes of float32 per GPU) and op (SUM, MEAN), every cross-device op
(`NcclAllReduce`, `HierarchicalCopyAllReduce`, `ReductionToOneDevice`) all-reduces one
pre-packed buffer per GPU through the public `batch_reduce`. The same buffers are
all-reduced by `torch.cuda.nccl.all_reduce` (in place, and out of place: results that
must not overwrite their inputs, as crossdevice's) and, where one CUDA device is in use,
by a world-1 torch.distributed NCCL process group (an in-process `HashStore`). The
output says which comparisons could not run and why.

Columns follow nccl-tests: size (bytes per GPU), count (elements), type, redop,
time (µs), algbw = size / time, busbw = algbw · 2(n-1)/n, and the time relative to
`torch.cuda.nccl.all_reduce` in place. Times are medians over `--repeats` rounds; each
round times `-n` calls of every implementation in turn (the order rotates from round to
round, so slow drift hits all alike), after `-w` warm-up calls, with every CUDA device
synchronised before and after (`torch.cuda.synchronize`): a call's asynchronous GPU work
is counted, not only its launch.

Example:
    crossdevice bench --cuda --cuda-sizes 1M,64M --gpus 0,1,2,3 -n 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from crossdevice._cli.bench.common import (
    RAW_IN_PLACE,
    Measurement,
    parse_size,
)

__all__ = [
    "Measurement",
    "add_arguments",
    "bus_bandwidth",
    "format_table",
    "interleaved_medians",
    "no_cuda_message",
    "run_cuda",
    "table_rows",
]

#: Exit status when there is no CUDA device to benchmark.
NO_CUDA_EXIT: Final = 2
#: Sizes per GPU when `--cuda-sizes` is not given.
DEFAULT_SIZES: Final = "1M,16M,64M,256M"
_HEADER: Final = (
    f"{'size':>12} {'count':>11} {'type':>6} {'redop':>5}  {'implementation':<44}"
    f" {'time(us)':>10} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'x nccl':>7}"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--cuda` and its options to the `bench` parser (`-n`/`-w` are shared)."""
    add = parser.add_argument
    add("--cuda", action="store_true", help="benchmark the cross-device ops on CUDA GPUs")
    add(
        "--cuda-sizes",
        type=lambda text: [parse_size(s) for s in text.split(",") if s.strip()],
        default=[parse_size(s) for s in DEFAULT_SIZES.split(",")],
        help=f"with --cuda: bytes of float32 per GPU, comma-separated ({DEFAULT_SIZES})",
    )
    add(
        "--gpus",
        default="all",
        help="with --cuda: GPU indices (logical GPUs included), e.g. 0,1,2,3 (all)",
    )
    add("--repeats", type=int, default=5, help="with --cuda: rounds to take the median of (5)")


def bus_bandwidth(algbw: float, n: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: `algbw * 2 (n - 1) / n` (0 for one GPU)."""
    return algbw * 2 * (n - 1) / n if n > 0 else 0.0


def no_cuda_message(reason: str) -> str:
    """What `bench --cuda` prints when there is nothing to benchmark."""
    return (
        f"crossdevice bench --cuda: no CUDA device to benchmark ({reason}). It needs torch "
        "with CUDA and at least one visible GPU; without one, run `crossdevice bench` "
        "(host replicas) instead."
    )


def table_rows(
    measurements: Sequence[Measurement], n: int, type_name: str = "float", itemsize: int = 4
) -> list[dict[str, Any]]:
    """nccl-tests rows for `measurements` taken with `n` GPUs.

    The ratio is the time over `torch.cuda.nccl.all_reduce` in place at the same size and
    op (None where either could not run).
    """
    base = {
        (m.nbytes, m.op): m.seconds
        for m in measurements
        if m.impl == RAW_IN_PLACE and m.seconds is not None
    }
    rows = []
    for m in measurements:
        row: dict[str, Any] = {
            "size": m.nbytes,
            "count": m.nbytes // itemsize,
            "type": type_name,
            "redop": m.op,
            "impl": m.impl,
            "gpus": n,
            "time_us": None,
            "algbw": None,
            "busbw": None,
            "vs_nccl": None,
            "note": m.note,
        }
        if m.seconds is not None and m.seconds > 0:
            algbw = m.nbytes / m.seconds / 1e9
            reference = base.get((m.nbytes, m.op))
            row.update(
                time_us=m.seconds * 1e6,
                algbw=algbw,
                busbw=bus_bandwidth(algbw, n),
                vs_nccl=m.seconds / reference if reference else None,
            )
        rows.append(row)
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The rows as nccl-tests-style text lines, header first; `n/a` and a note where absent."""

    def number(value: float | None, spec: str, width: int) -> str:
        return f"{value:{width}{spec}}" if value is not None else f"{'n/a':>{width}}"

    lines = [_HEADER]
    for row in rows:
        line = (
            f"{row['size']:>12} {row['count']:>11} {row['type']:>6} {row['redop']:>5}  "
            f"{row['impl']:<44} {number(row['time_us'], '.1f', 10)} "
            f"{number(row['algbw'], '.2f', 11)} {number(row['busbw'], '.2f', 11)} "
            f"{number(row['vs_nccl'], '.2f', 7)}"
        )
        if row["note"]:
            line += f"  # {row['note']}"
        lines.append(line)
    return lines


def interleaved_medians(
    fns: dict[str, Callable[[], Any]],
    sync: Callable[[], None],
    *,
    warmup: int,
    iters: int,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds per call of each function, timed in rotating interleaved rounds.

    Args:
        fns: the implementations, by name.
        sync: waits until every device is idle (called before and after each timing).
        warmup: untimed calls of each function first.
        iters: calls per timing.
        repeats: rounds; round r starts with the r-th function.
        clock: the timer.

    Returns:
        Per name, the median over rounds of (elapsed / iters).
    """
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            fn = fns[name]
            sync()
            start = clock()
            for _ in range(iters):
                fn()
            sync()
            samples[name].append((clock() - start) / iters)
    return {name: statistics.median(times) for name, times in samples.items()}


def run_cuda(args: argparse.Namespace) -> int:
    """Run `bench --cuda`; returns the exit status (2 without CUDA, 1 if a result is wrong)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        print(no_cuda_message("torch is not installed"), file=sys.stderr)
        return NO_CUDA_EXIT
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print(no_cuda_message("torch.cuda.is_available() is False"), file=sys.stderr)
        return NO_CUDA_EXIT
    from crossdevice._cli.bench.cuda_cases import measure_all

    iters, warmup, repeats = int(args.iters), int(args.warmup_iters), int(args.repeats)
    if iters < 1 or warmup < 0 or repeats < 1:
        raise SystemExit(
            "crossdevice bench --cuda: -n and --repeats must be >= 1 and -w >= 0, received "
            f"-n {iters}, -w {warmup}, --repeats {repeats}"
        )
    header, measurements, n, wrong = measure_all(
        sizes=list(args.cuda_sizes),
        gpus=str(args.gpus),
        timer=lambda fns, sync: interleaved_medians(
            fns, sync, warmup=warmup, iters=iters, repeats=repeats
        ),
        out=print,
    )
    rows = table_rows(measurements, n)
    for line in [*header, *format_table(rows)]:
        print(line)
    if getattr(args, "json", None):
        import json

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    return 1 if wrong else 0
