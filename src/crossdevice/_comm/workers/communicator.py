"""`ProcessGroupCommunicator`: collectives across worker processes, composed from parts.

It is the cross-worker half of `MultiWorkerMirroredStrategy`, which combines it with the
in-process collectives in three phases (local sum, cross-worker all-reduce, local
broadcast; `_cross_device/collective.py`). It is assembled, not inherited
(docs/design.md §2b):

* `Groups` (`groups.py`): its own torch.distributed groups, Gloo for host values and all
  metadata, NCCL for CUDA values;
* `HealthBoard` (`health.py`): heartbeats, arrival and abort marks in the c10d store, and
  the one wait loop every wait goes through: a peer whose step raised, or whose
  heartbeat stopped, is named within seconds; a live peer that does not arrive is named
  when `timeout_seconds` (default `TUNING.default_timeout_seconds`) expires;
* transports (`transport.py`): shared memory between the workers of one host, the
  out-of-place ring for large host all-reduces (and, between 2 workers, the whole
  exchange of every summed one), the process groups for the rest;
* `Integrity` (`integrity.py`): every collective's fingerprint checked on every worker
  before its result is used, riding inside a repeated all-reduce's data.

Every public method is one *numbered collective*, and every worker must call the same
collectives in the same order with matching values; a failed communicator refuses
further collectives (every worker must build a new one, as TF's collectives poison the
context too). Values may be NumPy arrays (or numbers) and torch tensors; each method
returns the kind it was given, and never modifies its inputs unless they are donated.
"""

from __future__ import annotations

import time
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

from crossdevice._comm.protocol import BroadcastOptions, Done, GatherOptions, ReduceOptions, Then
from crossdevice._comm.workers import fingerprint as fp
from crossdevice._comm.workers import has_data as hd
from crossdevice._comm.workers.calls import Call, Standing, WaitFailedError
from crossdevice._comm.workers.copies import broadcast, gather, value_print
from crossdevice._comm.workers.gloo import ProcessGroupTransport
from crossdevice._comm.workers.groups import Groups
from crossdevice._comm.workers.integrity import Integrity
from crossdevice._comm.workers.packs import batch_all_reduce_async
from crossdevice._comm.workers.plans import ReducePlans, make_plan
from crossdevice._comm.workers.ring import RingTransport
from crossdevice._comm.workers.sequence import FillFailedError, Pending, Sequencer, guarded_fill
from crossdevice._comm.workers.shm import SharedMemoryTransport
from crossdevice._comm.workers.speculation import Filler, RoomPool
from crossdevice._comm.workers.start import check_joined_group, connect_groups, start_for
from crossdevice._comm.workers.transport import Job, Layout
from crossdevice._comm.workers.wire import Wire, to_wire
from crossdevice._core import tuning
from crossdevice._core.cluster import Cluster
from crossdevice._core.errors import CollectiveMismatchError
from crossdevice._core.options import CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp

__all__ = ["ProcessGroupCommunicator"]


