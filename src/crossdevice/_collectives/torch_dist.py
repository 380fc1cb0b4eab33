"""Collectives across worker processes on `torch.distributed` (Gloo on host, NCCL on GPU).

`ProcessGroupCommunicator` is the cross-worker half of `MultiWorkerMirroredStrategy`.
The strategy combines it with the in-process collectives in three phases:

    # local reduce: each worker sums its own replicas' gradients, packed into flat
    #   buffers (one per dtype, about bytes_per_pack each)
    local_sums = [pack(sum_n(replica_grads)) for each pack]
    # cross-worker all-reduce: one numbered collective over all packs
    totals = communicator.all_reduce(local_sums, "mean", divisor=num_replicas_in_sync,
                                     donate=True)
    # local broadcast: every local replica gets its slice of the result
    per_replica = unpack(totals)

MEAN is SUM followed by a division by `divisor`, which the caller chooses because only
it knows the global replica count (workers x local replicas); without a divisor MEAN
divides by the number of workers. `batch_all_reduce(values, op, bytes_per_pack=...)`
does the packing itself (by kind, device and dtype) for callers that have not packed.
The other pieces of the strategy map the same way:

* `gather(value, axis)`: concatenate the local replicas in replica order, then
  `all_gather(local, axis)`; ranks come in order, so the result is in global replica
  order (replica id = rank x local replicas + local index), whatever the partial sizes.
* variables start from the chief's values: `broadcast(initial_value, root=0)`.
* `barrier()` where TF needs one (e.g. before checkpoints).

Every public method is one *numbered collective*: the communicator counts them (1, 2, ...)
and every worker must call the same collectives in the same order with matching values,
as with any collective library. Each worker publishes how far it got ("rank r reached
collective n") in the c10d store (`_ArrivalBoard`). When a collective fails or outlives
`CommunicationOptions.timeout_seconds`, the worker reads those marks and raises
`CollectiveTimeoutError` naming the collective, its number and the ranks that never
arrived. A failed communicator then drops its process groups and refuses further
collectives: every worker must build a new one (TF's collectives poison the context too).

Only this module imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import numpy as np

try:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore, TCPStore
except ImportError:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "multi-worker collectives need PyTorch, which is not installed; install it with "
        "`pip install torch==2.13.0` (CPU build) then `pip install crossdevice[torch]`"
    ) from None

from crossdevice._arrays import NUMPY, backend_for, is_torch
from crossdevice._core.cluster import Cluster, resolve_cluster
from crossdevice._core.errors import CollectiveTimeoutError
from crossdevice._core.options import CommunicationImplementation, CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op

#: Process groups of failed communicators. Dropping the last reference to a Gloo group
#: with pending work blocks (measured: until the work's own timeout) and holds the GIL,
#: so they are unregistered from torch.distributed but freed only at exit.
_FAILED_GROUPS: list[Any] = []

__all__ = [
    "DEFAULT_INIT_TIMEOUT_SECONDS",
    "DEFAULT_PROCESS_GROUP_TIMEOUT_SECONDS",
    "ProcessGroupCommunicator",
    "group_by_size",
]

#: How long constructing a communicator waits for every worker to join the rendezvous.
#: Workers of a job start minutes apart on busy clusters; TF waits indefinitely, torch
#: 30 minutes; we bound it and let the caller raise it.
DEFAULT_INIT_TIMEOUT_SECONDS: Final = 300.0

#: The process groups' own timeout (torch's default) when `timeout_seconds` is None: a
#: backstop, so even a communicator without a timeout cannot wait forever.
DEFAULT_PROCESS_GROUP_TIMEOUT_SECONDS: Final = 1800.0

#: With `timeout_seconds` set, the process groups time out this much later: our own wait
#: fires first and names the missing ranks; Gloo's timeout then clears its pending work.
#: Small, because a Gloo group cannot be freed while work is pending (its destructor joins
#: its worker threads, holding the GIL): a failed group is kept until then.
_BACKSTOP_SLACK_SECONDS: Final = 1.0

#: Bound on each store read while finding out which ranks did not arrive.
_DIAGNOSIS_STORE_TIMEOUT_SECONDS: Final = 2.0

#: How often a worker publishes its collective count. Publishing before every collective
#: cost 30 us a call on this 2-core host (a 4 KiB all_reduce: 15 us alone, 46 us after a
#: store `set`, which wakes the store's server thread), 4% of a 1 MiB all_reduce; a
#: publisher thread makes the per-collective cost one integer increment. Marks are then
#: up to this stale, so a failing worker waits `_GRACE_SECONDS` before reading them.
_PUBLISH_INTERVAL_SECONDS: Final = 0.05
_GRACE_SECONDS: Final = 3 * _PUBLISH_INTERVAL_SECONDS

#: Dtypes Gloo reduces and moves natively (measured: int16/uint16/uint32 raise "Invalid
#: scalar type"). Complex values travel as pairs of reals.
_NATIVE_DTYPES: Final = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)
#: Dtypes sent widened; a sum wraps modulo 2**bits in either width, so narrowing the
#: wide sum gives bit for bit the narrow sum.
_WIDENED_DTYPES: Final = {
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
}
#: Dtypes sent as a same-size signed view (two's complement sums are the same bits).
_VIEWED_DTYPES: Final = {torch.uint64: torch.int64}
#: Dtype codes for the metadata exchanged before all_gather and broadcast.
_DTYPE_CODES: Final = (
    *sorted(_NATIVE_DTYPES, key=str),
    *sorted(_WIDENED_DTYPES, key=str),
    *_VIEWED_DTYPES,
)
#: Metadata vector: [ndim (-1: no value), dtype code, axis or root, on CUDA, shape...].
_MAX_NDIM: Final = 64
_META_LEN: Final = 4 + _MAX_NDIM


def group_by_size(nbytes: Sequence[int], bytes_per_pack: int) -> list[list[int]]:
    """Split value indices into packs of about `bytes_per_pack` bytes, in order.

    TF's `cross_device_utils.group_by_size`: a new pack starts once the current one holds
    more than `bytes_per_pack` bytes, so every pack but the last has at least that many
    and a value is never split. `bytes_per_pack=0` puts everything in one pack.

    Example:
        >>> group_by_size([4, 4, 4, 4, 4], 6)
        [[0, 1], [2, 3], [4]]
    """
    if bytes_per_pack < 0:
        raise ValueError(f"Argument bytes_per_pack must be >=0, Received {bytes_per_pack}.")
    if bytes_per_pack == 0:
        return [list(range(len(nbytes)))] if nbytes else []
    packs: list[list[int]] = []
    last_size = 0
    for index, size in enumerate(nbytes):
        if not packs or last_size > bytes_per_pack:
            packs.append([])
            last_size = 0
        packs[-1].append(index)
        last_size += size
    return packs


@dataclasses.dataclass
class _Wire:
    """A value ready for a process group: a contiguous tensor of a dtype Gloo/NCCL take."""

    tensor: torch.Tensor  # what travels
    dtype: torch.dtype  # the value's own dtype
    kind: str  # "numpy" or "torch": what the caller gets back
    device: torch.device  # where the caller's value lives

    def result(self, tensor: torch.Tensor) -> Any:
        """`tensor` (wire dtype, wire device) as a value of the caller's kind and dtype."""
        if tensor.dtype != self.dtype:
            if self.dtype in _VIEWED_DTYPES:
                tensor = tensor.view(self.dtype)
            else:
                tensor = tensor.to(self.dtype)
        if tensor.device != self.device:
            tensor = tensor.to(self.device)
        return tensor.numpy() if self.kind == "numpy" else tensor


