"""Functions the worker processes run (module level, so the children can import them).

Each takes `(rank, world_size, ...)` and returns picklable results (NumPy arrays) that
the tests compare against NumPy references built from the same `value_of` inputs.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np


def value_of(rank: int, shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    """Rank `rank`'s input: reproducible in the parent and in every worker."""
    rng = np.random.default_rng(1000 * seed + rank)
    if np.issubdtype(np.dtype(dtype), np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -50), min(info.max, 50), size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _record(out: dict[str, Any], name: str, value: Any) -> None:
    """Store a result as NumPy with the kind it came back as."""
    import torch

    kind = "torch" if isinstance(value, torch.Tensor) else type(value).__name__
    out[name] = (kind, np.asarray(value.numpy() if kind == "torch" else value).copy())


def collectives(rank: int, world_size: int) -> dict[str, Any]:
    """Every collective once with NumPy values and once with torch tensors."""
    import torch

    from crossdevice._comm.protocol import ReduceOptions
    from crossdevice._comm.workers.communicator import ProcessGroupCommunicator

    out: dict[str, Any] = {}
    with ProcessGroupCommunicator() as comm:
        out["rank"] = comm.rank
        out["world_size"] = comm.world_size
        out["cluster"] = comm.cluster
        for kind, make in (("numpy", np.asarray), ("torch", torch.from_numpy)):
            values = [
                value_of(rank, (3, 4), "float32"),
                value_of(rank, (5,), "float64"),
                value_of(rank, (2, 2), "int32"),
            ]
            inputs = [make(v.copy()) for v in values]
            for i, r in enumerate(comm.all_reduce(inputs, "sum")):
                _record(out, f"{kind}/sum/{i}", r)
            for i, r in enumerate(comm.all_reduce(inputs, "mean")):
                _record(out, f"{kind}/mean/{i}", r)
            for i, r in enumerate(
                comm.all_reduce(inputs, ReduceOptions("MEAN", divisor=2 * world_size))
            ):
                _record(out, f"{kind}/mean_div/{i}", r)
            # inputs untouched by non-donating collectives
            out[f"{kind}/inputs_unchanged"] = all(
                np.array_equal(np.asarray(a), v) for a, v in zip(inputs, values, strict=True)
            )
            donated = make(value_of(rank, (6,), "float32"))
            _record(out, f"{kind}/donated", comm.all_reduce([donated], "sum", donate=True)[0])
            # uneven all_gather along axis 0 and axis -1
            _record(
                out,
                f"{kind}/gather0",
                comm.all_gather(make(value_of(rank, (rank + 1, 3), "float32")), 0),
            )
            _record(
                out,
                f"{kind}/gather1",
                comm.all_gather(make(value_of(rank, (2, rank + 2), "int64")), axis=-1),
            )
            root = world_size - 1
            mine = value_of(rank, (2, 3), "float32")
            _record(out, f"{kind}/broadcast", comm.broadcast(make(mine), root=root))
            _record(
                out,
                f"{kind}/broadcast_none",
                comm.broadcast(make(mine) if rank == root else None, root=root),
            )
            batch = [
                make(value_of(rank, (10,), "float32", seed=1)),
                make(value_of(rank, (3,), "int64", seed=2)),
                make(value_of(rank, (4, 4), "float32", seed=3)),
                make(value_of(rank, (7,), "float64", seed=4)),
                make(value_of(rank, (), "float32", seed=5)),
            ]
            for pack in (0, 32):
                for op in ("sum", "mean"):
                    res = comm.batch_all_reduce(batch, op, bytes_per_pack=pack)
                    for i, r in enumerate(res):
                        _record(out, f"{kind}/batch/{op}/{pack}/{i}", r)
            res = comm.batch_all_reduce(batch, ReduceOptions("mean", divisor=4 * world_size))
            for i, r in enumerate(res):
                _record(out, f"{kind}/batch/mean_div/{i}", r)
            # dtypes Gloo lacks travel widened or viewed
            odd = [make(value_of(rank, (4,), "int16")), make(np.full(3, 2**63 + rank, np.uint64))]
            for i, r in enumerate(comm.all_reduce(odd, "sum")):
                _record(out, f"{kind}/odd/{i}", r)
        # mixed kinds in one batch keep their kinds
        mixed = comm.batch_all_reduce([np.ones(2, np.float32), torch.ones(2), np.ones(1, np.int32)])
        out["mixed_kinds"] = [type(m).__name__ for m in mixed]
        # a mismatched all_gather fails alike everywhere and leaves the communicator usable
        try:
            comm.all_gather(np.zeros((2, 3 + rank), np.float32), axis=0)
        except ValueError as err:
            out["gather_error"] = str(err)
        comm.barrier()
        _record(out, "after_error", comm.all_reduce([np.full(2, rank, np.int64)])[0])
        out["sequence_number"] = comm.sequence_number
    out["closed"] = comm.closed
    return out


