"""One all-reduce for a backward pass's buckets, each buffer filled as its bucket completes.

Across workers with one replica each, a model's gradient buckets travelled one after the
other: the communicator keeps one all-reduce in flight, so the queue's thread issued
bucket k+1 only once bucket k had completed, a round trip per bucket in a row (with 64
KiB buckets the tutorial CNN's epoch took 1.2-1.7x DDP's; docs/design.md §2b). Here a pass's
buckets are one all-reduce of one flat buffer per bucket (`PassReduce`), issued on the
queue when the pass's first bucket completes. The transport fills each buffer just
before it leaves (`fill`), waiting there until backward has completed that bucket, so
each bucket's bytes leave as soon as it is ready, while backward computes the next; the
sums, the check and the numbering are those of one collective (one fingerprint, one
prediction, no new protocol). Element-wise sums do not depend on how the values are cut
into buffers: every gradient is bitwise what the per-bucket path gives. Up to
`TUNING.pass_max_bytes` in all and `MAX_BUCKETS` buckets: the pass sums every bucket
after backward, where one by one the queue's thread sums the earlier ones during it, and
that costs more than the round trips saved for the largest models.

A pass that raises, or a bucket that cannot be filled, fails the fills still waiting
(`abandon`, with that error): the collective ends with it on this worker, which marks the
abort in the store; its peers wait for the rest of its data, which nothing sends after a
start that raised midway (`Integrity.abandon`), until that mark names it.

The pass's all-reduce comes before any collective backward itself starts after the
first bucket left (SyncBatchNorm's, a differentiable all-reduce's gradient, a hook's),
on every worker, and it cannot complete before backward does: such a collective could
never go. So a model's passes take this path only once one of its passes, its buckets
sent one by one, showed that backward starts no collective of its own from its first
bucket on (`GradientSync` watches, with `started_here`); one that does keeps sending its
buckets one by one. A backward that starts one later anyway gets a RuntimeError at once
(the communicator's queue refuses to wait for a call that waits for the caller:
`CallQueue.awaiting`), not a wait. `CROSSDEVICE_PASS_ALL_REDUCE=0` (on every worker)
sends every pass's buckets one by one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch

from crossdevice._arrays.packing import Pack
from crossdevice._comm.protocol import Pending
from crossdevice._core import tuning
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._frameworks.torch.buckets import FlatPlan, Reduced, stepped

__all__ = ["ENV", "MAX_BUCKETS", "PassReduce", "issue", "started_here"]

#: The environment variable that turns the path off ("0"), on every worker alike.
ENV: Final = "CROSSDEVICE_PASS_ALL_REDUCE"
#: Most buckets a pass sends as one all-reduce (more: one by one). The ring's message
#: tags number a buffer's pieces from `buffer * 2**17`, in a C int: at most 16383 buffers.
MAX_BUCKETS: Final = 4096

#: What a collective that backward starts while the pass's all-reduce waits for it gets.
_REFUSED: Final = (
    "a collective was started inside backward (SyncBatchNorm's, a differentiable "
    "all-reduce's gradient, a hook's) after the pass's first gradient bucket left, as "
    "part of one all-reduce of all the pass's buckets, which waits for backward: that "
    "collective cannot go first. The model's earlier passes started none there, which "
    "let its buckets travel as one all-reduce; start such collectives in every pass (or "
    f"in none), or set {ENV}=0 on every worker to send each bucket on its own"
)


def started_here(ctx: Any) -> int | None:
    """How many cross-worker collectives the running replica's thread started itself."""
    count = getattr(ctx.strategy.extended, "_collectives_here", None)
    return None if count is None else count()


def issue(
    ctx: Any,
    op: ReduceOp,
    plans: list[FlatPlan],
    leaves: tuple[Any, ...],
    parts: list[torch.Tensor],
    steps: int,
) -> PassReduce | None:
    """The pass's buckets (`plans`) as one all-reduce, issued with bucket 0's `parts` in.

    Args:
        ctx: the running replica's context.
        op: SUM or MEAN.
        plans: every bucket's `FlatPlan`, in reduction order, of one dtype.
        leaves: the plans' `leaves` end to end (each bucket's ends with its flags), one
            object from step to step.
        parts: bucket 0's gradients flattened, then its flags (`FlatPlan.parts`).
        steps: the optimizer steps taken on these parameters (compared across workers).

    Returns:
        The pass's `PassReduce`, or None where the strategy has no such path, or the
        pass more than `MAX_BUCKETS` buckets (nothing was issued).
    """
    extended = ctx.strategy.extended
    reduce_flats = getattr(extended, "_replica_reduce_flats_async", None)
    if reduce_flats is None or len(plans) > MAX_BUCKETS:
        return None
    options = extended._communication_options()
    bound = (options and options.timeout_seconds) or tuning.TUNING.default_timeout_seconds
    passing = PassReduce(plans, bound)
    passing.offer(0, parts)
    with stepped(ctx, steps):
        passing.pending = reduce_flats(
            ctx.replica_id_in_sync_group,
            op,
            parts[0],
            [plan.numel for plan in plans],
            passing.fill,
            leaves,
            _REFUSED,
            passing.missing,
        )
    return passing if passing.pending is not None else None


