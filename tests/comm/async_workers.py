"""Worker side of the asynchronous replica all-reduce's tests (`test_async.py`)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tests.comm.peers import timed_outcome

#: Elements of the large values: 6 MiB of float32, above every size threshold (the
#: donated local sums, the ring).
LARGE = 3 << 19


def values(rank: int, replica: int) -> dict[str, Any]:
    """Non-integer values (sums' bits depend on the order of the additions) of every path.

    A small and a large NumPy array alone (one replica's fast path), and a nest of torch
    tensors, small and large (two collectives: the donated large sums, then the packs),
    and an int64 leaf (MEAN of integers).
    """
    import torch

    rng = np.random.default_rng(100 * rank + replica)
    return {
        "small": rng.standard_normal(1000).astype(np.float32),
        "large": rng.standard_normal(LARGE).astype(np.float32),
        "nest": {
            "w": [torch.from_numpy(rng.standard_normal((3, 50)).astype(np.float32))],
            "big": torch.from_numpy(rng.standard_normal(LARGE).astype(np.float32)),
            "count": torch.arange(7, dtype=torch.int64) + rank,
        },
    }


def _bits(value: Any) -> list[tuple[str, bytes]]:
    from crossdevice._core import nest

    leaves, _ = nest.flatten(value)
    return [(str(np.asarray(x).dtype), np.asarray(x).tobytes()) for x in leaves]


def same_bits(rank: int, world_size: int, local: int) -> dict[str, Any]:
    """Each value all-reduced synchronously, then asynchronously (one and two in flight).

    Returns the bytes of every result of every replica: the test compares them across
    paths, replicas and workers.
    """
    import crossdevice as cd
    from crossdevice._strategies.replica import all_reduce_async

    del world_size
    cd.config.set_logical_cpu_devices(max(local, 2))
    strategy = cd.MultiWorkerMirroredStrategy(devices=[f"CPU:{i}" for i in range(local)])

    def step() -> dict[str, Any]:
        ctx = cd.get_replica_context()
        mine = values(rank, ctx.replica_id_in_sync_group % local)
        kept = {k: _bits(v) for k, v in mine.items()}
        out: dict[str, Any] = {}
        for name, value in mine.items():
            for op in ("sum", "mean"):
                sync = ctx.all_reduce(op, value)
                pending = all_reduce_async(ctx, op, value)
                got = pending.wait()
                out[f"{name}/{op}"] = (_bits(sync), _bits(got), pending.done())
        # Two in flight, waited on in reverse order: issuing the second completes the first.
        first = all_reduce_async(ctx, "sum", mine["nest"])
        second = all_reduce_async(ctx, "sum", mine["large"])
        out["second"] = _bits(second.wait())
        out["first"] = _bits(first.wait())
        out["first_again"] = _bits(first.wait())
        out["unchanged"] = {k: _bits(v) for k, v in mine.items()} == kept
        return out

    results = strategy.experimental_local_results(strategy.run(step))
    return {"replicas": list(results)}


def mismatch(rank: int, world_size: int) -> dict[str, Any]:
    """An asynchronous all-reduce whose shapes differ on the last worker; then one that fits."""
    import crossdevice as cd
    from crossdevice._strategies.replica import all_reduce_async

    strategy = cd.MultiWorkerMirroredStrategy(devices=["CPU:0"])
    x = np.ones((64, 48), np.float32)
    odd_one = rank == world_size - 1

    def step(odd: bool) -> Any:
        ctx = cd.get_replica_context()
        value = {"x": x.reshape(48, 64) if odd else x}
        try:
            pending = all_reduce_async(ctx, "sum", value)
        except Exception as err:
            return ("issue", type(err).__name__, str(err))
        try:
            pending.wait()
        except Exception as err:
            again = None
            try:
                pending.wait()
            except Exception as err2:
                again = type(err2).__name__
            return ("wait", type(err).__name__, str(err), again)
        return ("returned",)

    for _ in range(3):  # every worker predicts this layout from now on
        strategy.run(step, args=(False,))
    try:
        outcome = strategy.run(step, args=(odd_one,))
    except Exception as err:
        outcome = ("run", type(err).__name__, str(err))
    after = strategy.run(lambda: cd.get_replica_context().all_reduce("sum", x))
    return {"outcome": outcome, "after": float(np.asarray(after)[0, 0])}


def peer_fails(rank: int, world_size: int) -> dict[str, Any]:
    """Worker 0 waits on an asynchronous all-reduce; the last worker's step raises instead."""
    import crossdevice as cd
    from crossdevice._strategies.replica import all_reduce_async

    strategy = cd.MultiWorkerMirroredStrategy(
        devices=["CPU:0"],
        communication_options=cd.experimental.CommunicationOptions(timeout_seconds=30.0),
    )
    x = np.ones(LARGE, np.float32)

    def step(failing: bool) -> Any:
        ctx = cd.get_replica_context()
        if failing and rank == world_size - 1:
            raise ValueError("bad batch")
        pending = all_reduce_async(ctx, "sum", {"x": x})
        time.sleep(0.05)  # the replica computes on while the all-reduce is in flight
        return pending.wait()["x"]

    for _ in range(3):
        strategy.run(step, args=(False,))
    out = timed_outcome(lambda: strategy.run(step, args=(True,)))
    # Rank 0 serves the store: its peers must read the abort mark before it goes.
    time.sleep(1.5)
    return out


def lost_peer(rank: int, world_size: int, how: str) -> dict[str, Any]:
    """Rank 1 is killed (SIGKILL) or stalls while worker 0 waits on a large async all-reduce.

    The ring finishes in the background (`ReduceOptions.overlap`): what ends its waits
    there must reach the caller's `wait` as the error naming the lost worker.
    """
    import os
    import signal

    import crossdevice as cd
    from crossdevice._strategies.replica import all_reduce_async

    del world_size
    strategy = cd.MultiWorkerMirroredStrategy(
        devices=["CPU:0"],
        communication_options=cd.experimental.CommunicationOptions(timeout_seconds=3.0),
    )
    x = np.ones(LARGE, np.float32)

    def step() -> Any:
        pending = all_reduce_async(cd.get_replica_context(), "sum", {"x": x})
        return pending.wait()["x"]

    for _ in range(3):
        strategy.run(step)
    if rank == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # the harness kills us once worker 0 is done
    return timed_outcome(lambda: strategy.run(step))
