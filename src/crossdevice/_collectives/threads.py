"""`ThreadCommunicator`: collectives between the replica threads of one process.

Every replica thread of a strategy calls the same collectives in the same order; each
call is a *round*. A replica deposits its inputs and waits; the last one to arrive
validates the round (same collective, same structure, shapes and dtypes everywhere) and
plans it. Then:

* small rounds: the last arriver computes the whole result itself and releases everyone
  (one rendezvous: the cost of a scalar all-reduce is a few thread wake-ups);
* large rounds: the replica threads (one per CPU) take turns at pieces of the work,
  each reducing its piece across all inputs into a shared output (a reduce-scatter;
  NumPy releases the GIL, so the threads run in parallel), and after a second
  rendezvous every replica returns the same read-only results (the all-gather is
  sharing: host replicas share memory).

Adds run in replica order, `((x0 + x1) + x2) + ...` element by element, so results are
bitwise reproducible and equal to the naive in-order chain whatever the thread timing.

Reliability (docs/design.md §5): bad input raises ValueError in every replica, naming what
was expected and received; `abort(exc)` releases every waiter with `ReplicaAbortedError`;
a wait past `timeout` raises `CollectiveTimeoutError` naming the collective, its
sequence number and the replicas that did not arrive, and breaks the communicator until
`reset()` (its peers are released with the same error rather than left waiting).

Results share memory between replicas. NumPy results are read-only views; torch has no
read-only tensors, so torch results must not be modified in place (TF tensors are
immutable too; copy a result before mutating it).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from crossdevice._arrays import backend_for, is_torch
from crossdevice._arrays.host_kernels import (
    BLOCK_BYTES,
    available_cpus,
    run_parallel,
    sum_slice,
)
from crossdevice._arrays.native import STREAM_MIN_BYTES
from crossdevice._arrays.numpy_backend import NUMPY
from crossdevice._core.cooperative import block
from crossdevice._core.errors import CollectiveTimeoutError, ReplicaAbortedError
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op

__all__ = [
    "PACK_BELOW_BYTES",
    "PARALLEL_MIN_BYTES",
    "POOL_MIN_BYTES",
    "ThreadCommunicator",
    "all_reduce_host",
]

#: Rounds with fewer bytes per replica than this are computed by the last arriving
#: replica alone; from here on every replica reduces pieces of the work (a second
#: rendezvous and four threads on two cores cost more than they save below it).
#: Measured, 4 replicas on the 2-core dev machine (float32, one array, median of 7):
#: 1 MiB one-thread 360 us vs sharded 531 us; 2 MiB 489 vs 608 us; 4 MiB 1181 vs 1071 us;
#: 16 MiB 4.69 vs 3.30 ms; a second run at 4 MiB gave 0.94 ms sharded, 0.49 ms for the
#: reduction alone on one thread (the inputs fit in the 32 MiB L3).
PARALLEL_MIN_BYTES: Final = 8 * 1024 * 1024

#: Bounds of the pieces the replicas take turns reducing (a quarter of an equal share per
#: replica, within these bounds): small enough to balance four replicas on two busy cores,
#: large enough that the ~10 us of Python per piece stays below 1% of its time.
PIECE_MIN_BYTES: Final = 256 * 1024
PIECE_MAX_BYTES: Final = 4 * 1024 * 1024

#: Replicas that reduce pieces of a sharded round (None: one per CPU); the others wait.
WORKERS: int | None = None

#: Arrays smaller than this are packed, per replica, into one flat buffer per dtype before
#: the reduction: one `np.concatenate` per replica replaces a few ufunc calls per array.
#: Above it the array is reduced in place from the caller's memory (packing would copy
#: every byte once more). Measured, 4 replicas, one all_reduce of a list (medians): 160 x
#: 1 KiB unpacked 1274 us, packed below 16 KiB 549 us, below 64 KiB 675 us; 100 x 4 B
#: 1227 / 557 / 613 us; 50 x 8 KiB 602 / 667 / 656 us.
PACK_BELOW_BYTES: Final = 16 * 1024

#: Output buffers of at least this many bytes are recycled once nobody holds a view of
#: them (their reference count says so): a fresh large allocation is zero-filled page by
#: page by the kernel on first touch (on the dev VM the first all-reduce of 198 MB took
#: 0.74 s, almost all page faults; with the recycled buffer it takes about 50 ms).
POOL_MIN_BYTES: Final = 1024 * 1024

#: Output buffers kept for reuse per (dtype, length), and total bytes kept.
_POOL_PER_KEY: Final = 2
_POOL_MAX_BYTES: Final = 2 * 1024**3

#: `sys.getrefcount` of a pooled buffer nobody else holds (see `_output`).
_UNUSED_REFCOUNT: Final = 3

#: Plans cached per input signature.
_PLAN_CACHE_SIZE: Final = 64

#: Cache-line alignment of the replicas' slice boundaries (no false sharing).
_ALIGN_BYTES: Final = 64

_NUMERIC_KINDS: Final = frozenset("iufc")


def _describe(sig: tuple[Any, ...]) -> str:
    return "[" + ", ".join(f"{dtype}{list(shape)}" for shape, dtype in sig) + "]"


@dataclasses.dataclass(frozen=True, slots=True)
class _Segment:
    """A contiguous piece of one dtype group's flat output and where its inputs are."""

    group: int
    offset: int
    length: int
    #: index of the input array reduced directly, or -1 for the group's pack.
    source: int


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Plan:
    """How to reduce one input signature (cached; depends on shapes and dtypes only)."""

    dtypes: tuple[np.dtype, ...]
    group_sizes: tuple[int, ...]
    #: per input array: (group, offset, size, shape)
    placements: tuple[tuple[int, int, int, tuple[int, ...]], ...]
    #: per group: the indices of its packed (small) arrays, in order; they fill
    #: `[0, pack_size)` of the group's output.
    packed: tuple[tuple[int, ...], ...]
    pack_sizes: tuple[int, ...]
    segments: tuple[_Segment, ...]
    total_bytes: int
    #: per piece size: the (segment index, lo, hi) pieces of the work.
    splits: dict[int, tuple[tuple[int, int, int], ...]] = dataclasses.field(
        default_factory=dict, compare=False
    )

    def pieces(self, piece_bytes: int) -> tuple[tuple[int, int, int], ...]:
        """The work cut into (segment index, lo, hi) pieces of at most `piece_bytes`.

        Small segments stay whole; boundaries inside a segment fall on cache lines, so
        replicas writing neighbouring pieces never share one.
        """
        cached = self.splits.get(piece_bytes)
        if cached is not None:
            return cached
        pieces: list[tuple[int, int, int]] = []
        for index, seg in enumerate(self.segments):
            itemsize = self.dtypes[seg.group].itemsize
            align = max(1, _ALIGN_BYTES // itemsize)
            step = max(align, piece_bytes // itemsize // align * align)
            pieces.extend(
                (index, lo, min(lo + step, seg.length)) for lo in range(0, seg.length, step)
            )
        result = tuple(pieces)
        self.splits[piece_bytes] = result
        return result


def _make_plan(sig: tuple[tuple[tuple[int, ...], np.dtype], ...]) -> _Plan:
    dtypes: list[np.dtype] = []
    members: list[list[int]] = []
    for i, (_, dtype) in enumerate(sig):
        if dtype not in dtypes:
            dtypes.append(dtype)
            members.append([])
        members[dtypes.index(dtype)].append(i)
    placements: list[tuple[int, int, int, tuple[int, ...]]] = [((0, 0, 0, ()))] * len(sig)
    packed: list[tuple[int, ...]] = []
    pack_sizes: list[int] = []
    segments: list[_Segment] = []
    group_sizes: list[int] = []
    total = 0
    for g, (dtype, indices) in enumerate(zip(dtypes, members, strict=True)):
        small = [i for i in indices if _size(sig[i][0]) * dtype.itemsize < PACK_BELOW_BYTES]
        large = [i for i in indices if i not in small]
        offset = 0
        for i in small:
            size = _size(sig[i][0])
            placements[i] = (g, offset, size, sig[i][0])
            offset += size
        pack_size = offset
        if len(small) == 1:
            # One small array needs no pack: reduce it from the caller's memory.
            segments.append(_Segment(g, 0, pack_size, small[0]))
            small = []
        elif pack_size:
            segments.append(_Segment(g, 0, pack_size, -1))
        for i in large:
            size = _size(sig[i][0])
            placements[i] = (g, offset, size, sig[i][0])
            segments.append(_Segment(g, offset, size, i))
            offset += size
        packed.append(tuple(small))
        pack_sizes.append(pack_size if small else 0)
        group_sizes.append(offset)
        total += offset * dtype.itemsize
    return _Plan(
        dtypes=tuple(dtypes),
        group_sizes=tuple(group_sizes),
        placements=tuple(placements),
        packed=tuple(packed),
        pack_sizes=tuple(pack_sizes),
        segments=tuple(segments),
        total_bytes=total,
    )


def _size(shape: tuple[int, ...]) -> int:
    size = 1
    for d in shape:
        size *= d
    return size


@dataclasses.dataclass(slots=True)
class _Arrival:
    """What one replica brought to a round."""

    kind: str
    values: list[Any]
    #: host NumPy views of `values` (C-contiguous), or None when some value is not a
    #: host array NumPy can add (CUDA or bfloat16 tensors, bool or object arrays).
    arrays: list[np.ndarray] | None
    #: ((shape, dtype), ...) for validation and planning.
    sig: tuple[Any, ...]
    #: which values are torch tensors (results follow each replica's own library).
    torch_mask: tuple[bool, ...]
    op: ReduceOp | None = None
    plan: _Plan | None = None
    #: per dtype group: this replica's packed small arrays (or None).
    packs: list[np.ndarray | None] | None = None
    extra: Any = None


class _Round:
    """One collective call: every replica's arrival, the plan, the shared results."""

    __slots__ = (
        "arrivals",
        "cancelled",
        "count",
        "done",
        "done_ids",
        "error",
        "failure",
        "failure_replica",
        "finished",
        "kind",
        "outputs",
        "plan",
        "ready",
        "results",
        "seq",
        "work",
    )

    def __init__(self, seq: int, n: int) -> None:
        self.seq = seq
        self.arrivals: list[_Arrival | None] = [None] * n
        self.count = 0
        self.kind = ""
        self.ready = False
        self.error: str | None = None
        self.failure: BaseException | None = None
        self.failure_replica = -1
        self.plan: _Plan | None = None
        self.outputs: list[np.ndarray] = []
        self.results: dict[Any, list[Any]] = {}
        self.work: Callable[[int], None] | None = None
        self.cancelled = False
        self.done = 0
        self.done_ids: list[int] = []
        self.finished = False


class ThreadCommunicator:
    """In-process collectives for the N replica threads of a strategy.

    Every replica thread calls the same collectives in the same order with its own
    `replica_id`. Inputs may be NumPy arrays, NumPy or Python scalars, or torch tensors
    (CPU tensors take the fast path; CUDA and bfloat16 tensors are reduced with torch).

    Args:
        num_replicas: how many replica threads take part (>= 1).
        name: a name for error messages.

    Example:
        >>> import threading
        >>> comm = ThreadCommunicator(2)
        >>> out = [None, None]
        >>> def replica(r):
        ...     out[r] = comm.all_reduce(r, [np.full(3, r + 1.0)], "sum", timeout=10)
        >>> threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
        >>> for t in threads:
        ...     t.start()
        >>> for t in threads:
        ...     t.join(10)
        >>> out[0][0]
        array([3., 3., 3.])
    """

    def __init__(self, num_replicas: int, name: str = "ThreadCommunicator") -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int):
            raise TypeError(f"num_replicas must be an int >= 1, received {num_replicas!r}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, received {num_replicas!r}")
        self._n = num_replicas
        self._name = name
        self._lock = threading.Lock()
        self._gates = _held_locks(num_replicas)
        self._sleepers: list[int] = []
        self._seq = 0
        self._round = _Round(0, num_replicas)
        self._aborted: BaseException | None = None
        self._broken: str | None = None
        self._mismatch: str | None = None
        self._departed: set[int] = set()
        self._plans: OrderedDict[Any, _Plan] = OrderedDict()
        self._pool: dict[tuple[np.dtype, int], list[np.ndarray]] = {}
        self._pool_bytes = 0
        self._cross_lock = threading.Lock()
        self._pack_buffers: list[dict[tuple[np.dtype, int], np.ndarray]] = [
            {} for _ in range(num_replicas)
        ]

    @property
    def num_replicas(self) -> int:
        """How many replica threads take part."""
        return self._n

    @property
    def name(self) -> str:
        """The name used in error messages."""
        return self._name

    def __repr__(self) -> str:
        return f"ThreadCommunicator(num_replicas={self._n}, name={self._name!r})"

    # ------------------------------------------------------------------ public API

    def all_reduce(
        self,
        replica_id: int,
        arrays: Sequence[Any],
        reduce_op: ReduceOp | str,
        timeout: float | None = None,
    ) -> list[Any]:
        """Reduce each array across replicas; every replica gets the same results.

        Args:
            replica_id: the calling replica (0 <= replica_id < num_replicas).
            arrays: this replica's arrays; the same shapes and dtypes in every replica.
            reduce_op: `ReduceOp.SUM`, `ReduceOp.MEAN` or their names.
            timeout: seconds to wait for the peers (None: wait until they come or
                `abort` is called).

        Returns:
            The reduced arrays, in the order and library (NumPy or torch) of `arrays`.
            Replicas share them: NumPy results are read-only; do not modify torch
            results in place.

        Raises:
            ValueError: the replicas' arrays differ in number, shape or dtype (raised in
                every replica).
            CollectiveTimeoutError: a peer did not arrive within `timeout`.
            ReplicaAbortedError: `abort` was called (a peer failed).
        """
        op = as_reduce_op(reduce_op)
        self._check_replica(replica_id)
        arrival = self._prepare_reduce(replica_id, list(arrays), op)
        return self._collective(replica_id, arrival, timeout)

    def _all_reduce_one(
        self, replica_id: int, array: np.ndarray, op: ReduceOp, timeout: float | None
    ) -> Any:
        """`all_reduce(replica_id, [array], op, timeout)[0]`, for a strategy's replica.

        The per-step case (a loss, a metric, one flat buffer): a contiguous NumPy array
        goes straight to the rendezvous, without the list plumbing and checks that
        `all_reduce` does for callers it does not know (this one's `replica_id` and `op`
        come from the strategy). Anything else takes `all_reduce`.
        """
        if (
            type(array) is np.ndarray
            and array.flags.c_contiguous
            and array.dtype.kind in _NUMERIC_KINDS
        ):
            values = [array]
            sig = ((array.shape, array.dtype),)
            arrival = _Arrival("all_reduce", values, values, sig, _ONE_NUMPY, op)
            plan = self._plans.get(sig)
            # One array is never packed (`_make_plan`): nothing to copy before arriving.
            arrival.plan = plan if plan is not None else self._plan(sig)
            return self._collective(replica_id, arrival, timeout)[0]
        return self.all_reduce(replica_id, [array], op, timeout)[0]

    def all_gather(
        self, replica_id: int, array: Any, axis: int = 0, timeout: float | None = None
    ) -> Any:
        """Concatenate every replica's `array` along `axis`, in replica order.

        Sizes may differ along `axis` only (a partial last batch); dtypes must match.

        Returns:
            The gathered array (shared, read-only for NumPy), in `array`'s library.

        Raises:
            ValueError: 0-d arrays, an axis out of range, or shapes or dtypes that differ
                other than along `axis` (in every replica, naming both shapes).
        """
        self._check_replica(replica_id)
        arrival = self._prepare_single("all_gather", array)
        arrival.extra = axis
        return self._collective(replica_id, arrival, timeout)[0]

    def broadcast(
        self, replica_id: int, array: Any, root: int = 0, timeout: float | None = None
    ) -> Any:
        """Every replica gets a copy of replica `root`'s `array` (one copy, shared).

        Non-root replicas may pass None; if they pass an array, its shape and dtype must
        match the root's (it tells the library of their result).
        """
        self._check_replica(replica_id)
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self._n:
            raise ValueError(
                f"broadcast root must be a replica id in [0, {self._n}), received {root!r}"
            )
        if array is None:  # the root passing None is reported to everyone at validation
            arrival = _Arrival("broadcast", [], None, (), ())
        else:
            arrival = self._prepare_single("broadcast", array)
        arrival.extra = root
        return self._collective(replica_id, arrival, timeout)[0]

    def abort(self, exc: BaseException) -> None:
        """Release every waiting replica with `ReplicaAbortedError` (a peer failed).

        Later calls raise `ReplicaAbortedError` at once until `reset()`.
        """
        with self._lock:
            if self._aborted is None:
                self._aborted = exc
            self._wake_locked()

    def reset(self) -> None:
        """Make the communicator usable again after `abort` or a timeout.

        Call it when no replica is inside a collective (after the replicas of a failed
        run have returned).
        """
        with self._lock:
            self._departed.clear()
            if (
                self._aborted is None
                and self._broken is None
                and self._mismatch is None
                and self._round.count == 0
            ):
                return  # a clean run (every run's end): nobody to release, no round to drop
            self._aborted = None
            self._broken = None
            self._mismatch = None
            self._round.cancelled = True
            self._seq += 1
            self._round = _Round(self._seq, self._n)
            self._wake_locked()
            # Fresh gates: a broken run may leave one released with nobody to take it (a
            # cooperative replica unwound where it waited), which would wake a later wait.
            self._gates = _held_locks(self._n)

    def finish(self, replica_id: int) -> None:
        """Record that `replica_id` will make no more collectives in this run.

        A strategy's runner calls this when a replica's function returns. Peers waiting
        for it (now or later) get a RuntimeError naming it instead of a hang (TF:
        "Some replicas made a different number of ... calls"); `reset()` clears it.
        """
        self._check_replica(replica_id)
        self._departed.add(replica_id)  # atomic under the GIL
        if self._round.count:
            # Peers wait in a round: they may now never complete it. (A peer arriving
            # after this reads `_departed` under the lock and sees this replica.)
            with self._lock:
                self._check_departed_locked(self._round)

    def cross_replica_all_reduce(
        self, per_replica: Sequence[Sequence[Any]], reduce_op: ReduceOp | str
    ) -> list[list[Any]]:
        """All-reduce every replica's arrays from one thread (cross-replica context).

        The same validation, packing, in-order blocked adds and shared results as
        `all_reduce`, for a caller that holds every replica's values (a `CrossDeviceOps`
        reducing a `PerReplica` outside `strategy.run`). Large rounds are split across the
        host kernels' worker pool instead of the replica threads. Calls are serialised;
        do not mix them with replica-thread calls on the same communicator (use
        `all_reduce_host`, which keeps one communicator per replica count for this).

        Args:
            per_replica: `num_replicas` lists of arrays, one list per replica.
            reduce_op: `ReduceOp.SUM`, `ReduceOp.MEAN` or their names.

        Returns:
            One list of results per replica (shared buffers, as `all_reduce`).
        """
        op = as_reduce_op(reduce_op)
        if len(per_replica) != self._n:
            raise ValueError(
                f"{self._name}: expected one list of arrays per replica ({self._n}), "
                f"received {len(per_replica)}"
            )
        with self._cross_lock:
            rnd = _Round(-1, self._n)
            rnd.arrivals = [
                self._prepare_reduce(r, list(values), op) for r, values in enumerate(per_replica)
            ]
            rnd.count = self._n
            with self._lock:
                self._complete_locked(rnd, 0)
            if rnd.error is not None:
                raise ValueError(rnd.error)
            if rnd.failure is not None:
                raise rnd.failure
            work = rnd.work
            if work is not None:
                rnd.work = None
                run_parallel(work)
                self._finalize(rnd)
            return [list(rnd.results[self._result_key(rnd, r)]) for r in range(self._n)]

    # ------------------------------------------------------------------ preparation

    def _check_replica(self, replica_id: int) -> None:
        if type(replica_id) is int and 0 <= replica_id < self._n:
            return
        if (
            isinstance(replica_id, bool)
            or not isinstance(replica_id, int)
            or not 0 <= replica_id < self._n
        ):
            raise ValueError(
                f"{self._name}: replica_id must be an int in [0, {self._n}), "
                f"received {replica_id!r}"
            )

    def _host_view(self, value: Any) -> tuple[Any, np.ndarray | None, bool]:
        """(value as an array, its C-contiguous host NumPy view or None, is_torch)."""
        if type(value) is np.ndarray:
            arr = value
        elif is_torch(value):
            t = value.detach()
            if t.device.type != "cpu" or str(t.dtype) not in _TORCH_NUMPY_DTYPES:
                return value, None, True
            arr = t.resolve_conj().resolve_neg().numpy()
            value = t
        else:
            value = NUMPY.asarray(value)
            arr = value
        if arr.dtype.kind not in _NUMERIC_KINDS:
            return value, None, is_torch(value)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        return value, arr, is_torch(value)

    def _prepare_reduce(self, replica_id: int, values: list[Any], op: ReduceOp) -> _Arrival:
        if all(
            type(v) is np.ndarray and v.flags.c_contiguous and v.dtype.kind in _NUMERIC_KINDS
            for v in values
        ):
            # Fast path (contiguous NumPy arrays, the common case): no per-array dispatch.
            sig_fast = tuple([(v.shape, v.dtype) for v in values])
            arrival = _Arrival("all_reduce", values, values, sig_fast, _no_torch(len(values)), op)
            return self._plan_and_pack(replica_id, arrival)
        hosts: list[np.ndarray] | None = []
        torch_mask: list[bool] = []
        sig: list[Any] = []
        for i, raw in enumerate(values):
            value, arr, from_torch = self._host_view(raw)
            values[i] = value
            torch_mask.append(from_torch)
            if arr is None:
                hosts = None
                be = backend_for(value)
                sig.append((be.shape(value), be.dtype_name(value)))
            else:
                if hosts is not None:
                    hosts.append(arr)
                sig.append((arr.shape, arr.dtype))
        arrival = _Arrival("all_reduce", values, hosts, tuple(sig), tuple(torch_mask), op)
        return self._plan_and_pack(replica_id, arrival)

    def _plan_and_pack(self, replica_id: int, arrival: _Arrival) -> _Arrival:
        if arrival.arrays is not None:
            plan = self._plan(arrival.sig)
            arrival.plan = plan
            if any(plan.packed):
                arrival.packs = self._pack(replica_id, plan, arrival.arrays)
        return arrival

    def _prepare_single(self, kind: str, value: Any) -> _Arrival:
        value, arr, from_torch = self._host_view(value)
        be = backend_for(value)
        if arr is None:
            sig: Any = ((be.shape(value), be.dtype_name(value)),)
            return _Arrival(kind, [value], None, sig, (from_torch,))
        return _Arrival(kind, [value], [arr], ((arr.shape, arr.dtype),), (from_torch,))

    def _plan(self, sig: tuple[Any, ...]) -> _Plan:
        plan = self._plans.get(sig)
        if plan is None:
            plan = _make_plan(sig)
            with self._lock:
                self._plans[sig] = plan
                while len(self._plans) > _PLAN_CACHE_SIZE:
                    self._plans.popitem(last=False)
        return plan

    def _pack(
        self, replica_id: int, plan: _Plan, hosts: list[np.ndarray]
    ) -> list[np.ndarray | None]:
        """Copy this replica's small arrays into its reusable per-dtype pack buffers.

        The buffer of round k+1 may reuse round k's: every replica has finished reading
        round k's inputs before any replica leaves round k.
        """
        buffers = self._pack_buffers[replica_id]
        packs: list[np.ndarray | None] = []
        for g, members in enumerate(plan.packed):
            if not members:
                packs.append(None)
                continue
            key = (plan.dtypes[g], plan.pack_sizes[g])
            buf = buffers.get(key)
            if buf is None:
                if len(buffers) >= 8:
                    buffers.clear()
                buf = buffers[key] = np.empty(plan.pack_sizes[g], dtype=plan.dtypes[g])
            np.concatenate([hosts[i] for i in members], axis=None, out=buf)
            packs.append(buf)
        return packs

    # ------------------------------------------------------------------ rendezvous

    def _collective(self, replica_id: int, arrival: _Arrival, timeout: float | None) -> list[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._raise_if_unusable(None)
            rnd = self._round
            if rnd.arrivals[replica_id] is not None:
                raise ValueError(
                    f"{self._name}: replica {replica_id} called {arrival.kind} twice in "
                    f"collective #{rnd.seq}; every replica thread must use its own replica_id"
                )
            rnd.arrivals[replica_id] = arrival
            rnd.count += 1
            last = rnd.count == self._n
            if last:
                self._seq += 1
                self._round = _Round(self._seq, self._n)
                self._complete_locked(rnd, replica_id)
                rnd.ready = True
                self._wake_locked()
            else:
                self._check_departed_locked(rnd)
                self._raise_if_unusable(rnd)
                self._sleepers.append(replica_id)
        if not last:
            self._wait(replica_id, rnd, "arrive", deadline, timeout, arrival.kind)
        if rnd.error is not None:
            raise ValueError(rnd.error)
        # Read before this replica counts itself done: the last one to finish clears it.
        work = rnd.work
        if work is None and rnd.failure is not None:
            self._raise_failure(rnd, replica_id)
        if work is not None:
            try:
                if rnd.failure is None:  # a peer's share failed: skip, but still report
                    work(replica_id)
            except BaseException as exc:
                with self._lock:
                    if rnd.failure is None:
                        rnd.failure, rnd.failure_replica = exc, replica_id
                    self._finish_work_locked(rnd, replica_id)
                raise
            with self._lock:
                self._finish_work_locked(rnd, replica_id)
                last = rnd.finished
                if not last:
                    self._sleepers.append(replica_id)
            if not last:
                self._wait(replica_id, rnd, "finish", deadline, timeout, arrival.kind)
            if rnd.failure is not None:
                self._raise_failure(rnd, replica_id)
        return list(rnd.results[self._result_key(rnd, replica_id)])

    def _finish_work_locked(self, rnd: _Round, replica_id: int) -> None:
        rnd.done += 1
        rnd.done_ids.append(replica_id)
        if rnd.done == self._n:
            # Break the round -> work closure -> round cycle now, so the round and its
            # references to the output buffers die with the last replica's reference
            # (the buffer pool relies on exact reference counts).
            rnd.work = None
            if rnd.failure is None:
                try:
                    self._finalize(rnd)
                except BaseException as exc:
                    rnd.failure, rnd.failure_replica = exc, replica_id
            rnd.finished = True
            self._wake_locked()

    def _raise_failure(self, rnd: _Round, replica_id: int) -> None:
        """The replica whose thread failed re-raises; its peers are released."""
        assert rnd.failure is not None
        if rnd.failure_replica == replica_id:
            raise rnd.failure
        raise ReplicaAbortedError(
            f"{self._name}: {rnd.kind} #{rnd.seq} failed in replica "
            f"{rnd.failure_replica}: {rnd.failure!r}"
        ) from rnd.failure

    def _raise_if_unusable(self, rnd: _Round | None) -> None:
        if self._aborted is not None:
            where = f" in collective #{rnd.seq}" if rnd is not None else ""
            raise ReplicaAbortedError(
                f"{self._name}: aborted{where} because a peer failed: {self._aborted!r}"
            ) from self._aborted
        if self._broken is not None:
            raise CollectiveTimeoutError(self._broken)
        if self._mismatch is not None:
            raise RuntimeError(self._mismatch)
        if rnd is not None and rnd.cancelled:
            raise ReplicaAbortedError(
                f"{self._name}: collective #{rnd.seq} was cancelled by reset() while this "
                "replica waited in it"
            )

    def _wake_locked(self) -> None:
        """Release every sleeping replica (each re-checks why it was woken)."""
        gates = self._gates
        sleepers = self._sleepers
        for r in sleepers:
            if r:
                gates[r].release()
        if 0 in sleepers:
            # Replica 0 last: in a strategy it runs on the caller's thread, which waits for
            # the others at the end of `run`; finishing last saves it a wake-up there.
            gates[0].release()
        sleepers.clear()

    def _wait(
        self,
        replica_id: int,
        rnd: _Round,
        phase: str,
        deadline: float | None,
        timeout: float | None,
        kind: str,
    ) -> None:
        """Sleep on this replica's gate until `rnd` reaches `phase`, fails or times out.

        Called without the lock, after registering in `_sleepers` under it. A gate is a
        lock held except while its replica is being woken: the waker releases it (under
        the lock) and removes the replica from `_sleepers`; the sleeper acquires it back.
        One gate per replica instead of a Condition cuts the cost of a rendezvous
        (measured, 4 threads on 2 cores: 46 us per Condition barrier, 29 us with gates)
        because woken threads do not queue for the condition's lock.
        """
        gate = self._gates[replica_id]
        while True:
            if deadline is None:
                # No timeout: abort(), reset(), finish() and peers' timeouts release it.
                block(gate, None)
            elif not block(gate, max(0.0, deadline - time.monotonic())):
                with self._lock:
                    if replica_id in self._sleepers:
                        self._sleepers.remove(replica_id)
                        if rnd.ready if phase == "arrive" else rnd.finished:
                            return
                        self._raise_if_unusable(rnd)
                        self._time_out_locked(rnd, phase, timeout, kind)
                    # Woken between the timeout and taking the lock: take the release.
                    gate.acquire()
            if rnd.ready if phase == "arrive" else rnd.finished:
                return
            with self._lock:
                if rnd.ready if phase == "arrive" else rnd.finished:
                    return
                self._raise_if_unusable(rnd)
                self._sleepers.append(replica_id)

    def _time_out_locked(self, rnd: _Round, phase: str, timeout: float | None, kind: str) -> None:
        if phase == "arrive":
            missing = [r for r, a in enumerate(rnd.arrivals) if a is None]
            what = "did not arrive"
        else:
            missing = [r for r in range(self._n) if r not in rnd.done_ids]
            what = "did not finish their share"
        arrived = [r for r in range(self._n) if r not in missing]
        self._broken = (
            f"{self._name}: {kind} #{rnd.seq} timed out after {timeout} s: replicas "
            f"{missing} {what} (arrived: {arrived}). Every replica must make the same "
            "collectives in the same order; if the step is just slow, raise the timeout "
            "(CommunicationOptions.timeout_seconds). Call reset() before reusing the "
            "communicator."
        )
        self._wake_locked()
        raise CollectiveTimeoutError(self._broken)

    def _check_departed_locked(self, rnd: _Round) -> None:
        if not self._departed or rnd.count == 0 or rnd.ready:
            return
        waiting = [r for r, a in enumerate(rnd.arrivals) if a is not None]
        if len(waiting) + len(self._departed - set(waiting)) < self._n:
            return
        kind = next(a.kind for a in rnd.arrivals if a is not None)
        message = (
            f"{self._name}: replicas {sorted(self._departed)} returned while replicas "
            f"{waiting} wait in {kind} #{rnd.seq}. Every replica must make the same "
            "collectives (all_reduce, all_gather, merge_call) in the same order."
        )
        self._mismatch = message
        self._wake_locked()

    # ------------------------------------------------------------------ completion

    def _complete_locked(self, rnd: _Round, replica_id: int) -> None:
        """Run by the last arriver: validate, plan, and compute or hand out the work."""
        arrivals: list[_Arrival] = rnd.arrivals  # type: ignore[assignment]
        first = arrivals[0]
        rnd.kind = first.kind
        try:
            rnd.error = self._validate(rnd, arrivals)
            if rnd.error is not None:
                return
            if first.kind == "all_reduce":
                self._setup_reduce(rnd, arrivals)
            elif first.kind == "all_gather":
                self._setup_gather(rnd, arrivals)
            else:
                self._setup_broadcast(rnd, arrivals)
        except BaseException as exc:
            rnd.failure, rnd.failure_replica = exc, replica_id
            rnd.work = None

    def _validate(self, rnd: _Round, arrivals: list[_Arrival]) -> str | None:
        first = arrivals[0]
        for r, a in enumerate(arrivals):
            if a.kind != first.kind:
                return (
                    f"{self._name}: collective #{rnd.seq} mismatch: replica 0 called "
                    f"{first.kind} but replica {r} called {a.kind}. Every replica must make "
                    "the same collectives in the same order."
                )
        if first.kind == "all_reduce":
            for r, a in enumerate(arrivals):
                if a.op is not first.op:
                    return (
                        f"{self._name}: all_reduce #{rnd.seq}: replica 0 reduces with "
                        f"{first.op} but replica {r} with {a.op}; use one reduce op everywhere."
                    )
                if a.sig != first.sig:
                    return self._sig_mismatch(rnd, first, r, a)
            return None
        if first.kind == "broadcast":
            root = first.extra
            for r, a in enumerate(arrivals):
                if a.extra != root:
                    return (
                        f"{self._name}: broadcast #{rnd.seq}: replica 0 broadcasts from root "
                        f"{root} but replica {r} from root {a.extra}; use one root everywhere."
                    )
            if not arrivals[root].values:
                return (
                    f"{self._name}: broadcast #{rnd.seq}: the root replica {root} passed "
                    "None; expected the array to broadcast."
                )
            expected = arrivals[root].sig
            for r, a in enumerate(arrivals):
                if a.values and a.sig != expected:
                    return (
                        f"{self._name}: broadcast #{rnd.seq}: expected every replica's "
                        f"array to match the root's {_describe(expected)}, but replica {r} "
                        f"passed {_describe(a.sig)}; pass None or a matching array."
                    )
            return None
        return self._validate_gather(rnd, arrivals)

    def _sig_mismatch(self, rnd: _Round, first: _Arrival, r: int, a: _Arrival) -> str:
        head = f"{self._name}: all_reduce #{rnd.seq}:"
        if len(a.sig) != len(first.sig):
            return (
                f"{head} expected {len(first.sig)} arrays (as replica 0 passed) but replica "
                f"{r} passed {len(a.sig)}; every replica must reduce the same structure."
            )
        for i, (want, got) in enumerate(zip(first.sig, a.sig, strict=True)):
            if want != got:
                return (
                    f"{head} array {i}: expected shape {want[0]!r} dtype {want[1]!s} (as "
                    f"replica 0 passed) but replica {r} passed shape {got[0]!r} dtype "
                    f"{got[1]!s}; every replica must pass the same shapes and dtypes."
                )
        return f"{head} replica {r}'s arrays differ from replica 0's"  # pragma: no cover

    def _validate_gather(self, rnd: _Round, arrivals: list[_Arrival]) -> str | None:
        head = f"{self._name}: all_gather #{rnd.seq}:"
        axis = arrivals[0].extra
        shape0, dtype0 = arrivals[0].sig[0]
        for r, a in enumerate(arrivals):
            if a.extra != axis:
                return (
                    f"{head} replica 0 gathers along axis {axis} but replica {r} along "
                    f"axis {a.extra}; use one axis everywhere."
                )
        if isinstance(axis, bool) or not isinstance(axis, int):
            return f"{head} axis must be an int, received {axis!r}"
        ndim = len(shape0)
        if ndim == 0:
            return (
                f"{head} cannot gather 0-d (scalar) values along axis {axis}; expected "
                "arrays with at least one dimension (reshape scalars to [1])."
            )
        if not -ndim <= axis < ndim:
            return f"{head} axis {axis} is out of range for arrays of shape {shape0!r}"
        axis %= ndim
        for r, a in enumerate(arrivals):
            shape, dtype = a.sig[0]
            if dtype != dtype0:
                return (
                    f"{head} expected dtype {dtype0!s} (as replica 0 passed) but replica {r} "
                    f"passed {dtype!s}; every replica must gather the same dtype."
                )
            if len(shape) != ndim or any(
                d != e for k, (d, e) in enumerate(zip(shape, shape0, strict=True)) if k != axis
            ):
                return (
                    f"{head} shapes may differ along axis {axis} only, but replica 0 passed "
                    f"shape {shape0!r} and replica {r} passed shape {shape!r}."
                )
        arrivals[0].extra = axis
        for a in arrivals:
            a.extra = axis
        return None

    # all_reduce ---------------------------------------------------------------

    def _setup_reduce(self, rnd: _Round, arrivals: list[_Arrival]) -> None:
        first = arrivals[0]
        op = first.op
        if first.arrays is None or any(a.arrays is None for a in arrivals):
            self._fallback_reduce(rnd, arrivals, op)
            return
        plan = first.plan
        assert plan is not None
        if (
            len(plan.placements) == 1
            and plan.total_bytes < PACK_BELOW_BYTES
            and not any(a.torch_mask[0] for a in arrivals)
        ):
            self._reduce_one_small(rnd, arrivals, plan)
            return
        rnd.plan = plan
        rnd.outputs = [
            self._output(dt, size) for dt, size in zip(plan.dtypes, plan.group_sizes, strict=True)
        ]
        if plan.total_bytes < PARALLEL_MIN_BYTES or self._n == 1:
            self._reduce_pieces(
                rnd, arrivals, [(i, 0, s.length) for i, s in enumerate(plan.segments)]
            )
            self._finalize(rnd)
            return
        piece_bytes = min(PIECE_MAX_BYTES, max(PIECE_MIN_BYTES, plan.total_bytes // (4 * self._n)))
        pieces = plan.pieces(piece_bytes)
        # Work sharing: each replica takes the next piece until none is left, so the
        # replicas that are awake (the last arriver at once, the others as they wake)
        # share the work, and a replica slowed by another process takes fewer pieces.
        # next() on an itertools.count is atomic under the GIL.
        taken = itertools.count()
        # At most one worker per CPU: more compute-bound threads than cores only evict
        # each other's accumulator blocks from L2 at every context switch.
        tickets = itertools.count()
        workers = WORKERS or available_cpus()

        def work(replica_id: int) -> None:
            del replica_id
            if next(tickets) >= workers:
                return
            for i in taken:
                if i >= len(pieces):
                    return
                self._reduce_pieces(rnd, arrivals, pieces[i : i + 1], blocked=True)

        rnd.work = work

    def _reduce_one_small(self, rnd: _Round, arrivals: list[_Arrival], plan: _Plan) -> None:
        """One small NumPy array per replica (a step's loss or metric): the plain chain.

        The same adds in the same order as `sum_slice` (bitwise equal), without the
        flat-buffer bookkeeping that pays off only for many or large arrays.
        """
        dtype = plan.dtypes[0]
        shape = plan.placements[0][3]
        inputs = [a.arrays[0] for a in arrivals]  # type: ignore[index]
        out = np.empty(shape, dtype=dtype)
        if len(inputs) == 1:
            np.copyto(out, inputs[0])
        else:
            np.add(inputs[0], inputs[1], out=out)
            for x in inputs[2:]:
                np.add(out, x, out=out)
        result: np.ndarray = out
        if arrivals[0].op is ReduceOp.MEAN:
            if dtype.kind in "fc":
                np.true_divide(out, self._n, out=out)
            else:
                result = NUMPY.divide(out, self._n)
        rnd.results[_no_torch(1)] = [NUMPY.freeze(result)]

    def _reduce_pieces(
        self,
        rnd: _Round,
        arrivals: list[_Arrival],
        pieces: Sequence[tuple[int, int, int]],
        blocked: bool = False,
    ) -> None:
        plan = rnd.plan
        assert plan is not None
        n = self._n
        mean = arrivals[0].op is ReduceOp.MEAN
        for index, lo, hi in pieces:
            seg = plan.segments[index]
            out = rnd.outputs[seg.group][seg.offset : seg.offset + seg.length]
            if seg.source >= 0:
                src = seg.source
                inputs = [a.arrays[src].reshape(-1) for a in arrivals]  # type: ignore[index]
            else:
                inputs = [a.packs[seg.group] for a in arrivals]  # type: ignore[index]
            dtype = plan.dtypes[seg.group]
            divide = mean and dtype.kind in "fc"
            # Sharded pieces are cut into L2-sized blocks: with every replica thread
            # reducing a piece at once, whole pieces would crowd each other out of the
            # shared L3 (measured, 198 MB in 4 MiB pieces: 60-84 ms whole, 49 ms blocked).
            block = BLOCK_BYTES // dtype.itemsize if blocked else None
            stream = rnd.outputs[seg.group].nbytes >= STREAM_MIN_BYTES
            sum_slice(
                inputs,
                out,
                lo,
                hi,
                divisor=n if divide else None,
                block_elements=block,
                stream=stream,
            )

    def _finalize(self, rnd: _Round) -> None:
        """Build the shared results (views of the outputs), once per library pattern."""
        if rnd.plan is None:
            return
        plan = rnd.plan
        arrivals: list[_Arrival] = rnd.arrivals  # type: ignore[assignment]
        mean = arrivals[0].op is ReduceOp.MEAN
        readonly = []
        for out in rnd.outputs:
            view = out.view()
            view.flags.writeable = False
            readonly.append(view)
        torch_flat: list[Any] = [None] * len(rnd.outputs)
        for a in arrivals:
            key = a.torch_mask
            if key in rnd.results:
                continue
            values: list[Any] = []
            for i, (g, offset, size, shape) in enumerate(plan.placements):
                if key[i]:
                    if torch_flat[g] is None:
                        import torch

                        torch_flat[g] = torch.from_numpy(rnd.outputs[g])
                    value = torch_flat[g][offset : offset + size].view(shape)
                    if mean and plan.dtypes[g].kind in "iu":
                        value = torch.true_divide(value, self._n)
                else:
                    value = readonly[g][offset : offset + size].reshape(shape)
                    if mean and plan.dtypes[g].kind in "iu":
                        value = NUMPY.freeze(NUMPY.divide(value, self._n))
                values.append(value)
            rnd.results[key] = values

    def _result_key(self, rnd: _Round, replica_id: int) -> Any:
        if rnd.kind == "all_reduce" and rnd.plan is not None:
            return rnd.arrivals[replica_id].torch_mask  # type: ignore[union-attr]
        if rnd.kind == "broadcast":
            arrival = rnd.arrivals[replica_id]
            assert arrival is not None
            if not arrival.values:
                root = rnd.arrivals[0].extra  # type: ignore[union-attr]
                return rnd.arrivals[root].torch_mask
            return arrival.torch_mask
        return rnd.arrivals[replica_id].torch_mask  # type: ignore[union-attr]

    def _fallback_reduce(self, rnd: _Round, arrivals: list[_Arrival], op: ReduceOp | None) -> None:
        """Values NumPy cannot add here (CUDA, bfloat16, bool...): their library, in order."""
        results: list[Any] = []
        for i in range(len(arrivals[0].values)):
            column = [a.values[i] for a in arrivals]
            be = backend_for(column[0])
            total = be.sum_n(column)
            if op is ReduceOp.MEAN:
                total = be.divide(total, self._n)
            results.append(be.freeze(total))
        for a in arrivals:
            rnd.results.setdefault(a.torch_mask, results)

    # all_gather / broadcast -----------------------------------------------------

    def _setup_gather(self, rnd: _Round, arrivals: list[_Arrival]) -> None:
        axis: int = arrivals[0].extra
        if any(a.arrays is None for a in arrivals):
            column = [a.values[0] for a in arrivals]
            be = backend_for(column[0])
            result = be.freeze(be.concat(column, axis))
            for a in arrivals:
                rnd.results.setdefault(a.torch_mask, [result])
            return
        hosts = [a.arrays[0] for a in arrivals]  # type: ignore[index]
        shape = list(hosts[0].shape)
        shape[axis] = sum(h.shape[axis] for h in hosts)
        size = _size(tuple(shape))
        flat = self._output(hosts[0].dtype, size)
        out = flat.reshape(shape)
        starts = [0]
        for h in hosts:
            starts.append(starts[-1] + h.shape[axis])
        lead = (slice(None),) * axis

        def copy(replica_id: int) -> None:
            dest = out[(*lead, slice(starts[replica_id], starts[replica_id + 1]))]
            np.copyto(dest, hosts[replica_id])

        rnd.outputs = [flat]
        self._share_single(rnd, arrivals, out)
        if size * flat.itemsize < PARALLEL_MIN_BYTES or self._n == 1:
            for r in range(self._n):
                copy(r)
        else:
            rnd.work = copy

    def _setup_broadcast(self, rnd: _Round, arrivals: list[_Arrival]) -> None:
        root: int = arrivals[0].extra
        source = arrivals[root]
        if source.arrays is None:
            value = source.values[0]
            be = backend_for(value)
            result = be.freeze(be.copy(value))
            for a in arrivals:
                rnd.results.setdefault(a.torch_mask, [result])
            return
        src = source.arrays[0]
        flat = self._output(src.dtype, src.size)
        out = flat.reshape(src.shape)
        rnd.outputs = [flat]
        self._share_single(rnd, arrivals, out)
        src_flat = src.reshape(-1)
        if src.nbytes < PARALLEL_MIN_BYTES or self._n == 1:
            np.copyto(flat, src_flat)
            return
        n = self._n
        align = max(1, _ALIGN_BYTES // src.itemsize)
        bounds = [min(src.size, (src.size * k // n) // align * align) for k in range(n)]
        bounds.append(src.size)

        def copy(replica_id: int) -> None:
            lo, hi = bounds[replica_id], bounds[replica_id + 1]
            np.copyto(flat[lo:hi], src_flat[lo:hi])

        rnd.work = copy

    def _share_single(self, rnd: _Round, arrivals: list[_Arrival], out: np.ndarray) -> None:
        readonly = out.view()
        readonly.flags.writeable = False
        for a in arrivals:
            key = a.torch_mask
            if not key or key in rnd.results:
                continue
            if key[0]:
                import torch

                rnd.results[key] = [torch.from_numpy(out)]
            else:
                rnd.results[key] = [readonly]

    # ------------------------------------------------------------------ buffers

    def _output(self, dtype: np.dtype, size: int) -> np.ndarray:
        """A flat output buffer; large ones are recycled once no result views them."""
        nbytes = size * dtype.itemsize
        if nbytes < POOL_MIN_BYTES:
            return np.empty(size, dtype=dtype)
        key = (dtype, size)
        bucket = self._pool.get(key)
        if bucket is None:
            bucket = self._pool[key] = []
        for buf in bucket:
            # Referenced only by `bucket`, the loop variable and getrefcount's argument:
            # no result, view or tensor uses it any more, so overwriting it cannot change
            # anything visible.
            if sys.getrefcount(buf) == _UNUSED_REFCOUNT:
                return buf
        buf = np.empty(size, dtype=dtype)
        if len(bucket) < _POOL_PER_KEY and self._pool_bytes + nbytes <= _POOL_MAX_BYTES:
            bucket.append(buf)
            self._pool_bytes += nbytes
        return buf


def _held_locks(n: int) -> list[threading.Lock]:
    """`n` locks, each already held (the gates replicas sleep on)."""
    locks = [threading.Lock() for _ in range(n)]
    for lock in locks:
        lock.acquire()
    return locks


_NO_TORCH: dict[int, tuple[bool, ...]] = {}


def _no_torch(n: int) -> tuple[bool, ...]:
    """`(False,) * n`, cached (the result key of an all-NumPy arrival)."""
    mask = _NO_TORCH.get(n)
    if mask is None:
        mask = _NO_TORCH[n] = (False,) * n
    return mask


_ONE_NUMPY: Final = _no_torch(1)


_HOST_REDUCERS: dict[int, ThreadCommunicator] = {}
_HOST_REDUCERS_LOCK: Final = threading.Lock()


def all_reduce_host(
    per_replica: Sequence[Sequence[Any]], reduce_op: ReduceOp | str
) -> list[list[Any]]:
    """The default host all-reduce for a caller holding every replica's arrays.

    `per_replica[r]` is replica r's list of arrays (NumPy, scalars or torch tensors; the
    same shapes and dtypes in every list). Arrays are grouped by dtype, small ones packed,
    large ones reduced in place in cache-sized blocks across the worker pool, adding in
    replica order (bitwise equal to `x0 + x1 + ...`). Every replica gets views of the same
    read-only result buffers, in its own library.

    Args:
        per_replica: one list of arrays per replica (at least one replica).
        reduce_op: `ReduceOp.SUM`, `ReduceOp.MEAN` or their names.

    Returns:
        One list of results per replica.

    Raises:
        ValueError: the lists differ in length, shapes or dtypes (naming both).

    Example:
        >>> a, b = np.ones(3, np.float32), np.full(3, 2.0, np.float32)
        >>> all_reduce_host([[a], [b]], "mean")[1][0]
        array([1.5, 1.5, 1.5], dtype=float32)
    """
    n = len(per_replica)
    if n < 1:
        raise ValueError("all_reduce_host expected at least one replica's arrays, received none")
    with _HOST_REDUCERS_LOCK:
        comm = _HOST_REDUCERS.get(n)
        if comm is None:
            comm = _HOST_REDUCERS[n] = ThreadCommunicator(n, name="all_reduce_host")
    return comm.cross_replica_all_reduce(per_replica, reduce_op)


_TORCH_NUMPY_DTYPES: Final = frozenset(
    f"torch.{name}"
    for name in (
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
    )
)
