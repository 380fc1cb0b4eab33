"""`crossdevice bench`: an nccl-tests style all-reduce benchmark for host replicas.

Prints one row per (size, implementation) with nccl-tests' columns (size, count, type,
redop, time, algbw, busbw, #wrong) plus the fraction of the memory-bandwidth limit: an
all-reduce of N host arrays of S bytes must read N·S bytes and write S, so it cannot beat
(N+1)·S / B at memory bandwidth B, which is measured in the same run (docs/design.md §4).

Flags follow nccl-tests: `-b/-e` smallest and largest size in bytes (K, M, G suffixes are
powers of 1024), `-f` the multiplication factor between sizes (`-i` the increment when
`-f` is 1), `-n` timed iterations, `-w` warm-up iterations, `-o` the reduce op, `-d` the
data type. Times are medians over the timed iterations.

Example:
    crossdevice bench -b 1K -e 64M -f 4 --ops sharded,reduce_to_one --json bench.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from crossdevice._arrays import host_kernels
from crossdevice._cli.bench.bandwidth import (
    MemoryBandwidth,
    all_reduce_limit_seconds,
    measure_memory_bandwidth,
)
from crossdevice._cli.bench.common import DTYPES, REDOPS, parse_size, sizes_between
from crossdevice._cli.bench.impls import IMPLEMENTATIONS, _Case
from crossdevice._core import tuning
from crossdevice._core.reduce_op import ReduceOp

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the `bench` subcommand to `subparsers` (an argparse subparsers action)."""
    parser = subparsers.add_parser(
        "bench",
        help="all-reduce benchmark (nccl-tests style) against the memory-bandwidth limit",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="implementations (--ops):\n"
        + "\n".join(f"  {name:14s} {impl.description}" for name, impl in IMPLEMENTATIONS.items()),
    )
    add = parser.add_argument
    add("-b", "--minbytes", type=parse_size, default=parse_size("1K"), help="smallest size (1K)")
    add("-e", "--maxbytes", type=parse_size, default=parse_size("64M"), help="largest size (64M)")
    add("-f", "--stepfactor", type=int, default=4, help="multiply the size by this (4)")
    add("-i", "--stepbytes", type=parse_size, default=parse_size("1M"), help="increment if -f 1")
    add("-n", "--iters", type=int, default=20, help="timed iterations per size (20)")
    add("-w", "--warmup_iters", type=int, default=5, help="warm-up iterations per size (5)")
    add(
        "-m",
        "--agg_iters",
        type=int,
        default=5,
        help="--multi-worker: calls timed back to back per iteration, as in a training loop (5)",
    )
    add("-o", "--op", choices=sorted(REDOPS), default="sum", help="reduce op (sum)")
    add("-d", "--datatype", choices=sorted(DTYPES), default="float", help="data type (float)")
    add(
        "--ops",
        default="sharded,reduce_to_one,hier_copy",
        help=f"comma-separated implementations from {sorted(IMPLEMENTATIONS)}",
    )
    add("--replicas", type=int, default=4, help="replicas (logical CPU devices) (4)")
    add("--backend", choices=["numpy", "torch"], default="numpy", help="array library")
    add("--bw-bytes", type=parse_size, default=parse_size("256M"), help="bandwidth probe size")
    add("--json", metavar="FILE", help="also write the results as JSON to FILE")
    add(
        "--plot",
        metavar="FILE.png",
        help="also draw bus bandwidth against size, with the memory limit (needs matplotlib)",
    )
    add(
        "--multi-worker",
        action="store_true",
        help="all-reduce across worker processes instead: launch with `torchrun "
        "--standalone --nproc-per-node 2 -m crossdevice bench --multi-worker`",
    )
    from crossdevice._cli.bench.cuda import add_arguments  # --cuda: GPUs against raw NCCL
    from crossdevice._cli.trace import add_trace_argument

    add_arguments(parser)
    add_trace_argument(parser)
    parser.set_defaults(func=run)


