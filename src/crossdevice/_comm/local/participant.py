"""`Participant`: one replica's `Communicator`, for communicators whose peers are its threads.

An in-process communicator serves every replica of a strategy at once, so its methods
take the calling replica's id (`ThreadCommunicator.all_reduce(replica_id, ...)`). A
participant binds one replica to it and offers the `Communicator` protocol
(`crossdevice._comm.protocol`), the same calls and options as a worker process's
communicator: a caller (or the contract suite) does not care where the peers live.

An in-process all-reduce completes in the rendezvous round it arrives in, so
`all_reduce_async` returns a collective that is already done (there is nothing to
overlap: the replicas share memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Protocol

from crossdevice._arrays import backend_for
from crossdevice._comm.protocol import BroadcastOptions, Done, GatherOptions, ReduceOptions
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._sync.call import CallSignature
from crossdevice._sync.rendezvous import Rendezvous

__all__ = ["Participant", "ReplicaCommunicator"]

#: A barrier is a merge_call round that merges nothing.
_BARRIER: Final = CallSignature("barrier")


class ReplicaCommunicator(Protocol):
    """An in-process communicator: every replica calls with its own id."""

    @property
    def num_replicas(self) -> int:
        """How many replicas take part."""

    @property
    def rendezvous(self) -> Rendezvous:
        """The rendezvous the replicas meet in."""

    def all_reduce(
        self,
        replica_id: int,
        arrays: Sequence[Any],
        reduce_op: ReduceOp | str,
        timeout: float | None = None,
        structure: Any = None,
    ) -> list[Any]:
        """Replica `replica_id`'s all-reduce."""

    def all_gather(
        self,
        replica_id: int,
        array: Any,
        axis: int = 0,
        timeout: float | None = None,
        structure: Any = None,
    ) -> Any:
        """Replica `replica_id`'s all-gather."""

    def broadcast(
        self, replica_id: int, array: Any, root: int = 0, timeout: float | None = None
    ) -> Any:
        """Replica `replica_id`'s broadcast."""

    def abort(self, exc: BaseException) -> None:
        """Release every waiting replica."""


class Participant:
    """Replica `replica_id` of an in-process communicator, as a `Communicator`.

    Args:
        comm: the communicator (a `ThreadCommunicator`, a `DeviceCommunicator`).
        replica_id: the replica this participant speaks for.

    Example:
        >>> import numpy as np, threading
        >>> from crossdevice._comm.local.thread import ThreadCommunicator
        >>> comm = ThreadCommunicator(2)
        >>> out = [None, None]
        >>> def replica(r):
        ...     out[r] = comm.participant(r).all_reduce([np.full(2, r + 1.0)], "sum")
        >>> threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
        >>> for t in threads:
        ...     t.start()
        >>> for t in threads:
        ...     t.join(10)
        >>> out[1][0]
        array([3., 3.])
    """

    __slots__ = ("_comm", "_id")

    def __init__(self, comm: ReplicaCommunicator, replica_id: int) -> None:
        self._comm = comm
        self._id = replica_id

    @property
    def rank(self) -> int:
        """This replica's id."""
        return self._id

    @property
    def size(self) -> int:
        """How many replicas take part."""
        return self._comm.num_replicas

    def all_reduce(
        self, values: Sequence[Any], options: ReduceOptions | ReduceOp | str = ReduceOp.SUM
    ) -> list[Any]:
        """Reduce each array across the replicas (results shared: NumPy read-only)."""
        opts = ReduceOptions.of(options)
        structure = None if opts.signature is None else opts.signature.structure
        divisor = opts.divide_by(self.size)
        if opts.divisor is None or divisor is None:
            return self._comm.all_reduce(self._id, list(values), opts.op, opts.timeout, structure)
        sums = self._comm.all_reduce(self._id, list(values), ReduceOp.SUM, opts.timeout, structure)
        return [backend_for(s).divide(s, divisor) for s in sums]

    def all_reduce_async(
        self, values: Sequence[Any], options: ReduceOptions | ReduceOp | str = ReduceOp.SUM
    ) -> Done:
        """`all_reduce`, completed at once (see the module doc)."""
        return Done(self.all_reduce(values, options))

    def all_gather(self, value: Any, axis: GatherOptions | int = 0) -> Any:
        """Concatenate every replica's `value` along the axis, in replica order."""
        opts = GatherOptions.of(axis)
        return self._comm.all_gather(self._id, value, opts.axis, opts.timeout)

    def broadcast(self, value: Any, root: BroadcastOptions | int = 0) -> Any:
        """Every replica gets the root replica's `value` (others may pass None)."""
        opts = BroadcastOptions.of(root)
        return self._comm.broadcast(self._id, value, opts.root, opts.timeout)

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every replica reaches this barrier (a round of the rendezvous)."""
        n = self.size
        self._comm.rendezvous.merge_call(self._id, lambda _: [None] * n, None, _BARRIER, timeout)

    def abort(self, error: BaseException) -> None:
        """Release every replica waiting in a collective (`ReplicaAbortedError`)."""
        self._comm.abort(error)

    def __repr__(self) -> str:
        return f"Participant(replica {self._id} of {self._comm!r})"
