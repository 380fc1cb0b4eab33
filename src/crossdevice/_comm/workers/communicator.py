"""Collectives across worker processes on `torch.distributed` (Gloo on host, NCCL on GPU).

`ProcessGroupCommunicator` is the cross-worker half of `MultiWorkerMirroredStrategy`.
The strategy combines it with the in-process collectives in three phases:

    # local reduce: each worker sums its replicas' values into flat packs (per dtype)
    local_sums = [pack(sum_n(replica_grads)) for each pack]
    # cross-worker all-reduce: one numbered collective over all packs
    totals = communicator.all_reduce(local_sums, "mean", divisor=n_replicas, donate=True)
    # local broadcast: every local replica gets its slice of the result
    per_replica = unpack(totals)

MEAN is SUM then a division by `divisor` (the caller knows the global replica count);
`batch_all_reduce` packs by kind, device and dtype itself. The rest of the strategy:

* `gather(value, axis)`: concatenate the local replicas in replica order, then
  `all_gather(local, axis)`; ranks come in order, so the result is in global replica
  order (replica id = rank x local replicas + local index), whatever the partial sizes.
* variables start from the chief's values: `broadcast(initial_value, root=0)`.
* `barrier()` where TF needs one (e.g. before checkpoints).

Every public method is one *numbered collective*, and every worker must call the same
collectives in the same order with matching values. Nothing is taken on trust:

* **Fingerprints** (`fingerprint.py`, `speculation.py`): a fixed-size header says what
  each worker is about to do (number, kind, op, dtypes, bytes, shapes, structure, layout,
  local replica count); any difference raises `CollectiveMismatchError` on every worker
  and Gloo never sees buffers of different sizes (it aborts the process when it does). A
  repeated all-reduce carries it inside its data, in one round trip.
* **Health** (`worker_health.py`): heartbeats, arrival marks and abort marks in the c10d
  store. A waiting worker looks at them every `calls.POLL_SECONDS`: a peer whose step raised
  (`abort`) or whose heartbeat stopped (dead) raises `WorkerFailedError` naming it within
  seconds; a live peer that does not arrive raises `CollectiveTimeoutError` naming the
  missing ranks when `timeout_seconds` (default `DEFAULT_TIMEOUT_SECONDS`) expires.
* A failed communicator refuses further collectives: every worker must build a new one
  (TF's collectives poison the context too).

When every worker runs on one host, a repeated host all-reduce skips Gloo: its data and
fingerprint go through shared memory (`shared_memory.py`).
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:
    import torch
    import torch.distributed as dist
except ImportError:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "multi-worker collectives need PyTorch, which is not installed; install it with "
        "`pip install torch==2.13.0` (CPU build) then `pip install crossdevice[torch]`"
    ) from None

from crossdevice._comm.workers import fingerprint as fp
from crossdevice._comm.workers.health import HealthBoard
from crossdevice._comm.workers.pg_base import (
    _BACKSTOP_SLACK_SECONDS,
    DEFAULT_INIT_TIMEOUT_SECONDS,
    DEFAULT_TIMEOUT_SECONDS,
    MAX_PEER_BYTES,
    CommunicatorBase,
    Signature,
    _numel,
)
from crossdevice._comm.workers.speculation import (
    Filler,
    Layout,
    LazyPacks,
    Predictor,
    RoomPool,
    header_apart,
    host_layout,
    layout_digest,
)
from crossdevice._comm.workers.start import (
    check_joined_group,
    health_store,
    start_cluster_group,
    store_host,
)
from crossdevice._comm.workers.value_checks import check_broadcast, check_gather
from crossdevice._comm.workers.wire import (
    DTYPE_CODES,
    Wire,
    describe_wires,
    divide,
    group_by_size,
    is_single_array,
    mean_count,
    own_all,
    replace_wires,
    wire_dtype,
)
from crossdevice._core.cluster import Cluster, resolve_cluster
from crossdevice._core.options import CommunicationImplementation, CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op

__all__ = [
    "DEFAULT_INIT_TIMEOUT_SECONDS",
    "DEFAULT_TIMEOUT_SECONDS",
    "MAX_PEER_BYTES",
    "ProcessGroupCommunicator",
    "Signature",
    "group_by_size",
]


class ProcessGroupCommunicator(CommunicatorBase):
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
            collective (None: `DEFAULT_TIMEOUT_SECONDS`) and `implementation=RING`
            keeps CUDA values on Gloo.
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
        self._replicas: list[int] | None = None
        self._predictor = Predictor()
        self._rooms = RoomPool()
        if dist.is_initialized():
            check_joined_group(cluster)
        else:
            cluster = self._start_default_group(cluster, init_timeout_seconds)
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self._cluster = cluster
        self._host_group: Any = None
        self._cuda_group: Any = None
        try:
            self._create_groups()
            self._connect_shared()  # every worker on this host: through /dev/shm
        except BaseException:
            self._destroy_groups()
            if self._owns_default_group:
                dist.destroy_process_group()
            raise

    def _create_groups(self) -> None:
        group_timeout = datetime.timedelta(seconds=self.timeout + _BACKSTOP_SLACK_SECONDS)
        # Every worker creates the same groups in the same order (new_group's contract).
        self._host_group = dist.new_group(backend="gloo", timeout=group_timeout)
        if (
            torch.cuda.is_available()
            and dist.is_nccl_available()
            and self._options.implementation != CommunicationImplementation.RING
        ):
            self._cuda_group = dist.new_group(backend="nccl", timeout=group_timeout)
        namespace = self._host_group.group_name
        self._health = HealthBoard(
            lambda: health_store(namespace), self._rank, self._world_size, store_host()
        )

    # -- construction ------------------------------------------------------------------

    def _start_default_group(self, cluster: Cluster | None, init_timeout: float) -> Cluster:
        if cluster is None:
            cluster = resolve_cluster()
        if cluster is None:
            raise ValueError(
                "no cluster to join: TF_CONFIG describes no cluster, torchrun's RANK/"
                "WORLD_SIZE/MASTER_ADDR/MASTER_PORT are unset and torch.distributed is not "
                "initialised; launch with `torchrun`, set TF_CONFIG, or pass a Cluster"
            )
        start_cluster_group(cluster, init_timeout)
        self._owns_default_group = True
        return cluster

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
        signature: Signature | None = None,
        produce: Callable[[], Sequence[Any]] | None = None,
        fill: Callable[..., None] | None = None,
    ) -> list[Any]:
        """Reduce each buffer element-wise across workers; every worker gets the result.

        One numbered collective, however many buffers (they travel concurrently). Its
        fingerprint is compared on every worker before any data moves.

        Args:
            buffers: arrays (typically flat packs), the same shapes, dtypes and kinds of
                device (host or CUDA) in the same order on every worker.
            reduce_op: `SUM` or `MEAN` (or `"sum"`/`"mean"`).
            divisor: for MEAN, what the sum is divided by; default the number of workers.
                `MultiWorkerMirroredStrategy` passes the global replica count because each
                worker contributes the sum of its local replicas.
            donate: the caller will not use `buffers` again, so they may be reduced in
                place instead of copied first (the results may then be the inputs).
            options: per-call options merged onto the communicator's; a `timeout_seconds`
                longer than the communicator's is cut to it (the process groups' own
                timeout is fixed at construction).
            signature: what the caller reduces before packing (op, shapes, structure),
                added to the fingerprint; default the buffers' own.
            produce: makes the buffers to reduce (donated), while the fingerprints travel;
                `buffers` are then only templates of the same kinds, shapes and dtypes.
            fill: `fill(i, start, stop)` writes elements `start:stop` of flat buffer `i`
                (donated `pack_buffer` views), chunk by chunk just before each leaves, or
                all while the fingerprints travel; with `out=` (a flat array of
                `stop - start` elements) it writes there instead (shared memory's slots).

        Returns:
            One array per buffer, of the buffer's kind, dtype (MEAN of integers gives
            floating point, as the backends divide) and device.

        Raises:
            CollectiveMismatchError: on every worker, when the workers' calls differ.
            WorkerFailedError: a peer's step raised, or a peer died.
            CollectiveTimeoutError: a live worker did not arrive within the timeout.
            TypeError: a dtype no process group can carry.
        """
        op = as_reduce_op(reduce_op)
        count = mean_count(op, divisor, self._world_size)
        if is_single_array(buffers):
            raise TypeError(
                "all_reduce takes a list of buffers, got a single array; wrap it: "
                "all_reduce([x], ...)"
            )
        # The copy that keeps inputs unmodified is made while the fingerprints travel.
        wires = [self._to_wire(b, copy=False) for b in buffers]
        if signature is None:
            shapes = tuple((tuple(w.tensor.shape), w.dtype) for w in wires)
            signature = Signature(op.name.lower(), fp.cached_digest(shapes))
        layout = host_layout([w.tensor for w in wires])
        if fill is not None and (not donate or produce is not None):
            raise ValueError(
                f"all_reduce: fill= needs donate=True and no produce=, got donate={donate} "
                f"and produce={produce is not None}; pass donate=True without produce"
            )
        filler = Filler(fill, [w.tensor.numel() for w in wires])

        def fit(predicted: Layout) -> list[torch.Tensor] | None:
            # This worker's buffers when they are what every worker sends, the first in a
            # buffer with room for the inline header (speculation.py): the API's copy of
            # the input is made into it, and a buffer from `pack_buffer` has room already.
            if layout != predicted:
                return None
            if produce is not None:
                replace_wires(wires, [self._to_wire(b, copy=False) for b in produce()])
            live = [w for w in wires if w.tensor.numel()]
            if self._shares(predicted):  # written into shared memory round by round
                return [w.tensor for w in live]
            if header_apart(predicted):
                if not donate and produce is None:
                    own_all(live)
                return [w.tensor for w in live]
            first = live[0]
            room = self._rooms.room_of(first.tensor) if donate or produce is not None else None
            if room is None:
                filler.all()
                room = self._rooms.buffer(first.tensor.dtype, first.tensor.numel())
                room[: first.tensor.numel()].copy_(first.tensor.reshape(-1))
            first.tensor, first.owned = room[: first.tensor.numel()].view(first.tensor.shape), True
            if not donate and produce is None:
                own_all(live[1:])
            return [room, *(w.tensor for w in live[1:])]

        with self._collective("all_reduce", options) as call:
            self._agree(
                call,
                fp.Fingerprint(
                    seq=call.seq,
                    kind="all_reduce",
                    op=signature.op,
                    local_replicas=self._local_count(),
                    buffers=len(wires),
                    nbytes=sum(w.tensor.numel() * w.tensor.element_size() for w in wires),
                    dtypes=fp.cached_digest(tuple(w.tensor.dtype for w in wires)),
                    shapes=signature.shapes,
                    structure=signature.structure,
                    cuda=any(w.tensor.is_cuda for w in wires),
                    layout=layout_digest(layout),
                ),
                lambda: describe_wires(wires),
                (lambda: replace_wires(wires, [self._to_wire(b, copy=False) for b in produce()]))
                if produce is not None
                else filler.all
                if donate
                else functools.partial(own_all, wires),
                fit,
                layout,
                filler.live,
            )
            if not call.speculated:
                self._run(
                    call,
                    lambda: [
                        dist.all_reduce(w.tensor, group=self._group_for(w.tensor), async_op=True)
                        for w in wires
                        if w.tensor.numel()
                    ],
                )
        if call.outputs is not None:
            live = [w for w in wires if w.tensor.numel()]
            for w, out in zip(live, call.outputs, strict=True):
                w.tensor, w.owned = out.view(w.tensor.shape), True
        results = [w.result(w.tensor) for w in wires]
        if count is not None:
            results = [divide(r, count) for r in results]
        return results

    def pack_buffer(self, dtype: np.dtype, numel: int) -> np.ndarray:
        """A recycled flat host buffer to fill and then `all_reduce(..., donate=True)`.

        It has room behind it for the inline fingerprint (`speculation.py`), so reducing
        it copies nothing. Contents undefined.
        """
        return self._rooms.take(dtype, numel)

    def batch_all_reduce(
        self,
        values: Sequence[Any],
        reduce_op: ReduceOp | str = ReduceOp.SUM,
        *,
        bytes_per_pack: int | None = None,
        divisor: float | None = None,
        options: CommunicationOptions | None = None,
        signature: Signature | None = None,
    ) -> list[Any]:
        """All-reduce many arrays in few flat packs: grouped by kind, device and dtype.

        Values of one group are packed in order into flat buffers of about
        `bytes_per_pack` bytes (`group_by_size`), all packs are reduced in one numbered
        collective, and the results are unpacked to the values' shapes. The fingerprint
        covers every value's shape and dtype, not only the packs' sizes.

        Args:
            values: arrays of any shapes and dtypes, the same on every worker.
            reduce_op: `SUM` or `MEAN`.
            bytes_per_pack: pack size; None takes the options', 0 one pack per group.
            divisor: for MEAN, what the sums are divided by (see `all_reduce`).
            options: per-call options merged onto the communicator's.
            signature: see `all_reduce`; default the values' shapes and dtypes.

        Returns:
            The reduced values, in the order and of the kinds of `values`.
        """
        op = as_reduce_op(reduce_op)
        count = mean_count(op, divisor, self._world_size)
        merged = self._options.merge(options)
        pack_bytes = merged.bytes_per_pack if bytes_per_pack is None else bytes_per_pack
        wires = [self._to_wire(v, copy=False) for v in values]
        if signature is None:
            shapes = tuple((w.shape, w.dtype) for w in wires)
            signature = Signature(op.name.lower(), fp.cached_digest(shapes))
        groups: dict[tuple[str, torch.device, torch.dtype], list[int]] = {}
        for index, w in enumerate(wires):
            groups.setdefault((w.kind, w.tensor.device, w.tensor.dtype), []).append(index)
        packs: list[list[int]] = []
        for members in groups.values():
            sizes = [wires[i].tensor.numel() * wires[i].tensor.element_size() for i in members]
            packs.extend([members[j] for j in pack] for pack in group_by_size(sizes, pack_bytes))
        if not packs:
            return []
        # Packs are ours to reduce in place: recycled host buffers with room for the inline
        # fingerprint, filled as they leave (or straight into shared memory's slots).
        lazy = LazyPacks(self._rooms, [[wires[i].tensor.reshape(-1) for i in p] for p in packs])
        flats = self.all_reduce(
            lazy.flats,
            ReduceOp.SUM,
            donate=True,
            options=options,
            signature=signature,
            fill=lazy.fill,
        )
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
                results[i] = divide(result, count) if count is not None and exact else result
        return results

    def all_gather(
        self, value: Any, axis: int = 0, *, options: CommunicationOptions | None = None
    ) -> Any:
        """Concatenate every worker's `value` along `axis`, in rank order.

        The sizes along `axis` may differ between workers (TF's partial batches): shapes
        come with the fingerprints, values are padded to the largest, gathered, and
        unpadded.

        Args:
            value: this worker's array.
            axis: the concatenation axis (negative counts from the end).
            options: per-call options merged onto the communicator's.

        Returns:
            The concatenation, of `value`'s kind.

        Raises:
            ValueError: on every worker alike, when ranks, dtypes or sizes on other axes
                differ, or `axis` is out of range; the message names the ranks and shapes.
            CollectiveMismatchError: a worker runs another collective.
        """
        if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
            raise TypeError(f"axis must be an int, got {axis!r}")
        wire = self._to_wire(value, copy=False)
        with self._collective("all_gather", options) as call:
            prints = self._agree(call, self._value_print(call, "all_gather", wire, int(axis)))
            axis = check_gather(call, prints, int(axis))
            sizes = [p.shape[axis] for p in prints]
            largest = max(sizes)
            self._check_allocation(call, wire.tensor, largest * self._world_size, axis)
            device = self._common_device(prints)
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
            CollectiveMismatchError: a worker runs another collective.
        """
        if isinstance(root, bool) or not isinstance(root, int | np.integer):
            raise TypeError(f"root must be an int rank, got {root!r}")
        root = int(root)
        wire = None if value is None else self._to_wire(value, copy=False)
        with self._collective("broadcast", options) as call:
            prints = self._agree(call, self._value_print(call, "broadcast", wire, root))
            check_broadcast(call, prints, root, self._world_size)
            dtype = DTYPE_CODES[prints[root].dtype_code]
            if wire is None:
                wire = Wire(torch.empty(0), dtype, "numpy", torch.device("cpu"))
                self._check_allocation(call, None, _numel(prints[root].shape), 0, dtype)
            device = self._common_device(prints)
            if self._rank == root:
                buffer = wire.tensor.to(device, copy=True)
            else:
                buffer = torch.empty(prints[root].shape, dtype=wire_dtype(dtype), device=device)
            self._run(
                call,
                lambda: [
                    dist.broadcast(buffer, src=root, group=self._group_for(buffer), async_op=True)
                ],
            )
        return wire.result(buffer)

    def any_has_data(self, has_data: bool, *, options: CommunicationOptions | None = None) -> bool:
        """Whether any worker still has input data: TF's per-step has-data all-reduce.

        One numbered collective; the flag rides in the fingerprint header, so it costs
        one small message and no data phase.
        """
        with self._collective("has_data", options) as call:
            mine = fp.Fingerprint(
                call.seq, "has_data", local_replicas=self._local_count(), arg=int(has_data)
            )
            prints = self._agree(call, mine)
        return any(p.arg for p in prints)

    def barrier(self, *, options: CommunicationOptions | None = None) -> None:
        """Wait until every worker reaches this barrier (a numbered collective)."""
        with self._collective("barrier", options) as call:
            self._agree(
                call, fp.Fingerprint(call.seq, "barrier", local_replicas=self._local_count())
            )

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the communicator's process groups (and the default one if it made it).

        Idempotent. Every worker should close; collectives afterwards raise RuntimeError.
        """
        if self._closed:
            return
        self._closed = True
        self._health.stop()
        self._close_shared()
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