@dataclasses.dataclass
class _Call:
    """One numbered collective in flight."""

    name: str
    seq: int
    timeout: float | None
    started: float

    @property
    def label(self) -> str:
        return f"{self.name} #{self.seq}"

    def remaining(self) -> float | None:
        if self.timeout is None:
            return None
        return max(0.001, self.started + self.timeout - time.monotonic())


class ProcessGroupCommunicator:
    """Collectives among the workers of a cluster, on `torch.distributed`.

    It starts the default process group from `cluster` (rendezvous at
    `tcp://master_addr:master_port`, or torchrun's `env://`), or joins the one that
    already exists, and creates its own groups: Gloo for host values (NumPy arrays,
    torch CPU tensors, and all metadata) and, when CUDA and NCCL are available and
    `implementation` is not RING, NCCL for CUDA tensors. Own groups keep two
    communicators (two strategies) from ever mixing their collectives.

    Values may be NumPy arrays (or Python numbers) and torch tensors; each method returns
    the kind it was given. Inputs are never modified unless donated.

    Args:
        cluster: this worker's place in the cluster; None reads `TF_CONFIG` or torchrun's
            variables (`resolve_cluster`). Ignored, apart from a consistency check, when
            `torch.distributed` is already initialised.
        options: default `CommunicationOptions`; its `timeout_seconds` bounds each
            collective and `implementation=RING` keeps CUDA values on Gloo.
        init_timeout_seconds: how long to wait for every worker at the rendezvous.

    Raises:
        ValueError: no cluster described and no process group to join, or a cluster that
            disagrees with the existing process group.

    Example (in each of two worker processes, rank given by the launcher):
        >>> comm = ProcessGroupCommunicator()  # doctest: +SKIP
        >>> comm.all_reduce([np.ones(3)], "sum")  # doctest: +SKIP
        [array([2., 2., 2.])]
    """

    def __init__(
        self,
        cluster: Cluster | None = None,
        *,
        options: CommunicationOptions | None = None,
        init_timeout_seconds: float = DEFAULT_INIT_TIMEOUT_SECONDS,
    ) -> None:
        self._options = CommunicationOptions().merge(options)
        self._lock = threading.Lock()
        self._seq = 0
        self._broken: str | None = None
        self._closed = False
        self._owns_default_group = False
        if dist.is_initialized():
            self._join_default_group(cluster)
        else:
            cluster = self._start_default_group(cluster, init_timeout_seconds)
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self._cluster = cluster
        self._host_group: Any = None
        self._cuda_group: Any = None
        try:
            self._create_groups()
        except BaseException:
            self._destroy_groups()
            if self._owns_default_group:
                dist.destroy_process_group()
            raise

    def _create_groups(self) -> None:
        timeout = self._options.timeout_seconds
        group_timeout = datetime.timedelta(
            seconds=DEFAULT_PROCESS_GROUP_TIMEOUT_SECONDS
            if timeout is None
            else timeout + _BACKSTOP_SLACK_SECONDS
        )
        # Every worker creates the same groups in the same order (new_group's contract).
        self._host_group = dist.new_group(backend="gloo", timeout=group_timeout)
        if (
            torch.cuda.is_available()
            and dist.is_nccl_available()
            and self._options.implementation != CommunicationImplementation.RING
        ):
            self._cuda_group = dist.new_group(backend="nccl", timeout=group_timeout)
        self._arrivals = _ArrivalBoard(
            self._arrival_store(self._host_group.group_name), self._rank, self._world_size
        )

    # -- construction ------------------------------------------------------------------

    @staticmethod
    def _join_default_group(cluster: Cluster | None) -> None:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if cluster is not None and (cluster.rank, cluster.world_size) != (rank, world_size):
            raise ValueError(
                f"the cluster makes this worker rank {cluster.rank} of {cluster.world_size}, "
                f"but the torch.distributed process group that already exists has it as rank "
                f"{rank} of {world_size}; pass a matching cluster, or none to join the group"
            )

    def _start_default_group(self, cluster: Cluster | None, init_timeout: float) -> Cluster:
        if cluster is None:
            cluster = resolve_cluster()
        if cluster is None:
            raise ValueError(
                "no cluster to join: TF_CONFIG describes no cluster, torchrun's RANK/"
                "WORLD_SIZE/MASTER_ADDR/MASTER_PORT are unset and torch.distributed is not "
                "initialised; launch with `torchrun`, set TF_CONFIG, or pass a Cluster"
            )
        cuda = torch.cuda.is_available() and dist.is_nccl_available()
        # Under torchrun the agent already serves the store at MASTER_PORT; env:// joins it
        # (tcp:// would make rank 0 try to listen on that port too).
        init_method = "env://" if cluster.source == "torchrun" else cluster.init_method
        dist.init_process_group(
            backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
            init_method=init_method,
            rank=cluster.rank,
            world_size=cluster.world_size,
            timeout=datetime.timedelta(seconds=init_timeout),
        )
        self._owns_default_group = True
        return cluster

    @staticmethod
    def _arrival_store(namespace: str) -> Any:
        """A store for arrival marks, with its own connection and a short read timeout."""
        # torch keeps no public handle on the default group's store; this private getter
        # has existed since torch 1.x.
        store = dist.distributed_c10d._get_default_store()
        base = store
        while isinstance(base, PrefixStore):
            base = base.underlying_store
        if isinstance(base, TCPStore):
            # A connection of our own: its timeout bounds our reads without changing the
            # default store's, and a dead server fails our reads at once.
            store = TCPStore(
                base.host,
                base.port,
                is_master=False,
                timeout=datetime.timedelta(seconds=_DIAGNOSIS_STORE_TIMEOUT_SECONDS),
            )
        return PrefixStore(f"crossdevice/{namespace}/arrivals/", store)

    # -- properties ----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's rank, 0 .. world_size - 1."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return self._world_size

    @property
    def cluster(self) -> Cluster | None:
        """The cluster this communicator started from; None if it joined a group without one."""
        return self._cluster

    @property
    def options(self) -> CommunicationOptions:
        """The default `CommunicationOptions` of every collective."""
        return self._options

    @property
    def sequence_number(self) -> int:
        """Number of collectives started so far (the next one gets this number + 1)."""
        return self._seq

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    # -- collectives ---------------------------------------------------------------------

    def all_reduce(
        self,
        buffers: Sequence[Any],
        reduce_op: ReduceOp | str = ReduceOp.SUM,
        *,
        divisor: float | None = None,
        donate: bool = False,
        options: CommunicationOptions | None = None,
    ) -> list[Any]:
        """Reduce each buffer element-wise across workers; every worker gets the result.

        One numbered collective, however many buffers (they travel concurrently).

        Args:
            buffers: arrays (typically flat packs), the same shapes, dtypes and kinds of
                device (host or CUDA) in the same order on every worker; nothing checks
                this, to keep the call cheap: a mismatch fails or times out.
            reduce_op: `SUM` or `MEAN` (or `"sum"`/`"mean"`).
            divisor: for MEAN, what the sum is divided by; default the number of workers.
                `MultiWorkerMirroredStrategy` passes the global replica count because each
                worker contributes the sum of its local replicas.
            donate: the caller will not use `buffers` again, so they may be reduced in
                place instead of copied first (the results may then be the inputs).
            options: per-call options merged onto the communicator's; a `timeout_seconds`
                longer than the communicator's is cut to it (the process groups' own
                timeout is fixed at construction).

        Returns:
            One array per buffer, of the buffer's kind, dtype (MEAN of integers gives
            floating point, as the backends divide) and device.

        Raises:
            CollectiveTimeoutError: a worker did not arrive within `timeout_seconds`, or
                was lost before arriving.
            RuntimeError: the collective failed after every worker arrived.
            TypeError: a dtype no process group can carry.
        """
        count = self._mean_count(as_reduce_op(reduce_op), divisor)
        if _is_single_array(buffers):
            raise TypeError(
                "all_reduce takes a list of buffers, got a single array; wrap it: "
                "all_reduce([x], ...)"
            )
        wires = [self._to_wire(b, copy=not donate) for b in buffers]
        with self._collective("all_reduce", options) as call:
            self._run(
                call,
                lambda: [
                    dist.all_reduce(w.tensor, group=self._group_for(w.tensor), async_op=True)
                    for w in wires
                    if w.tensor.numel()
                ],
            )
        results = [w.result(w.tensor) for w in wires]
        if count is not None:
            results = [_divide(r, count) for r in results]
        return results

    def batch_all_reduce(
        self,
        values: Sequence[Any],
        reduce_op: ReduceOp | str = ReduceOp.SUM,
        *,
        bytes_per_pack: int | None = None,
        divisor: float | None = None,
        options: CommunicationOptions | None = None,
    ) -> list[Any]:
        """All-reduce many arrays in few flat packs: grouped by kind, device and dtype.

        Values of one group are packed in order into flat buffers of about
        `bytes_per_pack` bytes (`group_by_size`), all packs are reduced in one numbered
        collective, and the results are unpacked to the values' shapes.

        Args:
            values: arrays of any shapes and dtypes, the same on every worker.
            reduce_op: `SUM` or `MEAN`.
            bytes_per_pack: pack size; None takes the options', 0 one pack per group.
            divisor: for MEAN, what the sums are divided by (see `all_reduce`).
            options: per-call options merged onto the communicator's.

        Returns:
            The reduced values, in the order and of the kinds of `values`.
        """
        count = self._mean_count(as_reduce_op(reduce_op), divisor)
        merged = self._options.merge(options)
        pack_bytes = merged.bytes_per_pack if bytes_per_pack is None else bytes_per_pack
        wires = [self._to_wire(v, copy=False) for v in values]
        groups: dict[tuple[str, torch.device, torch.dtype], list[int]] = {}
        for index, w in enumerate(wires):
            groups.setdefault((w.kind, w.tensor.device, w.tensor.dtype), []).append(index)
        packs: list[list[int]] = []
        for members in groups.values():
            sizes = [wires[i].tensor.numel() * wires[i].tensor.element_size() for i in members]
            packs.extend([members[j] for j in pack] for pack in group_by_size(sizes, pack_bytes))
        if not packs:
            return []
        # Packing copies, so the packs are ours to reduce in place.
        flats = [torch.cat([wires[i].tensor.reshape(-1) for i in pack]) for pack in packs]
        flats = self.all_reduce(flats, ReduceOp.SUM, donate=True, options=options)
        results: list[Any] = [None] * len(wires)
        for pack, flat in zip(packs, flats, strict=True):
            exact = flat.dtype == wires[pack[0]].dtype
            if count is not None and exact and (flat.is_floating_point() or flat.is_complex()):
                flat.div_(count)  # one division per pack instead of per value
                exact = False
            pieces = torch.split(flat, [wires[i].tensor.numel() for i in pack])
            for i, piece in zip(pack, pieces, strict=True):
                result = wires[i].result(piece.view(wires[i].tensor.shape))
                # Integer MEAN: divide in the value's own backend, as all_reduce does.
                results[i] = _divide(result, count) if count is not None and exact else result
        return results

    def all_gather(
        self, value: Any, axis: int = 0, *, options: CommunicationOptions | None = None
    ) -> Any:
        """Concatenate every worker's `value` along `axis`, in rank order.

        The sizes along `axis` may differ between workers (TF's partial batches): shapes
        are exchanged first, values padded to the largest, gathered, and unpadded.

        Args:
            value: this worker's array.
            axis: the concatenation axis (negative counts from the end).
            options: per-call options merged onto the communicator's.

        Returns:
            The concatenation, of `value`'s kind.

        Raises:
            ValueError: on every worker alike, when ranks, dtypes or sizes on other axes
                differ, or `axis` is out of range; the message names the ranks and shapes.
        """
        if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
            raise TypeError(f"axis must be an int, got {axis!r}")
        wire = self._to_wire(value, copy=False)
        with self._collective("all_gather", options) as call:
            metas = self._exchange_meta(call, wire, int(axis))
            axis = _check_gather(call, metas, int(axis))
            sizes = [m.shape[axis] for m in metas]
            largest = max(sizes)
            device = self._common_device(metas)
            padded = wire.tensor.to(device)
            if wire.tensor.shape[axis] != largest:
                shape = list(wire.tensor.shape)
                shape[axis] = largest
                padded = torch.zeros(shape, dtype=wire.tensor.dtype, device=device)
                padded.narrow(axis, 0, sizes[self._rank]).copy_(wire.tensor)
            outs = [torch.empty_like(padded) for _ in range(self._world_size)]
            self._run(
                call,
                lambda: [
                    dist.all_gather(outs, padded, group=self._group_for(padded), async_op=True)
                ],
            )
        pieces = [out.narrow(axis, 0, size) for out, size in zip(outs, sizes, strict=True)]
        return wire.result(torch.cat(pieces, dim=axis))

    def broadcast(
        self, value: Any, root: int = 0, *, options: CommunicationOptions | None = None
    ) -> Any:
        """Every worker gets a copy of worker `root`'s `value`.

        Args:
            value: the array to send on `root`; on the others an array of the same shape
                and dtype (its data is ignored) or None (the result is then a NumPy array).
            root: the rank that sends.
            options: per-call options merged onto the communicator's.

        Returns:
            A new array equal to root's value, of this worker's kind.

        Raises:
            ValueError: on every worker alike, when the workers disagree on `root`, root
                passes None, or a shape or dtype differs from root's.
        """
        if isinstance(root, bool) or not isinstance(root, int | np.integer):
            raise TypeError(f"root must be an int rank, got {root!r}")
        root = int(root)
        wire = None if value is None else self._to_wire(value, copy=False)
        with self._collective("broadcast", options) as call:
            metas = self._exchange_meta(call, wire, root)
            _check_broadcast(call, metas, root, self._world_size)
            dtype = _DTYPE_CODES[metas[root].dtype]
            if wire is None:
                wire = _Wire(torch.empty(0), dtype, "numpy", torch.device("cpu"))
            device = self._common_device(metas)
            if self._rank == root:
                buffer = wire.tensor.to(device, copy=True)
            else:
                buffer = torch.empty(metas[root].shape, dtype=_wire_dtype(dtype), device=device)
            self._run(
                call,
                lambda: [
                    dist.broadcast(buffer, src=root, group=self._group_for(buffer), async_op=True)
                ],
            )
        return wire.result(buffer)

    def barrier(self, *, options: CommunicationOptions | None = None) -> None:
        """Wait until every worker reaches this barrier (a numbered collective)."""
        with self._collective("barrier", options) as call:
            self._run(call, lambda: [dist.barrier(group=self._host_group, async_op=True)])

    def _mean_count(self, op: ReduceOp, divisor: float | None) -> float | None:
        """What a reduction divides by: None for SUM, `divisor` or the worker count for MEAN."""
        if divisor is not None:
            if op is not ReduceOp.MEAN:
                raise ValueError(
                    f"divisor applies to ReduceOp.MEAN only, got divisor={divisor!r} with {op}"
                    "; pass reduce_op='mean' or drop the divisor"
                )
            if isinstance(divisor, bool) or not isinstance(divisor, int | float) or divisor <= 0:
                raise ValueError(f"divisor must be a positive number, got {divisor!r}")
            return divisor
        return self._world_size if op is ReduceOp.MEAN else None

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the communicator's process groups (and the default one if it made it).

        Idempotent. Every worker should close; collectives afterwards raise RuntimeError.
        """
        if self._closed:
            return
        self._closed = True
        self._arrivals.stop()
        self._destroy_groups()
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> ProcessGroupCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "open"
        return (
            f"ProcessGroupCommunicator(rank={self._rank}, world_size={self._world_size}, "
            f"collectives={self._seq}, {state})"
        )

    # -- machinery -----------------------------------------------------------------------

    def _common_device(self, metas: Sequence[_Meta]) -> torch.device:
        """Where a gather or broadcast travels: CUDA (NCCL) if any worker's value is there.

        Decided from the exchanged metadata so that every worker picks the same group,
        even when some pass host values or None.
        """
        if self._cuda_group is not None and any(m.cuda for m in metas):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _group_for(self, tensor: torch.Tensor) -> Any:
        return self._cuda_group if tensor.is_cuda else self._host_group

    def _to_wire(self, value: Any, *, copy: bool) -> _Wire:
        """`value` as a contiguous tensor Gloo/NCCL can carry (a fresh one when `copy`)."""
        if is_torch(value):
            kind = "torch"
            tensor = value.detach()
            if copy or not tensor.is_contiguous():
                tensor = tensor.clone(memory_format=torch.contiguous_format)
        else:
            kind = "numpy"
            array = NUMPY.asarray(value)
            writable_c = array.flags.c_contiguous and array.flags.writeable
            if copy or not writable_c:
                array = np.array(array, order="C", copy=True)
            try:
                tensor = torch.from_numpy(array)
            except TypeError:
                raise TypeError(
                    f"cannot communicate a NumPy array of dtype {array.dtype}; expected a "
                    f"numeric or bool dtype torch supports (got {value!r:.80})"
                ) from None
        dtype, device = tensor.dtype, tensor.device
        wire_dtype = _wire_dtype(dtype)
        if tensor.is_cuda and self._cuda_group is None:
            tensor = tensor.cpu()  # no NCCL: CUDA values travel through Gloo on the host
        if wire_dtype != dtype:
            tensor = tensor.view(wire_dtype) if dtype in _VIEWED_DTYPES else tensor.to(wire_dtype)
        return _Wire(tensor, dtype, kind, device)

    @contextlib.contextmanager
    def _collective(self, name: str, options: CommunicationOptions | None) -> Iterator[_Call]:
        """Number a collective, publish this worker's arrival at it, hold it exclusively."""
        if self._closed:
            raise RuntimeError(
                f"{name}: this ProcessGroupCommunicator is closed; create a new one (on every "
                "worker)"
            )
        if self._broken is not None:
            raise RuntimeError(
                f"{name}: this ProcessGroupCommunicator failed earlier ({self._broken}) and "
                "its process groups are gone; create a new one on every worker"
            )
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"{name}: another thread is running a collective on this communicator; "
                "collectives must be issued one at a time, in the same order on every worker"
            )
        try:
            self._seq += 1
            self._arrivals.reached = self._seq  # published by the board's thread
            options = self._options if options is None else self._options.merge(options)
            timeout = options.timeout_seconds
            limit = self._options.timeout_seconds
            if limit is not None and (timeout is None or timeout > limit):
                # The groups' own timeout (limit + slack) was fixed at construction.
                timeout = limit
            yield _Call(name, self._seq, timeout, time.monotonic())
        finally:
            self._lock.release()

    def _run(self, call: _Call, launch: Callable[[], list[Any]]) -> None:
        """Launch the process-group work of `call` and wait for it within the timeout."""
        try:
            works = launch()
            for work in works:
                remaining = call.remaining()
                if remaining is None:
                    work.wait()
                else:
                    work.wait(datetime.timedelta(seconds=remaining))
        except Exception as err:
            self._fail(call, err)

    def _exchange_meta(self, call: _Call, wire: _Wire | None, arg: int) -> list[_Meta]:
        """All-gather every worker's shape, dtype and `arg` (axis or root) on the host."""
        meta = torch.zeros(_META_LEN, dtype=torch.int64)
        if wire is None:
            meta[0] = -1
        else:
            shape = wire.tensor.shape  # at most _MAX_NDIM: NumPy's own limit
            meta[0] = len(shape)
            meta[1] = _DTYPE_CODES.index(wire.dtype)
            meta[3] = int(wire.tensor.is_cuda)
            meta[4 : 4 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
        meta[2] = arg
        outs = [torch.empty_like(meta) for _ in range(self._world_size)]
        self._run(
            call, lambda: [dist.all_gather(outs, meta, group=self._host_group, async_op=True)]
        )
        return [_Meta.decode(out) for out in outs]

    def _fail(self, call: _Call, err: Exception) -> None:
        """Turn a failed collective into an error naming the ranks that did not arrive."""
        elapsed = time.monotonic() - call.started
        timed_out = call.timeout is not None and elapsed >= call.timeout - 0.01
        missing, diagnosis = self._arrivals.missing(call.seq)
        what = f"timed out after {call.timeout:g} s" if timed_out else f"failed ({err})"
        where = f"on rank {self._rank} of {self._world_size}"
        self._broken = f"{call.label} {what}"
        self._arrivals.stop()
        self._destroy_groups(keep_alive=True)
        if missing:
            raise CollectiveTimeoutError(
                f"{call.label} {what} {where}: rank(s) {missing} did not arrive at it. "
                f"Every worker must run the same collectives in the same order; check the "
                f"missing workers' logs, and raise CommunicationOptions.timeout_seconds if "
                f"they are only slow. This communicator is unusable now: create a new one "
                f"on every worker."
            ) from err
        if timed_out:
            raise CollectiveTimeoutError(
                f"{call.label} {what} {where}, {diagnosis}; a peer may be stuck inside it or "
                f"called a different collective. Raise CommunicationOptions.timeout_seconds "
                f"if the workers are only slow; create a new communicator on every worker."
            ) from err
        raise RuntimeError(
            f"{call.label} {what} {where}, {diagnosis}; a peer probably died or called a "
            f"different collective: check the other workers' logs, then create a new "
            f"communicator on every worker."
        ) from err

    def _destroy_groups(self, *, keep_alive: bool = False) -> None:
        """Unregister our groups; `keep_alive` defers freeing them (see `_FAILED_GROUPS`)."""
        for attr in ("_host_group", "_cuda_group"):
            group = getattr(self, attr, None)
            if group is not None:
                setattr(self, attr, None)
                if keep_alive:
                    _FAILED_GROUPS.append(group)
                with contextlib.suppress(Exception):  # best effort: it may be gone already
                    dist.destroy_process_group(group)


class _ArrivalBoard:
    """How far each worker got, in the c10d store: key `r<rank>` holds its collective count.

    A daemon thread publishes this worker's count (`reached`) every
    `_PUBLISH_INTERVAL_SECONDS` when it changed; it keeps running while the main thread
    is stalled in user code, so a stalled worker shows exactly where it stopped.
    """

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.reached = 0
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._stop = threading.Event()
        self._published = 0
        self._thread = threading.Thread(
            target=self._publish_loop, name=f"crossdevice-arrivals-r{rank}", daemon=True
        )
        self._thread.start()

    def _publish(self) -> None:
        reached = self.reached
        if reached != self._published:
            self._store.set(f"r{self._rank}", str(reached))
            self._published = reached

    def _publish_loop(self) -> None:
        while not self._stop.wait(_PUBLISH_INTERVAL_SECONDS):
            try:
                self._publish()
            except Exception:  # the store is gone: a failing collective will report it
                return

    def stop(self) -> None:
        """Stop publishing (waits for the thread at most one interval)."""
        self._stop.set()
        self._thread.join(timeout=2 * _PUBLISH_INTERVAL_SECONDS + 1.0)

    def _below(self, seq: int) -> list[int]:
        return [
            rank
            for rank in range(self._world_size)
            if not self._store.check([f"r{rank}"]) or int(self._store.get(f"r{rank}")) < seq
        ]

    def missing(self, seq: int) -> tuple[list[int], str]:
        """Ranks whose count is below `seq`, and a phrase saying how we know."""
        try:
            self._publish()
            # Read at once (the store's host may be about to exit after its own failure),
            # then again once peers' marks, up to one interval stale, have caught up.
            missing = self._below(seq)
        except Exception as err:
            return [], (
                f"and the ranks' arrival marks could not be read from the c10d store "
                f"({type(err).__name__}: {err}); the process serving it (rank 0, or "
                f"torchrun's agent) has probably died"
            )
        time.sleep(_GRACE_SECONDS)
        with contextlib.suppress(Exception):  # keep the first reading if the store is gone
            missing = self._below(seq)
        return missing, "although every rank arrived at it"


@dataclasses.dataclass(frozen=True)
class _Meta:
    """One worker's metadata for all_gather/broadcast."""

    ndim: int  # -1: no value
    dtype: int
    arg: int
    cuda: bool  # the value travels on CUDA (NCCL)
    shape: tuple[int, ...]

    @classmethod
    def decode(cls, meta: torch.Tensor) -> _Meta:
        values = [int(v) for v in meta.tolist()]
        ndim = values[0]
        shape = tuple(values[4 : 4 + max(ndim, 0)])
        return cls(ndim, values[1], values[2], bool(values[3]), shape)

    @property
    def key(self) -> tuple[int, int, tuple[int, ...]]:
        return self.ndim, self.dtype, self.shape

    def describe(self) -> str:
        if self.ndim < 0:
            return "None"
        return f"{self.shape} {str(_DTYPE_CODES[self.dtype]).removeprefix('torch.')}"


def _is_single_array(value: object) -> bool:
    return is_torch(value) or isinstance(value, np.ndarray)


def _describe(metas: Sequence[_Meta]) -> str:
    return ", ".join(f"rank {rank}: {meta.describe()}" for rank, meta in enumerate(metas))


def _check_gather(call: _Call, metas: Sequence[_Meta], axis: int) -> int:
    """The normalised gather axis; ValueError (alike on every worker) for bad inputs."""
    ndim = metas[0].ndim
    axes = sorted({m.arg for m in metas})
    problem = None
    if len({(m.ndim, m.dtype) for m in metas}) > 1:
        problem = "arrays of different ranks or dtypes"
    elif len(axes) > 1:
        problem = f"different axes {axes}"
    elif not -ndim <= axis < ndim:
        problem = f"axis {axis}, out of range for arrays of rank {ndim}"
    else:
        axis %= ndim
        if len({m.shape[:axis] + m.shape[axis + 1 :] for m in metas}) > 1:
            problem = f"shapes that differ on an axis other than {axis}"
    if problem is not None:
        raise ValueError(
            f"{call.label}: every worker must pass an array of the same rank and dtype whose "
            f"shape differs only along the gather axis, with the same axis; received "
            f"{problem} ({_describe(metas)}); reshape or pad the values so that only the "
            f"gather axis differs"
        )
    return axis


def _check_broadcast(call: _Call, metas: Sequence[_Meta], root: int, world_size: int) -> None:
    """ValueError (alike on every worker) when the workers' broadcast calls disagree."""
    roots = sorted({m.arg for m in metas})
    problem = None
    if len(roots) > 1:
        problem = f"different roots {roots}"
    elif not 0 <= root < world_size:
        problem = f"root {root}, out of range for {world_size} workers"
    elif metas[root].ndim < 0:
        problem = f"no value on root {root}"
    elif any(m.ndim >= 0 and m.key != metas[root].key for m in metas):
        problem = "values whose shape or dtype differ from root's"
    if problem is not None:
        raise ValueError(
            f"{call.label}: every worker must name the same root, the root must pass a value "
            f"and the others None or an array of the root's shape and dtype; received "
            f"{problem} ({_describe(metas)})"
        )


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in _NATIVE_DTYPES:
        return dtype
    if dtype in _WIDENED_DTYPES:
        return _WIDENED_DTYPES[dtype]
    if dtype in _VIEWED_DTYPES:
        return _VIEWED_DTYPES[dtype]
    supported = sorted(str(d).removeprefix("torch.") for d in _DTYPE_CODES)
    raise TypeError(
        f"cannot communicate values of dtype {str(dtype).removeprefix('torch.')}; expected "
        f"one of {supported}; cast the value first"
    )


def _divide(value: Any, count: float) -> Any:
    """`value / count`, in place for the floating buffers the collective just made."""
    if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.inexact):
        np.true_divide(value, count, out=value)
        return value
    if is_torch(value) and (value.is_floating_point() or value.is_complex()):
        return value.div_(count)
    return backend_for(value).divide(value, count)  # type: ignore[arg-type]
