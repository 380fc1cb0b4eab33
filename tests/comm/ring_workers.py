"""Worker side of the ring transport's tests (`test_ring.py`): shared memory off, large values.

Each worker first sets the thresholds its test chose (`peers.apply_tuning`): the ring's
two phases or its whole exchange.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tests.comm.peers import apply_tuning, carrier, timed_outcome

#: Elements per worker: 6 MiB of float32, above the ring's threshold.
SIZE = 3 << 19


def data(rank: int) -> np.ndarray:
    """Non-integer values: the sum's bits depend on the order of the additions."""
    return np.random.default_rng(rank).standard_normal(SIZE).astype(np.float32)


def tiny(rank: int) -> np.ndarray:
    """Two non-integer values of `rank` (a chunk each on 2 workers, none for rank 0 on 3)."""
    return np.array([0.1, 0.7], np.float32) * np.float32(rank + 1)


def sums(rank: int, world_size: int) -> dict[str, Any]:
    """The same large all-reduce, three times (the first agreed first, then predicted)."""
    import torch

    from crossdevice._comm.workers.communicator import ProcessGroupCommunicator
    from crossdevice._core import tuning

    del rank, world_size
    apply_tuning()
    out: dict[str, Any] = {}
    with ProcessGroupCommunicator() as comm:
        out["carrier"] = carrier(comm, ((torch.float32, SIZE),))
        mine = data(comm.rank)
        kept = mine.copy()
        out["results"] = [comm.all_reduce([mine], "sum")[0].copy() for _ in range(3)]
        out["unchanged"] = bool(np.array_equal(mine, kept))
        # Two elements the same way, three times (below the ring's threshold, so it is
        # lowered): on 3 workers rank 0's chunk of them is empty, no piece of it leaves
        # for rank 0, and the header apart goes alone.
        with tuning.overridden(ring_min_bytes=1):
            out["tiny_carrier"] = carrier(comm, ((torch.float32, 2),))
            out["tiny"] = [comm.all_reduce([tiny(comm.rank)], "sum")[0].copy() for _ in range(3)]
        out["shared_memory"] = comm.shared_memory is not None
    return out


def mismatch(rank: int, world_size: int) -> dict[str, Any]:
    """Repeated large all-reduces, then one worker reshapes its value (same bytes)."""
    from crossdevice._comm.workers.communicator import ProcessGroupCommunicator

    apply_tuning()
    out: dict[str, Any] = {}
    with ProcessGroupCommunicator() as comm:
        x = np.ones((1024, 1536), np.float32)
        for _ in range(3):  # every worker predicts this layout from now on
            comm.all_reduce([x], "sum")
        odd = x.reshape(1536, 1024) if rank == world_size - 1 else x
        try:
            comm.all_reduce([odd], "sum")
            out["mismatch"] = ("returned", "")
        except Exception as err:
            out["mismatch"] = (type(err).__name__, str(err))
        out["after"] = float(comm.all_reduce([x], "sum")[0][0, 0])
    return out


def abort(rank: int, world_size: int) -> dict[str, Any]:
    """Large all-reduces in a strategy; then the last worker's step raises."""
    import crossdevice as cd

    apply_tuning()
    strategy = cd.MultiWorkerMirroredStrategy(devices=["CPU:0"])
    x = np.ones(SIZE, np.float32)

    def step() -> Any:
        if rank == world_size - 1 and failing:
            raise ValueError("bad batch")
        return cd.get_replica_context().all_reduce("sum", x)

    failing = False
    for _ in range(3):
        strategy.run(step)
    failing = True
    out = timed_outcome(lambda: strategy.run(step))
    # Rank 0 serves the store: its peers must read the abort mark before it goes.
    time.sleep(1.5)
    return out


def local_sums(rank: int, world_size: int) -> dict[str, Any]:
    """Two local replicas per worker: their sum, filled lazily into the pack, goes across.

    Integer-valued float32 (exact in any order), 256 KiB a value and two values a call,
    so the pack's chunks are filled as the transport sends them (`Job.fill`).
    """
    import crossdevice as cd

    apply_tuning()
    strategy = cd.MultiWorkerMirroredStrategy(devices=["CPU:0", "CPU:1"])
    n = 1 << 16

    def step() -> Any:
        replica = cd.get_replica_context().replica_id_in_sync_group
        a = np.arange(n, dtype=np.float32) % 251 * (replica + 1)
        b = np.full(n, float(replica), np.float32)
        return cd.get_replica_context().all_reduce("sum", [a, b])

    results = [strategy.run(step) for _ in range(3)]
    per_replica = [[np.asarray(v) for v in strategy.experimental_local_results(r)] for r in results]
    return {"results": [[[x.copy() for x in nest] for nest in r] for r in per_replica]}


def lost(rank: int, world_size: int, how: str) -> dict[str, Any]:
    """Large all-reduces, then the last worker freezes (SIGSTOP) or dies (SIGKILL).

    Frozen, its connections stay open, so only its stopped heartbeat tells; killed, they
    close. Either way the others must name it long before the 60 s timeout.
    """
    import os
    import signal

    import crossdevice as cd

    apply_tuning()
    options = cd.experimental.CommunicationOptions(timeout_seconds=60.0)
    strategy = cd.MultiWorkerMirroredStrategy(communication_options=options, devices=["CPU:0"])
    x = np.ones(SIZE, np.float32)

    def step() -> Any:
        return cd.get_replica_context().all_reduce("sum", x)

    for _ in range(3):  # predicted from now on: headers travel with the data
        strategy.run(step)
    if rank == world_size - 1:  # a frozen one is killed by the harness once the others end
        os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
    return timed_outcome(lambda: strategy.run(step))


def abort_in_flight(rank: int, world_size: int, guess_right: bool) -> dict[str, Any]:
    """Small and large all-reduces in turn (the predictor learns them); then the last worker
    issues one (the small one, as guessed, or the large one again, against the guess) and,
    its result not yet waited for, gives up (`abort`), while its peers make that call and
    the next."""
    from crossdevice._comm.workers.communicator import ProcessGroupCommunicator

    apply_tuning()
    with ProcessGroupCommunicator() as comm:
        small, large = np.ones(4, np.float32), np.ones(36, np.float32)
        for _ in range(4):
            comm.all_reduce([small], "sum")
            comm.all_reduce([large], "sum")
        first, then = (small, large) if guess_right else (large, small)
        if rank < world_size - 1:
            out = timed_outcome(
                lambda: (comm.all_reduce([first], "sum"), comm.all_reduce([then], "sum"))
            )
        else:
            in_flight = comm.all_reduce_async([first], "sum")
            comm.abort(ValueError("bad batch"))
            del in_flight
            out = {"outcome": ("ValueError", "bad batch"), "elapsed": 0.0}
        time.sleep(1.5)  # rank 0 serves the store: its peers read the abort mark first
    return out
