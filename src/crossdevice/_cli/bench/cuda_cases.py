"""The CUDA cases of `crossdevice bench --cuda` (imported only when CUDA is there).

Every case works on the same pre-packed float32 buffers, one per GPU. crossdevice's ops
never write their inputs; raw NCCL in place does, so it gets copies of the buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from crossdevice._cli.bench.common import (
    RAW_IN_PLACE,
    RAW_OUT_OF_PLACE,
    TORCH_DIST,
    Measurement,
)
from crossdevice._comm.devices import nccl_calls
from crossdevice._core.devices import canonicalize, num_gpus
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._cross_device import (
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from crossdevice._values.values import Mirrored, PerReplica

__all__ = ["measure_all"]

Timer = Callable[[dict[str, Callable[[], Any]], Callable[[], None]], dict[str, float]]


def _gpu_indices(text: str) -> list[int]:
    if text.strip().lower() == "all":
        return list(range(num_gpus()))
    try:
        indices = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(
            f"crossdevice bench --cuda: --gpus takes GPU indices such as 0,1,2,3 or 'all', "
            f"received {text!r}"
        ) from None
    missing = [i for i in indices if not 0 <= i < num_gpus()]
    if missing or not indices:
        raise SystemExit(
            f"crossdevice bench --cuda: --gpus {text!r} names GPUs that do not exist; this "
            f"process offers GPU:0..GPU:{num_gpus() - 1} (set_logical_gpu_devices or "
            "CROSSDEVICE_LOGICAL_GPUS for more)"
        )
    return indices


def _torch_dist(physical: list[int]) -> tuple[Any, str]:
    """A world-1 NCCL process group on the one CUDA device in use, or None and why not."""
    if len(set(physical)) != 1:
        return None, (
            "torch.distributed NCCL runs one process per GPU: compare with `torchrun "
            f"--standalone --nproc-per-node {len(set(physical))} -m crossdevice bench "
            "--multi-worker`"
        )
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return None, "torch.distributed has no NCCL backend in this build"
    if dist.is_initialized():
        return None, "a default process group already exists in this process"
    try:
        dist.init_process_group(
            "nccl",
            store=dist.HashStore(),  # type: ignore[attr-defined]
            rank=0,
            world_size=1,
            device_id=torch.device("cuda", physical[0]),
        )
    except Exception as exc:  # report, do not abort the benchmark
        return None, f"init_process_group failed: {type(exc).__name__}: {exc}"
    return dist, ""


def measure_all(
    sizes: list[int], gpus: str, timer: Timer, out: Callable[[str], Any]
) -> tuple[list[str], list[Measurement], int, bool]:
    """Time every case; returns (header lines, measurements, number of GPUs, any wrong)."""
    indices = _gpu_indices(gpus)
    devices = [canonicalize(f"GPU:{i}") for i in indices]
    physical = [nccl_calls.cuda_device_of(d) or 0 for d in devices]
    n = len(devices)
    nccl_ok = len(set(physical)) == n and nccl_calls.nccl_available()
    version = ".".join(map(str, nccl_calls.nccl_version()))
    names = sorted({torch.cuda.get_device_name(p) for p in physical})
    header = [
        f"# torch {torch.__version__}, NCCL {version}, {n} GPUs "
        f"{[f'GPU:{i}' for i in indices]} on CUDA devices {physical} ({', '.join(names)})",
        "# one float32 buffer per GPU; time = median of rounds; busbw = algbw * 2(n-1)/n",
    ]
    raw_note = "" if nccl_ok else "logical GPUs share a card: NCCL refuses two ranks on one device"
    if not nccl_ok:
        header.append(f"# not compared: torch.cuda.nccl ({raw_note})")
    dist, dist_note = _torch_dist(physical)
    if dist is None:
        header.append(f"# not compared: {TORCH_DIST} ({dist_note})")
    if n == 1:
        header.append("# one replica: the cross-device ops take TF's single-replica shortcut")
    if not nccl_calls.has_avg():
        header.append("# NCCL < 2.10 has no ncclAvg: raw MEAN is a sum then an in-place divide")

    def sync() -> None:
        for p in sorted(set(physical)):
            torch.cuda.synchronize(p)

    measurements: list[Measurement] = []
    wrong = False
    try:
        for nbytes in sizes:
            numel = max(1, nbytes // 4)
            gen = torch.Generator().manual_seed(nbytes)
            inputs = [
                torch.randn(numel, generator=gen).to(torch.device("cuda", p)) for p in physical
            ]
            value = PerReplica(inputs, devices=devices)
            expected = inputs[0].double()
            for x in inputs[1:]:
                expected += x.to(expected.device).double()
            for op in ("sum", "mean"):
                fns, checks = _cases(op, inputs, value, nccl_ok, dist)
                times = timer(fns, sync)
                for impl in fns:
                    measurements.append(Measurement(impl, op, nbytes, times[impl]))
                want = expected / n if op == "mean" else expected
                for impl, result in checks.items():
                    if not _close(result(), want):
                        wrong = True
                        out(f"# WRONG: {impl} {op} at {nbytes} bytes differs from the sum")
                if not nccl_ok:
                    measurements.append(Measurement(RAW_IN_PLACE, op, nbytes, None, raw_note))
                if dist is None:
                    measurements.append(Measurement(TORCH_DIST, op, nbytes, None, dist_note))
            del inputs, value, expected
            torch.cuda.empty_cache()
    finally:
        if dist is not None:
            dist.destroy_process_group()
    return header, measurements, n, wrong


def _cases(
    op: str, inputs: list[Any], value: PerReplica, nccl_ok: bool, dist: Any
) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
    """The timed functions, and for each crossdevice op a call whose result is checked."""
    n = len(inputs)
    mean = op == "mean"
    fns: dict[str, Callable[[], Any]] = {}
    if nccl_ok:
        in_place = [x.clone() for x in inputs]
        outputs = [torch.empty_like(x) for x in inputs]
        nccl_op = nccl_calls.NCCL_AVG if mean and nccl_calls.has_avg() else nccl_calls.NCCL_SUM

        def raw_in_place() -> None:
            torch.cuda.nccl.all_reduce(in_place, op=nccl_op)  # type: ignore[no-untyped-call]
            if mean and nccl_op == nccl_calls.NCCL_SUM:
                for x in in_place:
                    x.div_(n)

        def raw_out_of_place() -> None:
            torch.cuda.nccl.all_reduce(  # type: ignore[no-untyped-call]
                inputs, outputs=outputs, op=nccl_op
            )
            if mean and nccl_op == nccl_calls.NCCL_SUM:
                for x in outputs:
                    x.div_(n)

        fns[RAW_IN_PLACE] = raw_in_place
        fns[RAW_OUT_OF_PLACE] = raw_out_of_place
    if dist is not None:
        buffer = inputs[0].clone()
        dist_op = dist.ReduceOp.AVG if mean else dist.ReduceOp.SUM
        fns[TORCH_DIST] = lambda: dist.all_reduce(buffer, op=dist_op)
    checks: dict[str, Callable[[], Any]] = {}
    reduce_op = ReduceOp.MEAN if mean else ReduceOp.SUM
    for name, ops in (
        ("crossdevice NcclAllReduce", NcclAllReduce()),
        ("crossdevice HierarchicalCopyAllReduce", HierarchicalCopyAllReduce()),
        ("crossdevice ReductionToOneDevice", ReductionToOneDevice()),
    ):

        def call(ops: Any = ops) -> Any:
            return ops.batch_reduce(reduce_op, [(value, value)])[0]

        fns[name] = call
        checks[name] = call
    return fns, checks


def _close(result: Any, expected: Any) -> bool:
    """Every component of `result` equals `expected` to float32 rounding of a sum."""
    components = result.values if isinstance(result, Mirrored) else (result,)
    scale = float(expected.abs().max()) or 1.0
    return all(
        float((c.double().to(expected.device) - expected).abs().max()) <= 1e-5 * scale
        for c in components
    )