def stall_or_die(rank: int, world_size: int, culprit: int, how: str, timeout: float) -> Any:
    """One warm-up all_reduce, then `culprit` stalls or dies while the others all_reduce."""
    from crossdevice._comm.workers.communicator import ProcessGroupCommunicator
    from crossdevice._core.options import CommunicationOptions

    comm = ProcessGroupCommunicator(options=CommunicationOptions(timeout_seconds=timeout))
    comm.all_reduce([np.ones(4, np.float32)])
    if rank == culprit:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(timeout + 20)  # the harness kills us once the others are done
        return "woke"
    start = time.monotonic()
    try:
        comm.all_reduce([np.ones(1 << 16, np.float32)])
    except Exception as err:
        elapsed = time.monotonic() - start
        try:
            comm.all_reduce([np.ones(4, np.float32)])
            after = "no error"
        except RuntimeError as again:
            after = str(again)
        return {"type": type(err).__name__, "message": str(err), "elapsed": elapsed, "after": after}
    return {"type": None, "elapsed": time.monotonic() - start}


def _error_of(fn: Any) -> str:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def join_existing(rank: int, world_size: int) -> dict[str, Any]:
    """Join a default group the program made itself; misuse errors; two communicators."""
    import dataclasses
    import datetime

    import torch
    import torch.distributed as dist

    from crossdevice._comm.protocol import ReduceOptions
    from crossdevice._comm.workers.communicator import ProcessGroupCommunicator
    from crossdevice._core.cluster import resolve_cluster

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))  # env://
    out: dict[str, Any] = {}
    cluster = resolve_cluster()
    assert cluster is not None
    wrong = dataclasses.replace(cluster, rank=(rank + 1) % world_size)
    out["wrong_cluster"] = _error_of(lambda: ProcessGroupCommunicator(wrong))
    first = ProcessGroupCommunicator()
    second = ProcessGroupCommunicator()
    out["cluster_when_joined"] = first.cluster
    # two communicators interleave without mixing their collectives
    a = first.all_reduce([np.full(3, rank + 1, np.int64)])[0]
    b = second.all_reduce([np.full(3, 10 * (rank + 1), np.int64)])[0]
    out["interleaved"] = (a, b, first.sequence_number, second.sequence_number)
    x = np.ones(2, np.float32)
    out["divisor_with_sum"] = _error_of(
        lambda: first.all_reduce([x], ReduceOptions("sum", divisor=2))
    )
    out["divisor_zero"] = _error_of(lambda: first.all_reduce([x], ReduceOptions("mean", divisor=0)))
    out["single_array"] = _error_of(lambda: first.all_reduce(x))
    out["bad_op"] = _error_of(lambda: first.all_reduce([x], "max"))
    out["bad_dtype"] = _error_of(lambda: first.all_reduce([np.array(["a"])]))
    out["bad_torch_dtype"] = _error_of(
        lambda: first.all_reduce([torch.ones(2, dtype=torch.float8_e4m3fn)])
    )
    out["seq_after_local_errors"] = first.sequence_number
    # errors decided together: every worker raises the same ValueError, nobody hangs
    out["roots_differ"] = _error_of(lambda: first.broadcast(x, root=rank))
    out["root_none"] = _error_of(lambda: first.broadcast(None, root=0))
    out["root_out_of_range"] = _error_of(lambda: first.broadcast(x, root=world_size))
    out["bcast_shape"] = _error_of(lambda: first.broadcast(np.ones(2 + rank, np.float32)))
    out["gather_rank"] = _error_of(lambda: first.all_gather(np.ones((2,) * (rank + 1))))
    out["gather_dtype"] = _error_of(
        lambda: first.all_gather(np.ones(2, np.float32 if rank else np.float64))
    )
    out["gather_axis"] = _error_of(lambda: first.all_gather(np.ones((2, 2)), axis=rank))
    out["gather_scalar"] = _error_of(lambda: first.all_gather(np.float32(1.0)))
    out["still_works"] = first.all_reduce([np.full(2, rank, np.int64)])[0]
    first.close()
    first.close()  # idempotent
    out["after_close"] = _error_of(first.barrier)
    out["second_still_works"] = second.broadcast(np.full(2, rank, np.int64), root=1)
    second.close()
    out["default_group_kept"] = dist.is_initialized()
    dist.destroy_process_group()
    return out


def cuda_collectives(rank: int, world_size: int, implementation: str) -> dict[str, Any]:
    """CUDA tensors through NCCL (`AUTO`) or staged through Gloo on the host (`RING`)."""
    import torch

    from crossdevice._comm.workers.communicator import ProcessGroupCommunicator
    from crossdevice._core.options import CommunicationOptions

    torch.cuda.set_device(rank % torch.cuda.device_count())
    options = CommunicationOptions(implementation=implementation, timeout_seconds=60)
    with ProcessGroupCommunicator(options=options) as comm:
        x = torch.full((4,), float(rank + 1), device="cuda")
        results = {
            "sum": comm.all_reduce([x])[0],
            "mean": comm.batch_all_reduce([x, x[:2].double()], "mean")[1],
            "gather": comm.all_gather(x[: rank + 1], 0),
            "broadcast": comm.broadcast(x, root=world_size - 1),
        }
        return {name: (t.device.type, t.cpu().numpy()) for name, t in results.items()}
