"""The machinery under `ProcessGroupCommunicator`: numbering, fingerprints, waiting, diagnosis.

`CommunicatorBase` holds what every collective goes through: `_collective` numbers it
and publishes the arrival, `_agree` exchanges and checks the fingerprints, `_run` waits
for the process group while watching the peers' health, `_fail` turns a failure into an
error naming the ranks (and global replica ids) at fault. The public collectives live in
`torch_dist.py`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import numpy as np
import torch
import torch.distributed as dist

from crossdevice._arrays import NUMPY, is_torch
from crossdevice._comm.workers import fingerprint as fp
from crossdevice._comm.workers.calls import MIN_WAIT_SECONDS as _MIN_WAIT_SECONDS
from crossdevice._comm.workers.calls import POLL_SECONDS as _POLL_SECONDS
from crossdevice._comm.workers.calls import Call as _Call
from crossdevice._comm.workers.calls import PeersFailedError as _PeersFailedError
from crossdevice._comm.workers.health import HealthBoard
from crossdevice._comm.workers.shared_rounds import SharedRounds
from crossdevice._comm.workers.speculation import (
    MAX_INLINE_WORKERS,
    Layout,
    Predictor,
    RoomPool,
    inline_agrees,
    speculative_ops,
)
from crossdevice._comm.workers.wire import (
    DTYPE_CODES,
    Wire,
    needs_view,
    wire_dtype,
)
from crossdevice._core.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    WorkerFailedError,
)
from crossdevice._core.options import CommunicationOptions

__all__ = [
    "DEFAULT_INIT_TIMEOUT_SECONDS",
    "DEFAULT_TIMEOUT_SECONDS",
    "MAX_PEER_BYTES",
    "CommunicatorBase",
    "Signature",
]


#: Process groups of failed communicators. Dropping the last reference to a Gloo group
#: with pending work blocks (measured: until the work's own timeout) holding the GIL, and
#: `abort()` does not cancel Gloo work (measured), so they are unregistered from
#: torch.distributed and never freed (an extra reference): the process can still exit.
_FAILED_GROUPS: list[Any] = []

#: How long constructing a communicator waits for every worker to join the rendezvous.
#: Workers of a job start minutes apart on busy clusters; TF waits indefinitely, torch
#: 30 minutes; we bound it and let the caller raise it.
DEFAULT_INIT_TIMEOUT_SECONDS: Final = 300.0

#: Bound on every collective when `CommunicationOptions.timeout_seconds` is None: a
#: live worker that does not arrive is reported after this long (dead ones within
#: seconds, see `worker_health.DEAD_AFTER_SECONDS`). NCCL's watchdog default is 10 min.
#: Change it per strategy with `CommunicationOptions(timeout_seconds=...)`.
DEFAULT_TIMEOUT_SECONDS: Final = 600.0

#: The process groups time out this much after our own wait, which names the missing
#: ranks; Gloo's timeout then clears its pending work.
_BACKSTOP_SLACK_SECONDS: Final = 1.0

#: Bound on each store read while diagnosing.
_DIAGNOSIS_STORE_TIMEOUT_SECONDS: Final = 2.0

#: Largest buffer a peer's header may make this worker allocate (all_gather padding,
#: a broadcast received without a value of our own): headers are untrusted input.
MAX_PEER_BYTES: Final = 1 << 36


@dataclasses.dataclass(frozen=True)
class Signature:
    """What a strategy adds to a reduction's fingerprint: the values before packing.

    Attributes:
        op: the reduce op the strategy applies (`"sum"`, `"mean"`).
        shapes: `fingerprint.digest` of the values' shapes and dtypes, in order.
        structure: digest of the values' structure (0: none).
    """

    op: str
    shapes: int
    structure: int = 0


class CommunicatorBase(SharedRounds):
    """Numbering, fingerprints, health-watching waits and diagnosis for a communicator.

    Subclasses set `_rank`, `_world_size`, `_host_group`, `_cuda_group`, `_health`,
    `_options`, `_replicas`, `_seq`, `_lock`, `_broken`, `_closed`, `_predictor` and
    `_rooms`; `SharedRounds` adds the shared-memory transport.
    """

    _rank: int
    _world_size: int
    _host_group: Any
    _cuda_group: Any
    _health: HealthBoard
    _options: CommunicationOptions
    _replicas: list[int] | None
    _seq: int
    _lock: threading.Lock
    _broken: str | None
    _closed: bool
    _predictor: Predictor
    _rooms: RoomPool

    @property
    def timeout(self) -> float:
        """The bound on every collective: `timeout_seconds`, else `DEFAULT_TIMEOUT_SECONDS`."""
        return self._options.timeout_seconds or DEFAULT_TIMEOUT_SECONDS

    @property
    def broken(self) -> str | None:
        """Why this communicator refuses collectives (a failure), or None."""
        return self._broken

    @property
    def local_replicas(self) -> list[int] | None:
        """Every rank's local replica count, once `agree_on_local_replicas` ran."""
        return self._replicas

    def agree_on_local_replicas(self, count: int) -> list[int]:
        """Exchange local replica counts; CollectiveMismatchError on every rank if they differ.

        A strategy calls this once: global replica ids (`rank * count + i`) and MEAN's
        divisor need the same count on every worker.
        """
        with self._collective("replica_count", None) as call:
            table = self._gather_small(call, torch.tensor([count], dtype=torch.int64))
        counts = [int(row[0]) for row in table]
        if len(set(counts)) > 1:
            raise CollectiveMismatchError(
                f"every worker must run the same number of local replicas, got "
                f"{', '.join(f'rank {r}: {c}' for r, c in enumerate(counts))}; give every "
                "worker the same `devices` (or the same number of GPUs)"
            )
        self._replicas = counts
        return counts

    def abort(self, error: BaseException) -> None:
        """Give up: refuse further collectives and tell every peer why.

        `MultiWorkerMirroredStrategy` calls this when a step raises on this worker, so
        its peers raise `WorkerFailedError` naming it at once instead of waiting for it.
        Three channels: an *abort header* sent as this worker's part of the next
        collective's fingerprint exchange (peers waiting in it, or arriving later, read
        it there, even when the store is gone), a mark in the c10d store with the
        whole message (peers waiting elsewhere see it within a poll interval), and, on
        shared memory, a mark in this worker's segment that wakes peers waiting there.
        """
        if self._closed or self._broken is not None:
            return
        reason = f"{type(error).__name__}: {error}"
        self._broken = f"this worker's step raised {reason}"
        self._health.post_abort(reason)
        if self._shared is not None:
            self._shared.poison()  # peers waiting in (or reaching) a shared round raise
        if self._host_group is not None and self._lock.acquire(blocking=False):
            try:
                self._seq += 1
                header_np = fp.abort_print(
                    self._seq, type(error).__name__, self._local_count()
                ).encode()
                predicted = self._predictor.predict()
                if predicted and self._world_size <= MAX_INLINE_WORKERS:
                    # The peers start with the predicted all-reduce: pair it, with an
                    # inline header that fails their check, then the abort header.
                    ops: list[Any] = []
                    if not self._shares(predicted):  # (in shared memory: the mark above)
                        zeros = self._predictor.zeros(predicted)
                        ops, _, _ = speculative_ops(predicted, zeros, header_np)
                    for t, _ in ops:
                        work = dist.all_reduce(t, group=self._host_group, async_op=True)
                        _FAILED_GROUPS.append((work, t))
                header = torch.from_numpy(header_np)
                outs = [torch.empty_like(header) for _ in range(self._world_size)]
                # Fire and forget: the peers may never come; the group is never freed.
                work = dist.all_gather(outs, header, group=self._host_group, async_op=True)
                _FAILED_GROUPS.append((work, header, outs))
                self._destroy_groups(keep_alive=True)
            except Exception:
                pass
            finally:
                self._lock.release()

    # -- machinery -----------------------------------------------------------------------

    def _local_count(self) -> int:
        return 0 if self._replicas is None else self._replicas[self._rank]

    def _value_print(self, call: _Call, kind: str, wire: Wire | None, arg: int) -> fp.Fingerprint:
        if wire is None:
            return fp.Fingerprint(call.seq, kind, local_replicas=self._local_count(), arg=arg)
        shape = tuple(wire.tensor.shape)  # at most fp.MAX_NDIM: NumPy's own limit
        return fp.Fingerprint(
            call.seq,
            kind,
            local_replicas=self._local_count(),
            buffers=1,
            nbytes=wire.tensor.numel() * wire.tensor.element_size(),
            arg=arg,
            cuda=wire.tensor.is_cuda,
            ndim=len(shape),
            dtype_code=DTYPE_CODES.index(wire.dtype),
            shape=shape,
        )

    def _agree(
        self,
        call: _Call,
        mine: fp.Fingerprint,
        detail: Callable[[], str] | None = None,
        overlap: Callable[[], None] | None = None,
        fit: Callable[[Layout], list[torch.Tensor] | None] | None = None,
        layout: Layout | None = None,
        fill: Callable[..., bool] | None = None,
    ) -> list[fp.Fingerprint]:
        """Check every worker's fingerprint; CollectiveMismatchError unless they match.

        When every worker predicts an all-reduce layout (`speculation.py`), the check
        rides inline in that all-reduce: `fit(predicted)` returns this worker's buffers
        (the first with room for the inline header unless `header_apart`) when its call
        has that layout, else
        None (zeros are sent). `call.speculated` then says whether the data is reduced.
        Otherwise, or when the inline check fails, the headers are all-gathered (and
        `overlap`, e.g. the API's copy of the inputs, runs while they travel). `layout`
        is this call's own host layout (all_reduce only), recorded for the next guess;
        `fill` writes the data chunk by chunk as it leaves (see `_inline`).
        """
        header_np = mine.encode()
        n = self._world_size
        predicted = self._predictor.predict() if n <= MAX_INLINE_WORKERS else None
        fitted = False
        if predicted:
            fitted, agrees = self._inline(call, header_np, predicted, fit, overlap, fill)
            if agrees:
                call.speculated = fitted
                self._predictor.learn([header_np] * n, layout)
                return [mine] * n
            overlap = None  # ran already, by `fit` or during the inline all-reduce
        header = torch.from_numpy(header_np)
        table = torch.empty((n, fp.HEADER_LEN), dtype=torch.int64)
        outs = list(table.unbind(0))
        self._run(
            call,
            lambda: [dist.all_gather(outs, header, group=self._host_group, async_op=True)],
            overlap,
        )
        rows = table.numpy()
        fields: list[str] = []
        if (rows == header_np).all():
            prints = [mine] * n  # every row is ours: valid by construction
        else:
            prints = self._decode(call, rows)
            fields = fp.mismatched_fields(prints)
        if fields:
            # Every worker saw the same table, so every worker is here: one more fixed-size
            # exchange, on the error path only, brings each worker's readable detail.
            text = detail() if detail is not None else ""
            mine_detail = torch.from_numpy(fp.encode_detail(text))
            got = torch.empty((n, fp.DETAIL_BYTES), dtype=torch.uint8)
            gouts = list(got.unbind(0))
            self._run(
                call,
                lambda: [
                    dist.all_gather(gouts, mine_detail, group=self._host_group, async_op=True)
                ],
            )
            details = [fp.decode_detail(row) for row in got.numpy()]
            if "seq" in fields:
                # The workers' counts went apart: nothing later can pair up again.
                self._broken = f"{call.label}: collective sequence numbers differ"
            raise CollectiveMismatchError(
                f"{call.label} on rank {self._rank}: "
                + fp.mismatch_message(prints, details, fields)
            )
        if fitted:
            # This worker's buffers were summed with other data: never hand them out.
            self._broken = f"{call.label}: the inline fingerprints disagreed, the headers not"
            raise CollectiveMismatchError(
                f"{call.label} on rank {self._rank}: the fingerprints inside the data "
                "disagreed but the exchanged headers agree; expected both to agree. This is a "
                "crossdevice bug (or a peer running another version): report it, and build a "
                "new strategy on every worker"
            )
        self._predictor.learn(list(rows), layout)
        return prints

    def _inline(
        self,
        call: _Call,
        header_np: np.ndarray,
        predicted: Layout,
        fit: Callable[[Layout], list[torch.Tensor] | None] | None,
        overlap: Callable[[], None] | None,
        fill: Callable[..., bool] | None,
    ) -> tuple[bool, bool]:
        """The predicted all-reduce with the inline header: (this call fit, all agree).

        `fill(buffer, start, stop)`, when given, writes this worker's data of that range
        just before the op that sends it (`speculation.PIPELINE_MIN_BYTES`).
        """
        tensors = fit(predicted) if fit is not None else None
        fitted = tensors is not None
        if self._shares(predicted):
            return self._inline_shared(call, header_np, predicted, tensors, overlap, fill)
        if tensors is None:
            tensors = self._predictor.zeros(predicted)
        ops, slots, mine = speculative_ops(predicted, tensors, header_np)

        def launch() -> list[Any]:
            works = []
            for tensor, span in ops:
                if fitted and fill is not None and span is not None:
                    fill(*span)
                works.append(dist.all_reduce(tensor, group=self._host_group, async_op=True))
            return works

        self._run(call, launch, None if fitted else overlap)
        return fitted, inline_agrees(slots, mine, self._world_size)

    def _decode(self, call: _Call, rows: np.ndarray) -> list[fp.Fingerprint]:
        """Every worker's header, checked; WorkerFailedError if a peer sent an abort."""
        try:
            prints = [
                fp.Fingerprint.decode(rows[r], rank=r, num_dtypes=len(DTYPE_CODES))
                for r in range(self._world_size)
            ]
        except ValueError as err:
            self._broken = f"{call.label}: {err}"
            raise CollectiveMismatchError(f"{call.label}: {err}") from None
        aborted = [(r, p) for r, p in enumerate(prints) if p.kind == "abort"]
        if aborted:
            self._broken = f"{call.label}: a peer aborted"
            self._destroy_groups(keep_alive=True)
            named = "; ".join(
                f"rank {r}{self._replica_ids([r])} raised {fp.abort_reason(p)}" for r, p in aborted
            )
            raise WorkerFailedError(
                f"{call.label} on rank {self._rank} of {self._world_size}: a peer failed: "
                f"{named}. Fix that worker's failure (see its log); every worker must then "
                "build a new strategy (or communicator)."
            )
        return prints

    def _check_allocation(
        self,
        call: _Call,
        like: torch.Tensor | None,
        numel: int,
        axis: int,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Refuse to allocate more than `MAX_PEER_BYTES` because a peer's header says so."""
        itemsize = torch.empty((), dtype=dtype or like.dtype).element_size()  # type: ignore[union-attr]
        other = 1
        if like is not None:
            other = _numel(like.shape) // max(1, like.shape[axis]) if like.dim() else 1
        if numel * other * itemsize > MAX_PEER_BYTES:
            raise ValueError(
                f"{call.label}: the peers' shapes would make this worker allocate "
                f"{numel * other * itemsize} bytes, more than MAX_PEER_BYTES="
                f"{MAX_PEER_BYTES}; expected values of a size this worker can hold. Check "
                "the peers' values (a peer sent a corrupt or hostile header?)"
            )

    def _common_device(self, prints: Sequence[fp.Fingerprint]) -> torch.device:
        """Where a gather or broadcast travels: CUDA (NCCL) if any worker's value is there.

        Decided from the exchanged fingerprints so that every worker picks the same
        group, even when some pass host values or None.
        """
        if self._cuda_group is not None and any(p.cuda for p in prints):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _group_for(self, tensor: torch.Tensor) -> Any:
        return self._cuda_group if tensor.is_cuda else self._host_group

    def _to_wire(self, value: Any, *, copy: bool) -> Wire:
        """`value` as a contiguous tensor Gloo/NCCL can carry (a fresh one when `copy`)."""
        owned = copy
        if is_torch(value):
            kind = "torch"
            tensor = value.detach()
            if copy or not tensor.is_contiguous():
                tensor = tensor.clone(memory_format=torch.contiguous_format)
                owned = True
        else:
            kind = "numpy"
            array = NUMPY.asarray(value)
            writable_c = array.flags.c_contiguous and array.flags.writeable
            if copy or not writable_c:
                array = np.array(array, order="C", copy=True)
                owned = True
            try:
                tensor = torch.from_numpy(array)
            except TypeError:
                raise TypeError(
                    f"cannot communicate a NumPy array of dtype {array.dtype}; expected a "
                    f"numeric or bool dtype torch supports (got {value!r:.80})"
                ) from None
        dtype, device, shape = tensor.dtype, tensor.device, tuple(tensor.shape)
        wdtype = wire_dtype(dtype)
        if tensor.is_cuda and self._cuda_group is None:
            tensor = tensor.cpu()  # no NCCL: CUDA values travel through Gloo on the host
            owned = True
        if wdtype != dtype:
            owned = owned or not needs_view(dtype)
            tensor = tensor.view(wdtype) if needs_view(dtype) else tensor.to(wdtype)
        return Wire(tensor, dtype, kind, device, shape, owned)

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
                f"{name}: this worker's collectives are broken ({self._broken}); nothing can "
                "pair up with the other workers any more: build a new strategy (or "
                "communicator) on every worker"
            )
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"{name}: another thread is running a collective on this communicator; "
                "collectives must be issued one at a time, in the same order on every worker"
            )
        try:
            self._seq += 1
            self._health.reached = self._seq  # published by the board's thread
            timeout = self.timeout
            if options is not None and options.timeout_seconds:
                # The groups' own timeout (ours + slack) was fixed at construction.
                timeout = min(timeout, options.timeout_seconds)
            yield _Call(name, self._seq, timeout, time.monotonic())
        finally:
            self._lock.release()

    def _run(
        self,
        call: _Call,
        launch: Callable[[], list[Any]],
        overlap: Callable[[], None] | None = None,
    ) -> None:
        """Launch the process-group work of `call`; wait, watching the peers' health.

        `overlap` runs between launch and wait: local work hidden behind the message.
        """
        try:
            works = launch()
            if overlap is not None:
                overlap()
            for work in works:
                while True:
                    remaining = call.remaining()
                    if remaining < _MIN_WAIT_SECONDS:
                        raise TimeoutError(f"no reply within {call.timeout:g} s")
                    try:
                        work.wait(datetime.timedelta(seconds=min(_POLL_SECONDS, remaining)))
                        break
                    except RuntimeError:
                        if work.is_completed():
                            raise  # a real failure (a peer's connection closed...)
                    failures = self._health.check()
                    if failures:
                        raise _PeersFailedError(failures)
        except (CollectiveMismatchError, WorkerFailedError):
            raise
        except Exception as err:
            self._fail(call, err)

    def _fail(self, call: _Call, err: Exception) -> None:
        """Turn a failed collective into an error naming the failed or missing ranks."""
        self._broken = f"{call.label} failed"
        where = f"{call.label} on rank {self._rank} of {self._world_size}"
        failures = err.failures if isinstance(err, _PeersFailedError) else []
        timed_out = isinstance(err, TimeoutError) and not failures
        if not failures and not timed_out:
            # The process group failed (a connection closed): find out who, for up to a
            # dead worker's heartbeat timeout.
            from crossdevice._comm.workers.health import DEAD_AFTER_SECONDS

            deadline = time.monotonic() + DEAD_AFTER_SECONDS + 1.0
            while not failures and time.monotonic() < deadline:
                failures = self._health.check()
                if not failures:
                    time.sleep(_POLL_SECONDS)
        # The board keeps beating: this worker is alive, and its peers must not take it
        # for dead while they diagnose their own failure.
        missing = None if failures else self._health.missing(call.seq)
        self._destroy_groups(keep_alive=True)
        if failures:
            named = "; ".join(
                f"rank {f.rank}{self._replica_ids([f.rank])} {f.reason}"
                if f.rank >= 0
                else f"the store {f.reason}"
                for f in failures
            )
            raise WorkerFailedError(
                f"{where}: a peer failed: {named}. Fix that worker's failure (see its log); "
                f"every worker must then build a new strategy (or communicator)."
            ) from (None if isinstance(err, _PeersFailedError) else err)
        if timed_out:
            if missing:
                who = f"rank(s) {missing}{self._replica_ids(missing)} did not arrive at it"
            elif missing is None:
                who = "the arrival marks could not be read"
            else:
                who = "every rank arrived at it, but a peer is stuck inside it"
            raise CollectiveTimeoutError(
                f"{where} timed out after {call.timeout:g} s: {who}. Every worker must run "
                f"the same collectives in the same order; if the workers are only slow, "
                f"raise CommunicationOptions(timeout_seconds=...) (default "
                f"{DEFAULT_TIMEOUT_SECONDS:g} s). Build a new strategy on every worker."
            ) from None
        raise RuntimeError(
            f"{where} failed ({type(err).__name__}: {err}); no peer is known to have died "
            f"or failed. Check the other workers' logs, then build a new strategy (or "
            f"communicator) on every worker."
        ) from err

    def _replica_ids(self, ranks: Sequence[int]) -> str:
        """` (global replicas [2, 3])` when the replica counts are known."""
        if self._replicas is None:
            return ""
        ids: list[int] = []
        for rank in ranks:
            start = sum(self._replicas[:rank])
            ids.extend(range(start, start + self._replicas[rank]))
        return f" (global replicas {ids})"

    def _destroy_groups(self, *, keep_alive: bool = False) -> None:
        """Unregister our groups; `keep_alive` never frees them (see `_FAILED_GROUPS`)."""
        for attr in ("_host_group", "_cuda_group"):
            group = getattr(self, attr, None)
            if group is not None:
                setattr(self, attr, None)
                if keep_alive:
                    _FAILED_GROUPS.append(group)
                    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
                with contextlib.suppress(Exception):  # best effort: it may be gone already
                    dist.destroy_process_group(group)


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
