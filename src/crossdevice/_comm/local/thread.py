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

from collections.abc import Sequence
from typing import Any

import numpy as np

from crossdevice._arrays import backend_for
from crossdevice._arrays.buffer_pool import BufferPool
from crossdevice._comm.local.arrivals import (
    NUMERIC_KINDS,
    ONE_NUMPY,
    CollectiveArrival,
    host_view,
    validate,
)
from crossdevice._comm.local.copies import setup_broadcast, setup_gather
from crossdevice._comm.local.participant import Participant
from crossdevice._comm.local.reduction import Packs, Reduction, arrive, plan_for
from crossdevice._core import tuning
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op
from crossdevice._sync.call import describe_leaves
from crossdevice._sync.rendezvous import Rendezvous
from crossdevice._sync.rounds import Round

__all__ = ["ThreadCommunicator"]


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
        self._pool = BufferPool()
        self._packs = [Packs() for _ in range(num_replicas)]

    @property
    def rendezvous(self) -> Rendezvous:
        """The rendezvous the replicas meet in."""
        return self._rendezvous

    def participant(self, replica_id: int) -> Participant:
        """Replica `replica_id` of this communicator, as a `Communicator` (the protocol)."""
        self._check_replica(replica_id)
        return Participant(self, replica_id)

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
            plan = plan_for(sig)
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
        return arrive(values, op, self._packs[replica_id], self)

    def _prepare_single(self, kind: str, value: Any) -> CollectiveArrival:
        value, arr, from_torch = host_view(value)
        be = backend_for(value)
        if arr is None:
            sig: Any = ((be.shape(value), be.dtype_name(value)),)
            return CollectiveArrival(kind, [value], None, sig, (from_torch,), handler=self)
        return CollectiveArrival(
            kind, [value], [arr], ((arr.shape, arr.dtype),), (from_torch,), handler=self
        )

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

    def complete(self, rnd: Round, replica_id: int) -> None:
        """Run by the last arriver: validate, plan, and compute or hand out the work."""
        del replica_id
        arrivals: list[CollectiveArrival] = rnd.arrivals
        first = arrivals[0]
        rnd.kind = first.kind
        error = validate(rnd, arrivals)
        if error is not None:
            rnd.set_error(ValueError, error)
            return
        if first.kind == "all_reduce":
            reduction = Reduction(arrivals, self._output)
            rnd.plan, rnd.work = reduction, reduction.work
        elif first.kind == "all_gather":
            setup_gather(rnd, arrivals, self._output)
        else:
            setup_broadcast(rnd, arrivals, self._output)

    def finalize(self, rnd: Round) -> None:
        """After a round's shared work: build its shared results."""
        if isinstance(rnd.plan, Reduction):
            rnd.plan.finish()

    def result(self, rnd: Round, replica_id: int) -> list[Any]:
        """Replica `replica_id`'s results of a completed round (shared buffers)."""
        if rnd.kind == "all_reduce":
            reduction: Reduction = rnd.plan
            return reduction.result(rnd.arrivals[replica_id].torch_mask)
        return list(rnd.results[self._result_key(rnd, replica_id)])

    def _result_key(self, rnd: Round, replica_id: int) -> Any:
        if rnd.kind == "broadcast":
            arrival = rnd.arrivals[replica_id]
            assert arrival is not None
            if not arrival.values:
                root = rnd.arrivals[0].extra
                return rnd.arrivals[root].torch_mask
            return arrival.torch_mask
        return rnd.arrivals[replica_id].torch_mask

    # ------------------------------------------------------------------ buffers

    def _output(self, dtype: np.dtype, size: int) -> np.ndarray:
        """A flat output buffer; large ones are recycled once no result views them."""
        if size * dtype.itemsize < tuning.TUNING.pool_min_bytes:
            return np.empty(size, dtype=dtype)
        return self._pool.take(dtype, size)
