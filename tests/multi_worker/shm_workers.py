"""Worker side of the shared-memory tests (module level, so the children can import them)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from tests.multi_worker.workers import value_of

#: 3.2 M float32 (12.8 MB): two rounds of the 8 MiB slots, with an int64 and a float64
#: buffer sharing the second.
SHAPES = (((3_200_000,), "float32"), ((1000,), "int64"), ((257, 3), "float64"))


def _leftovers() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("crossdevice-"))


def all_reduces(rank: int, world_size: int, disable_on: int | None) -> dict[str, Any]:
    """The same all-reduce of three buffers, five times, NumPy then torch, SUM and MEAN.

    `disable_on`: this rank sets `CROSSDEVICE_SHARED_MEMORY=0` (every worker must then
    keep to Gloo).
    """
    import torch

    from crossdevice._comm.workers.communicator import ProcessGroupCommunicator

    if rank == disable_on:
        os.environ["CROSSDEVICE_SHARED_MEMORY"] = "0"
    out: dict[str, Any] = {}
    with ProcessGroupCommunicator() as comm:
        shared = comm.shared_memory
        out["shared"] = shared is not None
        out["pid"] = os.getpid()
        values = [value_of(rank, shape, dtype, seed=3) for shape, dtype in SHAPES]
        for kind, make in (("numpy", np.asarray), ("torch", torch.from_numpy)):
            inputs = [make(v.copy()) for v in values]
            for i in range(5):
                rounds = None if shared is None else shared._round
                got = comm.all_reduce(inputs, "sum")
                out[f"{kind}/sum/{i}"] = [np.asarray(g).copy() for g in got]
                out[f"{kind}/sum/{i}/rounds"] = None if shared is None else shared._round - rounds
            out[f"{kind}/type"] = type(got[0]).__name__
            got = comm.all_reduce(inputs, "mean")
            out[f"{kind}/mean"] = [np.asarray(g).copy() for g in got]
            out[f"{kind}/unchanged"] = all(
                np.array_equal(np.asarray(a), v) for a, v in zip(inputs, values, strict=True)
            )
        # batch_all_reduce: packed per dtype, the packs filled straight into the slots.
        for i in range(4):
            rounds = None if shared is None else shared._round
            got = comm.batch_all_reduce(values, "sum", bytes_per_pack=4 << 20)
            out[f"batch/{i}"] = [np.asarray(g).copy() for g in got]
            out[f"batch/{i}/rounds"] = None if shared is None else shared._round - rounds
        # Donated buffers: reduced too (the result need not be the same array).
        for _ in range(3):
            donated = [v.copy() for v in values]
            got = comm.all_reduce(donated, "sum", donate=True)
        out["donated"] = [np.asarray(g).copy() for g in got]
        # A result handed out is the caller's: later collectives do not touch it.
        kept = comm.all_reduce([values[0]], "sum")[0]
        snapshot = kept.copy()
        for _ in range(4):
            comm.all_reduce([values[0]], "sum")
        out["kept_intact"] = bool(np.array_equal(kept, snapshot))
        out["leftovers"] = _leftovers()  # every worker is past its set-up by now
    return out


def strategy_reduces(rank: int, world_size: int) -> dict[str, Any]:
    """`MultiWorkerMirroredStrategy` with 2 local replicas: replica all-reduces and reduce_to."""
    import crossdevice as cd

    cd.config.set_logical_cpu_devices(2)
    strategy = cd.MultiWorkerMirroredStrategy(devices=["CPU:0", "CPU:1"])
    shared = strategy.extended._worker_communicator.shared_memory

    def step() -> Any:
        ctx = cd.get_replica_context()
        replica = ctx.replica_id_in_sync_group
        x = np.full(300_000, float(replica + 1), np.float32)
        return ctx.all_reduce("sum", {"x": x, "n": np.arange(70_000, dtype=np.int64)})

    results = [strategy.run(step) for _ in range(4)]
    last = results[-1]
    locals_ = [strategy.experimental_local_results(last[k]) for k in ("x", "n")]
    per_replica = strategy.run(
        lambda: np.full(400_000, float(cd.get_replica_context().replica_id_in_sync_group), "f8")
    )
    reduced = [strategy.reduce("mean", per_replica, axis=None) for _ in range(3)]
    return {
        "shared": shared is not None,
        "rounds": None if shared is None else shared._round,
        "x": [np.asarray(v).copy() for v in locals_[0]],
        "n": [np.asarray(v).copy() for v in locals_[1]],
        "mean": np.asarray(reduced[-1]).copy(),
    }


def leaves_midway(rank: int, world_size: int, culprit: int) -> dict[str, Any]:
    """A 3-round all-reduce in which `culprit`'s write of round 2 raises; the others wait.

    The peers must raise naming it, not sum its stale slots; the culprit gets its own
    error, then refuses further collectives.
    """
    import time

    import torch

    from crossdevice._comm.workers import shared_memory
    from crossdevice._comm.workers.communicator import ProcessGroupCommunicator

    x = np.full(5_000_000, float(rank + 1), np.float32)  # 20 MB: three 8 MiB rounds
    out: dict[str, Any] = {}
    with ProcessGroupCommunicator() as comm:
        for _ in range(3):
            comm.all_reduce([x], "sum")
        out["rounds"] = len(shared_memory.plan_rounds(((torch.float32, x.size),)))
        if rank == culprit:
            writes = {"n": 0}
            original = shared_memory.SharedSlots.write

            def failing_write(self: Any, *args: Any, **kwargs: Any) -> None:
                writes["n"] += 1
                if writes["n"] == 3:
                    raise RuntimeError("injected failure in round 2")
                original(self, *args, **kwargs)

            shared_memory.SharedSlots.write = failing_write  # type: ignore[method-assign]
        start = time.monotonic()
        try:
            result = comm.all_reduce([x], "sum")[0]
            out["outcome"] = ("returned", float(result[0]))
        except Exception as err:
            out["outcome"] = (type(err).__name__, str(err))
        out["elapsed"] = time.monotonic() - start
        try:
            comm.all_reduce([x], "sum")
            out["after"] = ("returned", "")
        except Exception as err:
            out["after"] = (type(err).__name__, str(err))
        if rank == 0:
            time.sleep(1.0)  # rank 0 serves the store: let the others read the marks
    return out


def min_bytes_settings(
    rank: int,
    world_size: int,
    values: list[str | None],
    variable: str = "CROSSDEVICE_SHARED_MEMORY_MIN_BYTES",
) -> Any:
    """Build a communicator with this rank's `variable` (default: the byte threshold)."""
    from crossdevice._comm.workers.communicator import ProcessGroupCommunicator

    if values[rank] is not None:
        os.environ[variable] = str(values[rank])
    try:
        with ProcessGroupCommunicator() as comm:
            return ("built", comm.shared_memory is not None)
    except ValueError as err:
        return ("ValueError", str(err))
