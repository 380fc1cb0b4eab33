"""The `Communicator` contract: cases every communicator must pass, wherever its peers live.

Each case is run by every peer with its own `rank` and returns something picklable (the
multi-process bindings run them in worker processes); `expected(case, size)` computes,
with NumPy alone, what each rank must get. A binding supplies `make(array, rank)` (the
value as its peers hold it: a NumPy array, or a tensor on the rank's device) and
`back(value)` (to NumPy). Mismatches are expected to raise ValueError (a
`CollectiveMismatchError` is one) in every peer, after which the communicator works on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from crossdevice._comm.protocol import (
    BroadcastOptions,
    Communicator,
    GatherOptions,
    ReduceOptions,
)

Make = Callable[[np.ndarray, int], Any]
Back = Callable[[Any], np.ndarray]

#: Elements of the large all-reduce: 4 MiB of float32, the size the ring starts at (on 2
#: workers it is exchanged whole, below `TUNING.direct_max_bytes`).
LARGE = 1 << 20
#: Every collective of the contract is bounded: a peer that never comes fails the case.
TIMEOUT = 60.0
SUM = ReduceOptions("sum", timeout=TIMEOUT)


def _values(rank: int) -> list[np.ndarray]:
    """Integer-valued data (exact sums in any order), of several shapes and dtypes."""
    return [
        np.arange(6, dtype=np.float32).reshape(2, 3) * (rank + 1),
        np.full(5, rank - 1.5, np.float64),
        np.array(rank * 3, np.int32),
        np.arange(4, dtype=np.int64) - rank,
    ]


def _large(rank: int) -> np.ndarray:
    return (np.arange(LARGE, dtype=np.float32) % 97) * (rank + 1)


def _gathered(rank: int) -> np.ndarray:
    return np.full((rank + 1, 3), rank, np.float32)


def run_case(name: str, comm: Communicator, make: Make, back: Back) -> Any:
    """Run contract case `name` as peer `comm.rank`; returns this peer's outcome."""
    rank, size = comm.rank, comm.size
    if name == "sum":
        values = [make(v, rank) for v in _values(rank)]
        return [back(x) for x in comm.all_reduce(values, SUM)]
    if name == "mean":
        return [
            back(x)
            for x in comm.all_reduce(
                [make(_values(rank)[0], rank)], ReduceOptions("mean", timeout=TIMEOUT)
            )
        ]
    if name == "mean_divisor":
        options = ReduceOptions("mean", TIMEOUT, divisor=2 * size)
        return [back(x) for x in comm.all_reduce([make(_values(rank)[1], rank)], options)]
    if name == "inputs_unchanged":
        values = [make(v, rank) for v in _values(rank)]
        comm.all_reduce(values, SUM)
        return all(np.array_equal(back(x), v) for x, v in zip(values, _values(rank), strict=True))
    if name == "large":
        return back(comm.all_reduce([make(_large(rank), rank)], SUM)[0])[::4099]
    if name == "repeated":  # the same all-reduce again and again (predicted across workers)
        value = [make(_values(rank)[0], rank)]
        return [back(comm.all_reduce(value, SUM)[0]) for _ in range(4)]
    if name == "same_kind_varies":
        # Repeated calls that differ only in what a per-kind shortcut could miss: the
        # shape at equal size, the op, a read-only and a strided input.
        base = _values(rank)[0]
        readonly = base.copy()
        readonly.flags.writeable = False
        strided = np.repeat(base, 2, axis=1)[:, ::2]
        return [
            back(comm.all_reduce([make(base, rank)], SUM)[0]),
            back(comm.all_reduce([make(base.reshape(3, 2), rank)], SUM)[0]),
            back(comm.all_reduce([make(base, rank)], "mean")[0]),
            back(comm.all_reduce([make(readonly, rank)], SUM)[0]),
            back(comm.all_reduce([make(strided, rank)], SUM)[0]),
            back(comm.all_reduce([make(base, rank)], SUM)[0]),
        ]
    if name == "async":
        value = [make(_values(rank)[0], rank)]
        pending = comm.all_reduce_async(value, SUM)
        got = back(pending.wait()[0])
        return got, pending.done(), back(comm.all_reduce(value, SUM)[0])
    if name == "gather_uneven":
        return back(comm.all_gather(make(_gathered(rank), rank), GatherOptions(0, TIMEOUT)))
    if name == "gather_last_axis":
        value = np.full((2, rank + 2), rank, np.int64)
        return back(comm.all_gather(make(value, rank), GatherOptions(-1, TIMEOUT)))
    if name == "broadcast":
        root = size - 1
        value = make(np.arange(5.0) + 10 * rank, rank) if rank == root else None
        return back(comm.broadcast(value, BroadcastOptions(root, TIMEOUT)))
    if name == "barrier":
        comm.barrier(TIMEOUT)
        return rank
    if name == "mismatch_then_work":
        odd = np.ones((3, 2) if rank == size - 1 else (2, 3), np.float32)
        try:
            comm.all_reduce([make(odd, rank)], SUM)
            raised = None
        except ValueError as err:
            raised = "ValueError" if isinstance(err, ValueError) else type(err).__name__
        return raised, back(comm.all_reduce([make(np.float32([rank]), rank)], SUM)[0])
    raise AssertionError(name)