def _versions() -> dict[str, str]:
    import crossdevice

    versions = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "crossdevice": crossdevice.__version__,
    }
    try:
        versions["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        versions["torch"] = "not installed"
    return versions


def _make_case(
    nbytes: int, dtype_name: str, n: int, op: ReduceOp, backend: str, seed: int
) -> _Case:
    np_dtype = np.dtype("float32" if dtype_name == "bfloat16" else dtype_name)
    count = max(1, nbytes // np_dtype.itemsize)
    rng = np.random.default_rng(seed)
    if np_dtype.kind == "f":
        arrays = [rng.standard_normal(count).astype(np_dtype) for _ in range(n)]
    else:
        arrays = [rng.integers(0, 8, count).astype(np_dtype) for _ in range(n)]
    inputs: list[Any] = arrays
    if backend == "torch" or dtype_name == "bfloat16":
        import torch

        tensors = [torch.from_numpy(a) for a in arrays]
        if dtype_name == "bfloat16":
            tensors = [t.to(torch.bfloat16) for t in tensors]
        inputs = tensors
    from crossdevice._arrays import backend_for

    be = backend_for(inputs[0])
    expected = be.sum_n(inputs)
    if op is ReduceOp.MEAN:
        expected = be.divide(expected, n)
    tolerance = None
    if np_dtype.kind == "f":
        eps = 2.0**-7 if dtype_name == "bfloat16" else float(np.finfo(np_dtype).eps)
        magnitude = np.sum([np.abs(a.astype(np.float64)) for a in arrays], axis=0)
        tolerance = 2 * n * eps * magnitude / (n if op is ReduceOp.MEAN else 1)
    reference = np.asarray(be.to_numpy(expected))
    return _Case(inputs, reference, tolerance, count * np_dtype.itemsize, count)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a).reshape(-1)
    if a.itemsize in (1, 2, 4, 8):
        return a.view(f"u{a.itemsize}")
    return a.view(np.uint8).reshape(a.size, a.itemsize)


def _check(results: Sequence[Any], case: _Case) -> tuple[int, int]:
    """(#wrong, #inexact) elements over every replica's result.

    #wrong counts elements off by more than the rounding any summation order allows
    (nccl-tests' check); #inexact counts elements not bitwise equal to the in-order
    sum x0 + x1 + ... (crossdevice's determinism contract).
    """
    from crossdevice._arrays import backend_for

    expected = case.expected
    want = _bits(expected)
    wrong = inexact = 0
    for value in results:
        got = np.asarray(backend_for(value).to_numpy(value)).reshape(-1)
        if got.dtype != expected.dtype or got.size != expected.size:
            wrong += expected.size
            inexact += expected.size
            continue
        differs = _bits(got) != want
        if differs.ndim > 1:
            differs = differs.any(axis=1)
        inexact += int(np.count_nonzero(differs))
        if case.tolerance is None:
            wrong += int(np.count_nonzero(differs))
        else:
            error = np.abs(got.astype(np.float64) - expected.astype(np.float64))
            wrong += int(np.count_nonzero(~(error <= case.tolerance)))
    return wrong, inexact


def _kernel_description() -> str:
    from crossdevice._arrays import native

    if native.available():
        return (
            f"compiled fused sum, {native.instruction_set()} loop (non-temporal stores for "
            f"results of {tuning.TUNING.stream_min_bytes >> 20} MiB or more)"
        )
    return "NumPy blocked chain (compiled kernel not built, or CROSSDEVICE_NATIVE=0)"


def _header(args: argparse.Namespace, bw: MemoryBandwidth, ops: list[str]) -> list[str]:
    from crossdevice._core.devices import canonicalize

    n = args.replicas
    versions = _versions()
    devices = [canonicalize(f"CPU:{i}") for i in range(n)]
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    return [
        f"# crossdevice bench: all_reduce  minBytes {args.minbytes} maxBytes {args.maxbytes} "
        f"step: {step} warmup iters: {args.warmup_iters} iters: {args.iters} "
        f"op: {args.op} type: {args.datatype} backend: {args.backend}",
        "# versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"# replicas: {n} threads in one process, {host_kernels.available_cpus()} CPUs",
        f"# host sum kernel: {_kernel_description()}",
        f"# devices: {devices[0]} .. {devices[-1].rsplit('/', 1)[-1]} (logical CPU devices, "
        "host memory)",
        f"# memory bandwidth (np.copyto of {bw.copy_bytes >> 20} MiB, read+written, median "
        f"of {bw.repeats}): 1 thread {bw.single_thread / 1e9:.1f} GB/s, {bw.threads} threads "
        f"{bw.all_cores / 1e9:.1f} GB/s -> limit {bw.best / 1e9:.1f} GB/s",
        f"# limit of an all-reduce of N inputs of S bytes: (N+1)*S / {bw.best / 1e9:.1f} GB/s;"
        " %limit = limit time / measured time (sizes whose inputs fit in the last-level cache"
        " can exceed 100%)",
        "# implementations: " + ", ".join(ops),
        "#",
        f"# {'size':>11} {'count':>12} {'type':>8} {'redop':>6} {'impl':>14} {'time':>10} "
        f"{'algbw':>7} {'busbw':>7} {'#wrong':>7} {'%limit':>7}",
        f"# {'(B)':>11} {'(elements)':>12} {'':>8} {'':>6} {'':>14} {'(us)':>10} "
        f"{'(GB/s)':>7} {'(GB/s)':>7} {'':>7} {'':>7}",
    ]


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by `args`; returns the exit status (1 if any #wrong).

    With `--trace FILE`, the whole run is traced (`crossdevice.experimental.trace`).
    """
    from crossdevice._cli.trace import tracing

    with tracing(getattr(args, "trace", None)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "plot", None):
        if getattr(args, "multi_worker", False):
            raise SystemExit("crossdevice bench: --plot draws single-process runs only")
        from crossdevice._cli.bench.plot import require_matplotlib

        require_matplotlib()  # before the benchmark, not after minutes of it
    if getattr(args, "cuda", False):
        from crossdevice._cli.bench.cuda import run_cuda

        return run_cuda(args)
    if getattr(args, "multi_worker", False):
        from crossdevice._cli.bench.workers import run_multi_worker

        return run_multi_worker(args)
    n = int(args.replicas)
    if n < 1:
        raise SystemExit(f"crossdevice bench: --replicas must be >= 1, received {n}")
    ops = [name.strip() for name in str(args.ops).split(",") if name.strip()]
    unknown = [name for name in ops if name not in IMPLEMENTATIONS]
    if unknown or not ops:
        raise SystemExit(
            f"crossdevice bench: unknown --ops {unknown or ops!r}; choose from "
            f"{sorted(IMPLEMENTATIONS)}"
        )
    from crossdevice._core import devices as device_config

    if device_config.get_logical_cpu_devices() < n:
        device_config.set_logical_cpu_devices(n)
    op = REDOPS[args.op]
    dtype_name = DTYPES[args.datatype]
    sizes = sizes_between(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    bw = measure_memory_bandwidth(args.bw_bytes)
    for line in _header(args, bw, ops):
        print(line)
    impls = [IMPLEMENTATIONS[name](n, op) for name in ops]
    rows: list[dict[str, Any]] = []
    try:
        for seed, nbytes in enumerate(sizes):
            case = _make_case(nbytes, dtype_name, n, op, args.backend, seed)
            for impl in impls:
                times, results = impl.measure(case, args.warmup_iters, max(1, args.iters))
                wrong, inexact = _check(results, case)
                seconds = statistics.median(times)
                algbw = case.nbytes / seconds / 1e9
                busbw = algbw * 2 * (n - 1) / n
                limit = all_reduce_limit_seconds(n, case.nbytes, bw.best)
                row = {
                    "size": case.nbytes,
                    "count": case.count,
                    "type": args.datatype,
                    "redop": args.op,
                    "impl": impl.name,
                    "time_us": seconds * 1e6,
                    "algbw_GBps": algbw,
                    "busbw_GBps": busbw,
                    "wrong": wrong,
                    "inexact": inexact,
                    "limit_us": limit * 1e6,
                    "fraction_of_limit": limit / seconds,
                    "times_us": [t * 1e6 for t in times],
                }
                rows.append(row)
                print(
                    f"  {row['size']:>11} {row['count']:>12} {row['type']:>8} "
                    f"{row['redop']:>6} {row['impl']:>14} {row['time_us']:>10.1f} "
                    f"{algbw:>7.2f} {busbw:>7.2f} {row['wrong']:>7} "
                    f"{100 * row['fraction_of_limit']:>6.1f}%",
                    flush=True,
                )
    finally:
        for impl in impls:
            impl.close()
    summary = _summary(rows, ops, sizes[-1])
    for line in summary["lines"]:
        print(line)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "meta": {
                        "versions": _versions(),
                        "replicas": n,
                        "cpus": host_kernels.available_cpus(),
                        "host_sum_kernel": _kernel_description(),
                        "args": {k: v for k, v in vars(args).items() if k != "func"},
                    },
                    "bandwidth": bw.as_dict(),
                    "rows": rows,
                    "summary": {k: v for k, v in summary.items() if k != "lines"},
                },
                f,
                indent=2,
            )
    if getattr(args, "plot", None):
        from crossdevice._cli.bench.plot import plot_rows

        plot_rows(
            rows,
            args.plot,
            replicas=n,
            datatype=args.datatype,
            redop=args.op,
            bandwidth_gbps=bw.best / 1e9,
            note=_kernel_description(),
        )
        print(f"# plot: {args.plot}")
    return 1 if any(row["wrong"] for row in rows) else 0


def _summary(rows: list[dict[str, Any]], ops: list[str], largest: int) -> dict[str, Any]:
    lines = [
        "#",
        f"# Out of bounds values : {sum(r['wrong'] for r in rows)} "
        f"{'OK' if not any(r['wrong'] for r in rows) else 'FAILED'}",
    ]
    avg_busbw: dict[str, float] = {}
    largest_fraction: dict[str, float] = {}
    for name in ops:
        mine = [r for r in rows if r["impl"] == name]
        avg_busbw[name] = statistics.fmean(r["busbw_GBps"] for r in mine)
        last = max(mine, key=lambda r: r["size"])
        largest_fraction[name] = last["fraction_of_limit"]
        lines.append(
            f"# Avg bus bandwidth    : {avg_busbw[name]:.3f} GB/s ({name}); largest size "
            f"{last['size']} B: {last['time_us'] / 1e3:.2f} ms = "
            f"{100 * last['fraction_of_limit']:.0f}% of the memory-bandwidth limit "
            f"({last['limit_us'] / 1e3:.2f} ms)"
        )
    inexact = sorted({r["impl"] for r in rows if r["inexact"]})
    lines.append(
        "# Bitwise equal to the in-order sum x0+x1+...: "
        + ("all" if not inexact else f"all but {', '.join(inexact)} (another summation order)")
    )
    lines.append("#")
    return {
        "lines": lines,
        "avg_busbw_GBps": avg_busbw,
        "largest_size": largest,
        "largest_fraction_of_limit": largest_fraction,
    }