class ProcessGroupCommunicator:
    """Collectives among the workers of a cluster, on `torch.distributed`.

    It starts the default process group from `cluster` (rendezvous at
    `tcp://master_addr:master_port`, or torchrun's `env://`), or joins the one that
    already exists, and creates its own groups (`Groups`), so two communicators (two
    strategies) never mix their collectives.

    Args:
        cluster: this worker's place in the cluster; None reads `TF_CONFIG` or torchrun's
            variables (`resolve_cluster`). Ignored, apart from a consistency check, when
            `torch.distributed` is already initialised.
        options: default `CommunicationOptions`; its `timeout_seconds` bounds each
            collective (None: `TUNING.default_timeout_seconds`) and `implementation=RING`
            keeps CUDA values on Gloo.
        init_timeout_seconds: how long to wait for every worker at the rendezvous
            (None: `TUNING.default_init_timeout_seconds`).

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
        init_timeout_seconds: float | None = None,
    ) -> None:
        self._options = CommunicationOptions().merge(options)
        self._owns_default_group = False
        self._rooms = RoomPool()
        #: encoded all-reduce fingerprints, sequence number 0, by what makes them.
        self._prints = fp.ReductionPrints()
        self._plans = ReducePlans()
        if dist.is_initialized():
            check_joined_group(cluster)
        else:
            cluster = self._start_default_group(cluster, init_timeout_seconds)
        self._cluster = cluster
        self._standing = Standing(dist.get_rank(), dist.get_world_size())
        self._groups: Groups | None = None
        self._shm: SharedMemoryTransport | None = None
        try:
            rank, world = self._standing.rank, self._standing.world_size
            groups, self._health = connect_groups(
                self.timeout + tuning.TUNING.backstop_slack_seconds,
                self._options.implementation,
                rank,
                world,
            )
            self._groups = groups
            self._sequencer = Sequencer(
                self._standing, self._health, groups, self.abort, type(self).__name__
            )
            self._integrity = Integrity(self._standing, groups, self._health, [])
            in_place = ProcessGroupTransport(
                groups, self._health, world, self._rooms, self._integrity.predictor
            )
            ring = RingTransport(groups, self._health, rank, world, self._rooms)
            # Every worker on this host: through /dev/shm (every worker alike, or none).
            self._shm = SharedMemoryTransport.connect(
                rank, world, self._exchange, self._health, self._rooms, self._leave
            )
            self._sequencer.poison = None if self._shm is None else self._shm.poison
            self._integrity.transports[:] = [
                t for t in (self._shm, ring, in_place) if t is not None
            ]
        except BaseException:
            if self._groups is not None:
                self._groups.destroy()
            if self._owns_default_group:
                dist.destroy_process_group()
            raise

    def _start_default_group(self, cluster: Cluster | None, init_timeout: float | None) -> Cluster:
        cluster = start_for(cluster, init_timeout)
        self._owns_default_group = True
        return cluster

    # -- properties ----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's rank, 0 .. world_size - 1."""
        return self._standing.rank

    @property
    def size(self) -> int:
        """Number of workers (the `Communicator` protocol's name for `world_size`)."""
        return self._standing.world_size

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return self._standing.world_size

    @property
    def cluster(self) -> Cluster | None:
        """The cluster this communicator started from; None if it joined a group without one."""
        return self._cluster

    @property
    def options(self) -> CommunicationOptions:
        """The default `CommunicationOptions` of every collective."""
        return self._options

    @property
    def timeout(self) -> float:
        """The bound on every collective: `timeout_seconds`, else the tuning's default."""
        return self._options.timeout_seconds or tuning.TUNING.default_timeout_seconds

    @property
    def sequence_number(self) -> int:
        """Number of collectives started so far (the next one gets this number + 1)."""
        return self._sequencer.seq

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._sequencer.closed

    @property
    def broken(self) -> str | None:
        """Why this communicator refuses collectives (a failure), or None."""
        return self._standing.broken

    @property
    def local_replicas(self) -> list[int] | None:
        """Every rank's local replica count, once `agree_on_local_replicas` ran."""
        return self._standing.replicas

    @property
    def host_group(self) -> Any:
        """Its Gloo process group (None once closed or failed): for benchmarks and tests."""
        return None if self._groups is None else self._groups.host

    @property
    def shared_memory(self) -> Any:
        """The shared-memory slots when every worker shares this host, else None."""
        return None if self._shm is None else self._shm.slots

    # -- collectives ---------------------------------------------------------------------

    def all_reduce(
        self,
        values: Sequence[Any],
        options: ReduceOptions | ReduceOp | str = ReduceOp.SUM,
        *,
        donate: bool | Sequence[bool] = False,
        fill: Callable[..., bool] | None = None,
    ) -> list[Any]:
        """Reduce each buffer element-wise across workers; every worker gets the result.

        `all_reduce_async(...).wait()`: see there for the arguments.
        """
        return self.all_reduce_async(values, options, donate=donate, fill=fill).wait()

    def all_reduce_async(
        self,
        values: Sequence[Any],
        options: ReduceOptions | ReduceOp | str = ReduceOp.SUM,
        *,
        donate: bool | Sequence[bool] = False,
        fill: Callable[..., bool] | None = None,
    ) -> Pending:
        """Issue an all-reduce now; `wait()` on the result for the reduced values.

        What can leave at once leaves before this returns (on Gloo the whole all-reduce
        then runs in Gloo's threads while the caller computes); the rest, and the check
        of every worker's fingerprint, happen in `wait`. Results are bitwise those of
        `all_reduce`. At most one all-reduce is in flight: any collective issued before
        `wait` first completes it. `values` (unless donated) must not change before
        `wait` returns.

        One numbered collective, however many buffers. Its fingerprint is compared on
        every worker before any result is used.

        Args:
            values: arrays (typically flat packs), the same shapes, dtypes and kinds of
                device (host or CUDA) in the same order on every worker.
            options: `ReduceOptions` (or just its reduce op): `SUM` or `MEAN`; for MEAN
                the `divisor` (default the number of workers: a strategy passes the
                global replica count); a `timeout` shorter than the communicator's; the
                `signature` of what the caller reduces before packing (shapes, nest
                structure, call site), added to the fingerprint.
            donate: the caller will not use `values` again (one flag for all, or one per
                value): they may be reduced in place (the results may then be the
                inputs); else they never change.
            fill: `fill(i, start, stop, out=None)` writes elements `start:stop` of flat
                buffer `i` (donated `pack_buffer` views) just before they leave, or into
                `out` (a flat array of `stop - start` elements) instead, and returns
                whether it wrote (a value that is not donated holds its data already).

        Returns:
            A `Pending` whose `wait()` returns one array per buffer, of the buffer's kind,
            dtype (MEAN of integers gives floating point, as the backends divide) and
            device. `wait` is bounded by the collective's timeout.

        Raises (from `wait`, or here when the fingerprints are exchanged first):
            CollectiveMismatchError: on every worker, when the workers' calls differ.
            WorkerFailedError: a peer's step raised, or a peer died.
            CollectiveTimeoutError: a live worker did not arrive within the timeout.
            TypeError: a dtype no process group can carry.
        """
        fills, local = fill is not None, self._standing.local_count()
        key = ReducePlans.key(values, options, donate, fills, local)
        plan = None if key is None else self._plans.get(key, options)
        if plan is None:
            plan, tensors = make_plan(
                values, options, donate, fills, local, self.size, self._prints, self._to_wire
            )
            if key is not None:
                self._plans.keep(key, plan)
        else:  # a repeated call (plans.py)
            tensors = plan.tensors(values)
        lazy = None if fill is None else Filler(guarded_fill(fill), plan.sizes).live
        own, ours, overlap = plan.own, plan.ours, plan.opts.overlap

        def job(sent: Layout | None) -> Job:
            return Job(own if sent is None else sent, tensors, ours, lazy, overlap=overlap)

        with self._collective("all_reduce", plan.opts.timeout) as call:
            header = plan.template.copy()
            header[fp.SEQ_FIELD], header[fp.STATE_FIELD] = call.seq, call.state
            checked = self._sequencer.guard(
                call,
                lambda: self._integrity.start(
                    call, header, plan.layout, job, plan.describe, plan.history
                ),
            )
        results = plan.results
        pending = Pending(self._sequencer, call, checked.finish, results)
        self._sequencer.pending = pending
        return pending

    def submit(self, call: Callable[[], Any]) -> Any:
        """Queue `call` (it issues a collective here) after the calls queued before it.

        Other threads' collectives wait for them (`callqueue.py`); gives a pending one.
        """
        return self._sequencer.submit(call, self.timeout + tuning.TUNING.backstop_slack_seconds)

    def collectives_here(self) -> int:
        """How many collectives the calling thread has started itself (not queued ones)."""
        return self._sequencer.held_here()

    def awaiting(self, thread: Any, why: str, missing: Callable[[], bool]) -> Any:
        """Inside (a queued call), data `thread` produces may be awaited (`missing()`).

        A collective from `thread` would wait for the queue: RuntimeError(`why`) instead.
        """
        queue = self._sequencer.queue
        assert queue is not None  # only a queued call waits so
        return queue.awaiting(thread, why, missing)

    def pack_buffer(self, dtype: np.dtype, numel: int) -> np.ndarray:
        """A recycled flat host buffer to fill and then `all_reduce(..., donate=True)`.

        It has room behind it for the inline fingerprint (`speculation.py`), so reducing
        it copies nothing. Contents undefined.
        """
        return self._rooms.take(dtype, numel)

    def batch_all_reduce(
        self,
        values: Sequence[Any],
        options: ReduceOptions | ReduceOp | str = ReduceOp.SUM,
        *,
        bytes_per_pack: int | None = None,
    ) -> list[Any]:
        """`batch_all_reduce_async(...).wait()`: see there."""
        return self.batch_all_reduce_async(values, options, bytes_per_pack=bytes_per_pack).wait()

    def batch_all_reduce_async(
        self,
        values: Sequence[Any],
        options: ReduceOptions | ReduceOp | str = ReduceOp.SUM,
        *,
        bytes_per_pack: int | None = None,
    ) -> Then | Done:
        """All-reduce many arrays in few flat packs: grouped by kind, device and dtype.

        Values of one group are packed in order into flat buffers of about
        `bytes_per_pack` bytes (None takes the communicator's options, 0 one pack per
        group), filled as they leave (`packs.py`); all packs are reduced in one numbered
        collective and unpacked to the values' shapes. The fingerprint covers every
        value's shape and dtype, not only the packs' sizes. Issued as `all_reduce_async`
        is (the values must not change before `wait`).

        Returns:
            A pending collective whose `wait()` returns the reduced values, in the order
            and of the kinds of `values`.
        """
        pack_bytes = self._options.bytes_per_pack if bytes_per_pack is None else bytes_per_pack
        return batch_all_reduce_async(
            self.all_reduce_async,
            self._to_wire,
            self._rooms,
            values,
            options,
            pack_bytes,
            self.size,
        )

    def all_gather(self, value: Any, axis: GatherOptions | int = 0) -> Any:
        """Concatenate every worker's `value` along the axis, in rank order.

        Sizes along the axis may differ (TF's partial batches): they come with the
        fingerprints; values are padded to the largest, gathered, and unpadded.

        Args:
            value: this worker's array.
            axis: the axis (negative counts from the end), or the whole `GatherOptions`.

        Returns:
            The concatenation, of `value`'s kind.

        Raises:
            ValueError: on every worker alike, when ranks, dtypes or sizes on other axes
                differ, or the axis is out of range; the message names the ranks and shapes.
            CollectiveMismatchError: a worker runs another collective.
        """
        opts = GatherOptions.of(axis)
        wire = self._to_wire(value)
        with self._collective("all_gather", opts.timeout) as call:
            local = self._standing.local_count()
            mine = value_print(call, "all_gather", wire, opts.axis, local, opts.signature)
            prints = self._guard(call, lambda: self._integrity.agree(call, mine))
            out = gather(call, wire, opts.axis, prints, self.rank, self._cuda, self._op(call))
        return wire.result(out)

    def broadcast(self, value: Any, root: BroadcastOptions | int = 0) -> Any:
        """Every worker gets a copy of the root worker's `value`.

        Args:
            value: the array to send on the root; on the others an array of the same
                shape and dtype (data ignored) or None (the result is then NumPy).
            root: the rank that sends, or the whole `BroadcastOptions`.

        Returns:
            A new array equal to root's value, of this worker's kind.

        Raises:
            ValueError: on every worker alike, when the workers disagree on the root,
                the root passes None, or a shape or dtype differs from root's.
            CollectiveMismatchError: a worker runs another collective.
        """
        opts = BroadcastOptions.of(root)
        wire = None if value is None else self._to_wire(value)
        with self._collective("broadcast", opts.timeout) as call:
            local = self._standing.local_count()
            mine = value_print(call, "broadcast", wire, opts.root, local)
            prints = self._guard(call, lambda: self._integrity.agree(call, mine))
            launch = self._op(call)
            wire, out = broadcast(call, wire, opts.root, prints, self.rank, self._cuda, launch)
        return wire.result(out)

    def any_has_data(self, has_data: bool, *, timeout: float | None = None) -> bool:
        """Whether any worker still has input data: TF's per-step has-data all-reduce.

        One numbered collective; the flag rides in the fingerprint header (no data phase).
        """
        return bool(self.any_has_data_async(has_data, timeout=timeout).wait())

    def any_has_data_async(
        self,
        has_data: bool,
        *,
        steps: int | None = None,
        size: int | None = None,
        batch: tuple[int, int] | None = None,
        timeout: float | None = None,
    ) -> Pending:
        """`any_has_data` issued now; `wait()` (or the next collective) completes it.

        With `steps` (this worker's steps left), `wait()` gives `(any worker has data, the
        count every worker gave, or None)`; `size`s and `batch`es given must agree (`hd`).
        """
        with self._collective("has_data", timeout) as call:
            local = self._standing.local_count()
            arg, shape = fp.has_data_arg(has_data, steps), hd.header_shape(size, batch)
            mine = fp.Fingerprint(call.seq, "has_data", local_replicas=local, arg=arg, shape=shape)
            finish = self._guard(call, lambda: self._integrity.agree_later(call, mine))
        answer = hd.answer(steps is not None, call.label)
        pending = Pending(self._sequencer, call, finish, answer)
        self._sequencer.pending = pending
        return pending

    def has_data_known(self, carry: tuple[int, Callable[[], str]] | None = None) -> None:
        """A has-data agreement every worker skips alike (they agreed on the data's length).

        Numbered though nothing is sent; `carry`: a state the next collective carries.
        """
        with self._collective("has_data", None) as call:
            self._sequencer.ended(call, carry)  # at once (the flight recorder, a trace)

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every worker reaches this barrier (a numbered collective)."""
        with self._collective("barrier", timeout) as call:
            local = self._standing.local_count()
            mine = fp.Fingerprint(call.seq, "barrier", local_replicas=local)
            self._guard(call, lambda: self._integrity.agree(call, mine))

    def agree_on_local_replicas(self, count: int) -> list[int]:
        """Exchange local replica counts; CollectiveMismatchError on every rank if they differ.

        A strategy calls this once: global replica ids (`rank * count + i`) and MEAN's
        divisor need the same count on every worker.
        """
        with self._collective("replica_count", None) as call:
            mine = torch.tensor([count], dtype=torch.int64)
            table = self._guard(call, lambda: self._integrity.gather_small(call, mine))
        counts = [int(row[0]) for row in table]
        if len(set(counts)) > 1:
            raise CollectiveMismatchError(
                f"every worker must run the same number of local replicas, got "
                f"{', '.join(f'rank {r}: {c}' for r, c in enumerate(counts))}; give every "
                "worker the same `devices` (or the same number of GPUs)"
            )
        self._standing.replicas = counts
        return counts

    # -- lifecycle -----------------------------------------------------------------------

    def abort(self, error: BaseException, where: str = "") -> None:
        """Give up: refuse further collectives and tell every peer why (`error`, `where`).

        `MultiWorkerMirroredStrategy` calls this when a step raises on this worker, so
        its peers raise `WorkerFailedError` naming it at once instead of waiting for it.
        Three channels: an *abort header* sent as this worker's part of the next
        collective's fingerprint exchange (peers waiting in it, or arriving later, read
        it there, even when the store is gone), a mark in the c10d store with the
        whole message (peers waiting elsewhere see it within a poll interval), and, on
        shared memory, a mark in this worker's segment that wakes peers waiting there.
        """
        if isinstance(error, FillFailedError):
            error = error.error
        sequencer = self._sequencer
        if sequencer.closed or self._standing.broken is not None:
            return
        reason = f"{type(error).__name__}{f': {error}' if str(error) else ''}{where}"
        self._standing.broken = f"this worker's step raised {reason}"
        self._sequencer.tell(reason)  # the store, and shared memory's poison mark
        groups = self._groups
        if groups is not None and groups.alive and sequencer.hold("abort", blocking=False):
            try:
                sequencer.seq += 1
                self._integrity.abandon(sequencer.seq, type(error).__name__)
                groups.destroy(keep_alive=True)
            except Exception:
                pass
            finally:
                sequencer.lock.release()

    def close(self) -> None:
        """Destroy the communicator's process groups (and the default one if it made it).

        Idempotent. Every worker should close; collectives afterwards raise RuntimeError.
        """
        if not self._sequencer.close():
            return
        self._health.stop()
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._groups is not None:
            self._groups.destroy()
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> ProcessGroupCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "broken" if self._standing.broken else "open"
        return (
            f"ProcessGroupCommunicator(rank={self.rank}, world_size={self.world_size}, "
            f"collectives={self.sequence_number}, {state})"
        )

    # -- machinery -----------------------------------------------------------------------

    @property
    def _cuda(self) -> Any:
        return None if self._groups is None else self._groups.cuda

    def _to_wire(self, value: Any) -> Wire:
        return to_wire(value, cuda=self._cuda is not None)

    def _exchange(self, mine: torch.Tensor) -> np.ndarray:
        """All-gather a small host tensor at set-up (watched as any collective, unnumbered)."""
        call = Call("set-up exchange", 0, float(self.timeout), time.monotonic())
        return self._guard(call, lambda: self._integrity.gather_small(call, mine))

    def _op(self, call: Call) -> Callable[..., None]:
        """Runs one process-group op of `call` on the group its tensors live on, waited on."""

        def launch(op: Callable[..., Any], *args: Any) -> None:
            tensor = args[1] if op is dist.all_gather else args[0]
            assert self._groups is not None
            work = op(*args, group=self._groups.group_for(tensor), async_op=True)
            self._guard(call, lambda: self._health.wait_works(call, [work]))

        return launch

    def _leave(self, error: BaseException) -> None:
        """A transport left a collective midway (not a failed wait): tell the peers why."""
        if not isinstance(error, WaitFailedError):
            self.abort(error)

    def _collective(self, name: str, timeout: float | None) -> Any:
        """The sequencer's numbered collective, bounded by `timeout` (at most ours)."""
        # The groups' own timeout (ours + slack) was fixed at construction.
        bound = self.timeout
        return self._sequencer.collective(name, min(bound, timeout) if timeout else bound)

    def _guard(self, call: Call, run: Callable[[], Any]) -> Any:
        return self._sequencer.guard(call, run)