CASES = (
    "sum",
    "mean",
    "mean_divisor",
    "inputs_unchanged",
    "large",
    "repeated",
    "same_kind_varies",
    "async",
    "gather_uneven",
    "gather_last_axis",
    "broadcast",
    "barrier",
    "mismatch_then_work",
)


def expected(name: str, size: int) -> Callable[[int], Any]:
    """What rank r must get from case `name` among `size` peers (NumPy alone)."""
    ranks = range(size)
    if name == "sum":
        totals = [sum(_values(r)[i] for r in ranks) for i in range(4)]
        return lambda r: totals
    if name == "mean":
        return lambda r: [sum(_values(q)[0] for q in ranks) / size]
    if name == "mean_divisor":
        return lambda r: [sum(_values(q)[1] for q in ranks) / (2 * size)]
    if name == "inputs_unchanged":
        return lambda r: True
    if name == "large":
        return lambda r: sum(_large(q) for q in ranks)[::4099]
    if name == "repeated":
        return lambda r: [sum(_values(q)[0] for q in ranks)] * 4
    if name == "same_kind_varies":
        total = sum(_values(q)[0] for q in ranks)
        return lambda r: [total, total.reshape(3, 2), total / size, total, total, total]
    if name == "async":
        total = sum(_values(q)[0] for q in ranks)
        return lambda r: (total, True, total)
    if name == "gather_uneven":
        return lambda r: np.concatenate([_gathered(q) for q in ranks])
    if name == "gather_last_axis":
        return lambda r: np.concatenate([np.full((2, q + 2), q, np.int64) for q in ranks], axis=-1)
    if name == "broadcast":
        return lambda r: np.arange(5.0) + 10 * (size - 1)
    if name == "barrier":
        return lambda r: r
    if name == "mismatch_then_work":
        total = np.float32([sum(ranks)])
        return lambda r: ("ValueError" if size > 1 else None, total)
    raise AssertionError(name)


def same(got: Any, want: Any) -> bool:
    """Equal values, dtypes and shapes, recursively (arrays bit for bit)."""
    if isinstance(want, np.ndarray | np.generic):
        got = np.asarray(got)
        want = np.asarray(want)
        return (
            got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
        )
    if isinstance(want, list | tuple):
        return (
            isinstance(got, list | tuple)
            and len(got) == len(want)
            and all(same(g, w) for g, w in zip(got, want, strict=True))
        )
    return bool(got == want)


def run_all(comm: Communicator, make: Make, back: Back) -> dict[str, Any]:
    """Every case, in order, as peer `comm.rank`: its outcome, or its error's type and text."""
    out: dict[str, Any] = {}
    for name in CASES:
        try:
            out[name] = ("ok", run_case(name, comm, make, back))
        except BaseException as err:  # a peer's failure releases this one: the next case
            out[name] = (type(err).__name__, str(err))
    return out


def worker(rank: int, world_size: int) -> dict[str, Any]:
    """A worker process's side: its `ProcessGroupCommunicator` runs every case."""
    import torch

    from crossdevice._comm.workers.communicator import ProcessGroupCommunicator
    from tests.comm.peers import apply_tuning, carrier

    del rank, world_size
    apply_tuning()
    with ProcessGroupCommunicator() as comm:
        out = run_all(comm, lambda a, r: a, np.asarray)
        out["shared_memory"] = comm.shared_memory is not None
        out["carriers"] = {
            "sum": carrier(comm, ((torch.float32, 6),)),
            "large": carrier(comm, ((torch.float32, LARGE),)),
        }
    return out
