"""`ThreadCommunicator`: collectives between the replicas of one process.

Every replica of a strategy calls the same collectives in the same order; each call is a
round of the strategy's `Rendezvous` (`crossdevice._sync.rendezvous`), the same one
its `merge_call`s go through. The last replica to arrive validates the round (the same
collective, reduce op, structure, shapes and dtypes everywhere) and plans it
(`crossdevice._comm.local.host_reduce`). Then:

* small rounds: the last arriver computes the whole result itself and releases everyone
  (one rendezvous: the cost of a scalar all-reduce is a few thread wake-ups);
* large rounds: the replica threads (one per CPU) take turns at pieces of the work,
  each reducing its piece across all inputs into a shared output (a reduce-scatter;
  NumPy releases the GIL, so the threads run in parallel), and after a second
  rendezvous every replica returns the same read-only results (the all-gather is
  sharing: host replicas share memory).

Adds run in replica order, so results are bitwise reproducible and equal to the naive
in-order chain whatever the thread timing.

Reliability (docs/design.md §5): bad input raises ValueError in every replica, naming what
was expected and received; aborts, timeouts and replicas that return early are the
rendezvous' (see there).

Results share memory between replicas. NumPy results are read-only views; torch has no
read-only tensors, so torch results must not be modified in place (TF tensors are
immutable too; copy a result before mutating it).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from crossdevice._arrays import backend_for
from crossdevice._arrays.buffer_pool import BufferPool
from crossdevice._arrays.host_kernels import available_cpus, plain_sum, run_parallel
from crossdevice._arrays.numpy_backend import NUMPY
from crossdevice._comm.local.arrivals import (
    NUMERIC_KINDS,
    ONE_NUMPY,
    CollectiveArrival,
    host_view,
    no_torch,
    validate,
)
from crossdevice._comm.local.copies import setup_broadcast, setup_gather
from crossdevice._comm.local.host_reduce import (
    PACK_BELOW_BYTES,
    PARALLEL_MIN_BYTES,
    PIECE_MAX_BYTES,
    PIECE_MIN_BYTES,
    Plan,
    make_plan,
    reduce_pieces,
)
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op
from crossdevice._sync.rendezvous import Rendezvous
from crossdevice._sync.rounds import Round, describe_leaves

__all__ = [
    "PACK_BELOW_BYTES",
    "PARALLEL_MIN_BYTES",
    "POOL_MIN_BYTES",
    "ThreadCommunicator",
]

#: Output buffers of at least this many bytes are recycled once nobody holds a view of
#: them (`BufferPool`): a fresh large allocation is zero-filled page by page by the
#: kernel on first touch (on the dev VM the first all-reduce of 198 MB took 0.74 s,
#: almost all page faults; with the recycled buffer it takes about 50 ms).
POOL_MIN_BYTES: Final = 1024 * 1024

#: Plans cached per input signature.
_PLAN_CACHE_SIZE: Final = 64


class ThreadCommunicator:
    """In-process collectives for the N replicas of a strategy.

    Every replica calls the same collectives in the same order with its own
    `replica_id`. Inputs may be NumPy arrays, NumPy or Python scalars, or torch tensors
    (CPU tensors take the fast path; CUDA and bfloat16 tensors are reduced with torch).

    Args:
        num_replicas: how many replicas take part (>= 1).
        name: a name for error messages.
        rendezvous: the rendezvous the replicas meet in (a strategy passes the one its
            `merge_call`s use); None makes one.

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

    def __init__(
        self,
        num_replicas: int,
        name: str = "ThreadCommunicator",
        rendezvous: Rendezvous | None = None,
    ) -> None:
        if rendezvous is None:
            rendezvous = Rendezvous(num_replicas, name)
        elif rendezvous.num_replicas != num_replicas:
            raise ValueError(
                f"{name}: expected a rendezvous of {num_replicas} replicas, received {rendezvous!r}"
            )
        self._n = num_replicas
        self._name = name
        self._rendezvous = rendezvous
        self._lock = threading.Lock()
        self._plans: OrderedDict[Any, Plan] = OrderedDict()
        self._pool = BufferPool()
        self._cross_lock = threading.Lock()
        self._pack_buffers: list[dict[tuple[np.dtype, int], np.ndarray]] = [
            {} for _ in range(num_replicas)
        ]

    @property
    def rendezvous(self) -> Rendezvous:
        """The rendezvous the replicas meet in."""
        return self._rendezvous

    def abort(self, exc: BaseException) -> None:
        """Release every waiting replica with `ReplicaAbortedError` (`Rendezvous.abort`)."""
        self._rendezvous.abort(exc)

    def reset(self) -> None:
        """Make the communicator usable again after a failure (`Rendezvous.reset`)."""
        self._rendezvous.reset()

    def finish(self, replica_id: int) -> None:
        """Record that `replica_id` will make no more collectives (`Rendezvous.finish`)."""
        self._check_replica(replica_id)
        self._rendezvous.finish(replica_id)

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
        structure: Any = None,
    ) -> list[Any]:
        """Reduce each array across replicas; every replica gets the same results.

        Args:
            replica_id: the calling replica (0 <= replica_id < num_replicas).
            arrays: this replica's arrays; the same shapes and dtypes in every replica.
            reduce_op: `ReduceOp.SUM`, `ReduceOp.MEAN` or their names.
            timeout: seconds to wait for the peers (None: wait until they come or
                `abort` is called).
            structure: the nest structure `arrays` were flattened from (an optree spec);
                replicas must pass equal structures. None: a flat list.

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
        arrival.structure = structure
        return self._rendezvous.arrive(replica_id, arrival, timeout)

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
            and array.dtype.kind in NUMERIC_KINDS
        ):
            values = [array]
            sig = ((array.shape, array.dtype),)
            # One array is never packed (`make_plan`): nothing to copy before arriving.
            plan = self._plans.get(sig) or self._plan(sig)
            # Positional (no packs, extra or structure): keywords cost a third of the call.
            arrival = CollectiveArrival(
                "all_reduce", values, values, sig, ONE_NUMPY, op, plan, None, None, None, self
            )
            return self._rendezvous.arrive(replica_id, arrival, timeout)[0]
        return self.all_reduce(replica_id, [array], op, timeout)[0]

    def all_gather(
        self,
        replica_id: int,
        array: Any,
        axis: int = 0,
        timeout: float | None = None,
        structure: Any = None,
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
        arrival.structure = structure
        return self._rendezvous.arrive(replica_id, arrival, timeout)[0]

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
            arrival = CollectiveArrival("broadcast", [], None, (), (), handler=self)
        else:
            arrival = self._prepare_single("broadcast", array)
        arrival.extra = root
        return self._rendezvous.arrive(replica_id, arrival, timeout)[0]

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
            rnd = Round(-1, self._n)
            rnd.arrivals = [
                self._prepare_reduce(r, list(values), op) for r, values in enumerate(per_replica)
            ]
            rnd.count = self._n
            self.complete(self._rendezvous, rnd, 0)
            if rnd.error is not None:
                kind, message = rnd.error
                raise kind(message)
            work = rnd.work
            if work is not None:
                rnd.work = None
                run_parallel(work)
                self.finalize(rnd)
            return [self.result(rnd, r) for r in range(self._n)]

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

    def _prepare_reduce(
        self, replica_id: int, values: list[Any], op: ReduceOp
    ) -> CollectiveArrival:
        if all(
            type(v) is np.ndarray and v.flags.c_contiguous and v.dtype.kind in NUMERIC_KINDS
            for v in values
        ):
            # Fast path (contiguous NumPy arrays, the common case): no per-array dispatch.
            sig_fast = tuple([(v.shape, v.dtype) for v in values])
            arrival = CollectiveArrival(
                "all_reduce", values, values, sig_fast, no_torch(len(values)), op, handler=self
            )
            return self._plan_and_pack(replica_id, arrival)
        hosts: list[np.ndarray] | None = []
        torch_mask: list[bool] = []
        sig: list[Any] = []
        for i, raw in enumerate(values):
            value, arr, from_torch = host_view(raw)
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
        arrival = CollectiveArrival(
            "all_reduce", values, hosts, tuple(sig), tuple(torch_mask), op, handler=self
        )
        return self._plan_and_pack(replica_id, arrival)

    def _plan_and_pack(self, replica_id: int, arrival: CollectiveArrival) -> CollectiveArrival:
        if arrival.arrays is not None:
            plan = self._plan(arrival.sig)
            arrival.plan = plan
            if any(plan.packed):
                arrival.packs = self._pack(replica_id, plan, arrival.arrays)
        return arrival

    def _prepare_single(self, kind: str, value: Any) -> CollectiveArrival:
        value, arr, from_torch = host_view(value)
        be = backend_for(value)
        if arr is None:
            sig: Any = ((be.shape(value), be.dtype_name(value)),)
            return CollectiveArrival(kind, [value], None, sig, (from_torch,), handler=self)
        return CollectiveArrival(
            kind, [value], [arr], ((arr.shape, arr.dtype),), (from_torch,), handler=self
        )

    def _plan(self, sig: tuple[Any, ...]) -> Plan:
        plan = self._plans.get(sig)
        if plan is None:
            plan = make_plan(sig)
            with self._lock:
                self._plans[sig] = plan
                while len(self._plans) > _PLAN_CACHE_SIZE:
                    self._plans.popitem(last=False)
        return plan

    def _pack(
        self, replica_id: int, plan: Plan, hosts: list[np.ndarray]
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

    # ------------------------------------------------------------------ rounds

    def describe(self, arrival: CollectiveArrival) -> str:
        """What `arrival` asked for: `all_reduce(SUM, float32[3])`, `all_gather(axis=0, ...)`."""
        leaves = describe_leaves(arrival.sig, arrival.structure)
        if arrival.kind == "all_reduce":
            op = arrival.op.name if arrival.op is not None else None
            return f"all_reduce({op}, {leaves})"
        if arrival.kind == "all_gather":
            return f"all_gather(axis={arrival.extra!r}, {leaves})"
        return f"broadcast(root={arrival.extra!r}, {leaves if arrival.values else None})"

    def complete(self, rendezvous: Rendezvous, rnd: Round, replica_id: int) -> None:
        """Run by the last arriver: validate, plan, and compute or hand out the work."""
        del replica_id
        arrivals: list[CollectiveArrival] = rnd.arrivals
        first = arrivals[0]
        rnd.kind = first.kind
        error = validate(rendezvous, rnd, arrivals)
        if error is not None:
            rnd.set_error(ValueError, error)
            return
        if first.kind == "all_reduce":
            self._setup_reduce(rnd, arrivals)
        elif first.kind == "all_gather":
            setup_gather(rnd, arrivals, self._output)
        else:
            setup_broadcast(rnd, arrivals, self._output)

    def result(self, rnd: Round, replica_id: int) -> list[Any]:
        """Replica `replica_id`'s results of a completed round (shared buffers)."""
        if rnd.kind == "all_reduce":
            return list(rnd.results[rnd.arrivals[replica_id].torch_mask])
        return list(rnd.results[self._result_key(rnd, replica_id)])

    # all_reduce ---------------------------------------------------------------

    def _setup_reduce(self, rnd: Round, arrivals: list[CollectiveArrival]) -> None:
        first = arrivals[0]
        op = first.op
        tensors = False
        for a in arrivals:
            if a.arrays is None:
                self._fallback_reduce(rnd, arrivals, op)
                return
            tensors = tensors or a.torch_mask[0]
        plan = first.plan
        assert plan is not None
        if len(plan.placements) == 1 and plan.total_bytes < PACK_BELOW_BYTES and not tensors:
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
            self.finalize(rnd)
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
        workers = available_cpus()

        def work(replica_id: int) -> None:
            del replica_id
            if next(tickets) >= workers:
                return
            for i in taken:
                if i >= len(pieces):
                    return
                self._reduce_pieces(rnd, arrivals, pieces[i : i + 1], blocked=True)

        rnd.work = work

    def _reduce_one_small(self, rnd: Round, arrivals: list[CollectiveArrival], plan: Plan) -> None:
        """One small NumPy array per replica (a step's loss or metric): the plain chain.

        `plain_sum`: the same adds in the same order as `sum_slice` (bitwise equal),
        without the flat-buffer bookkeeping that pays off only for many or large arrays.
        """
        dtype = plan.dtypes[0]
        inputs = [a.arrays[0] for a in arrivals]  # type: ignore[index]
        out = plain_sum(inputs, np.empty(plan.placements[0][3], dtype=dtype))
        mean = arrivals[0].op is ReduceOp.MEAN
        if mean and dtype.kind not in "fc":
            # An integer mean is a float (NumPy's true_divide), for 0-d a NumPy scalar.
            rnd.results[ONE_NUMPY] = [NUMPY.freeze(NUMPY.divide(out, self._n))]
            return
        if mean:
            np.true_divide(out, self._n, out=out)
        out.flags.writeable = False  # one buffer, shared by every replica
        rnd.results[ONE_NUMPY] = [out]

    def _reduce_pieces(
        self,
        rnd: Round,
        arrivals: list[CollectiveArrival],
        pieces: Sequence[tuple[int, int, int]],
        blocked: bool = False,
    ) -> None:
        reduce_pieces(
            rnd.plan,
            rnd.outputs,
            [a.arrays for a in arrivals],  # type: ignore[misc]
            [a.packs for a in arrivals],
            arrivals[0].op is ReduceOp.MEAN,
            pieces,
            blocked,
        )

    def finalize(self, rnd: Round) -> None:
        """Build the shared results (views of the outputs), once per library pattern."""
        if rnd.plan is None:
            return
        plan = rnd.plan
        arrivals: list[CollectiveArrival] = rnd.arrivals
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

    def _result_key(self, rnd: Round, replica_id: int) -> Any:
        if rnd.kind == "broadcast":
            arrival = rnd.arrivals[replica_id]
            assert arrival is not None
            if not arrival.values:
                root = rnd.arrivals[0].extra
                return rnd.arrivals[root].torch_mask
            return arrival.torch_mask
        return rnd.arrivals[replica_id].torch_mask

    def _fallback_reduce(
        self, rnd: Round, arrivals: list[CollectiveArrival], op: ReduceOp | None
    ) -> None:
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

    # ------------------------------------------------------------------ buffers

    def _output(self, dtype: np.dtype, size: int) -> np.ndarray:
        """A flat output buffer; large ones are recycled once no result views them."""
        if size * dtype.itemsize < POOL_MIN_BYTES:
            return np.empty(size, dtype=dtype)
        return self._pool.take(dtype, size)