class PassReduce:
    """The buckets of one backward pass, reduced as one all-reduce (see the module doc).

    Args:
        plans: each bucket's `FlatPlan`, in reduction order (bucket 0: the first issued).
        bound: the longest a fill waits for backward to complete its bucket, in seconds
            (the collective's timeout: a pass that neither completes nor raises).
    """

    __slots__ = ("_error", "_packs", "_parts", "_plans", "_ready", "_totals", "bound", "pending")

    def __init__(self, plans: Sequence[FlatPlan], bound: float) -> None:
        self._plans = list(plans)
        self._parts: list[list[torch.Tensor] | None] = [None] * len(plans)
        self._ready = [threading.Event() for _ in plans]
        self._packs: list[Pack | None] = [None] * len(plans)
        self._error: BaseException | None = None
        self._totals: list[Any] | None = None
        self.bound = bound
        #: The pass's all-reduce (set once issued): `wait()` gives every bucket's buffer.
        self.pending: Pending | None = None

    def offer(self, j: int, parts: list[torch.Tensor]) -> None:
        """Bucket `j` is complete: its gradients flattened and its flags (`FlatPlan.parts`)."""
        self._parts[j] = parts
        self._ready[j].set()

    def missing(self, j: int) -> bool:
        """Whether bucket `j` is still to come from backward."""
        return not self._ready[j].is_set()

    def abandon(self, error: BaseException) -> None:
        """The pass ended without completing every bucket: waiting fills raise `error`."""
        if self._error is None:
            self._error = error
        for ready in self._ready:
            ready.set()
        self._parts = [None] * len(self._parts)  # the fills raise; the gradients go

    def fill(self, j: int, start: int, stop: int, dest: np.ndarray) -> None:
        """Elements `start:stop` of bucket `j` into `dest`, once backward completed it.

        Runs on the queue's thread, in the transport, just before the range leaves.

        Raises:
            BaseException: the error the pass was abandoned with.
            TimeoutError: the bucket did not complete within `bound` seconds.
        """
        if not self._ready[j].wait(self.bound):
            raise TimeoutError(
                f"backward did not complete gradient bucket {j} within {self.bound:g} s of "
                "the pass's all-reduce (the collective's timeout); raise timeout_seconds "
                "for a backward pass this slow"
            )
        parts = self._parts[j]
        if self._error is not None or parts is None:
            raise self._error or RuntimeError(f"bucket {j} was abandoned")
        if start == 0 and stop == self._plans[j].numel:
            torch.cat(parts, out=torch.from_numpy(dest))  # the whole bucket: one call
            return
        pack = self._packs[j]
        if pack is None:
            pack = self._packs[j] = Pack.of([(p.numel(),) for p in parts])
        arrays = [p.numpy() for p in parts]
        pack.fill(lambda i: [arrays[i]], start, stop, dest, np.add)

    def share(self, j: int) -> _Share:
        """Bucket `j`'s part of the pass's all-reduce, as a pending `Reduced`."""
        return _Share(self, j)

    def result(self, j: int) -> Reduced:
        """Bucket `j`'s reduced gradients (waits for the pass's all-reduce, once)."""
        if self._totals is None:
            assert self.pending is not None
            self._totals = self.pending.wait()
            # Every buffer has left: the local gradients are not needed any more (the
            # communicator may keep this collective's fills until its next one).
            self._parts = [None] * len(self._parts)
        return self._plans[j].views(self._totals[j])


class _Share:
    """One bucket's part of a `PassReduce` (`wait()`: its `Reduced`)."""

    __slots__ = ("_j", "_whole")

    def __init__(self, whole: PassReduce, j: int) -> None:
        self._whole = whole
        self._j = j

    def done(self) -> bool:
        """Whether `wait` returns at once."""
        pending = self._whole.pending
        return pending is not None and pending.done()

    def wait(self) -> Reduced:
        """The bucket's reduced gradients."""
        return self._whole.result(self._j)
