"""One gradient bucket's all-reduce, issued as soon as the bucket is ready.

`GradientSync` (`gradients.py`) decides when a bucket is ready; this module issues its
all-reduce and says what each parameter's reduced gradient is. Three paths, one result:

* **Across workers, one replica per worker** (DDP's layout): the bucket's gradients are
  copied once into one flat buffer, with the bucket's `used` flags at its end, and that
  buffer is all-reduced across workers where it lies (reduced in place:
  `CollectiveAllReduce.reduce_flat_async`). The reduced gradients are views into it, as
  DDP's `gradient_as_bucket_view` gives (no copy out), and the all-reduce is left in
  flight while backward computes the next buckets; the outermost backward pass waits
  for every bucket when it returns. The buffer is recycled only once nothing refers to
  it: a gradient a program kept from an earlier step (`g = p.grad`) never changes under
  it (DDP's persistent bucket would change it).
* **Host replicas that store parameters once** (`share_storage`): one reduced buffer
  for every replica (`_replica_all_reduce_shared`).
* **Otherwise** `ReplicaContext.all_reduce`'s collective, issued with `all_reduce_async`
  (in flight across workers; complete at once between threads of one process).

Element-wise sums do not depend on how values are laid out in buffers, so every path
gives bitwise what `ReplicaContext.all_reduce` of the gradients gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from crossdevice._comm.protocol import Done, Pending, Then
from crossdevice._core.purpose import GRADIENTS_SITE, purpose
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._strategies.replica import ReplicaContext, all_reduce_async

__all__ = [
    "FlatPlan",
    "Reduced",
    "flat_reducible",
    "issue",
    "issue_flat",
    "needs_graph",
    "stepped",
    "uniform",
]

#: What a bucket's all-reduce gives: (each parameter's reduced gradient, in bucket order;
#: how many replicas had a gradient for each, as a tensor; whether the gradients lie in
#: one buffer every local replica shares).
Reduced = tuple[list[torch.Tensor], torch.Tensor, bool]


def issue_flat(
    ctx: ReplicaContext,
    op: ReduceOp,
    grads: Sequence[torch.Tensor | None],
    params: Sequence[torch.nn.Parameter],
    wire_dtype: torch.dtype | None,
    plan: FlatPlan | None = None,
    parts: list[torch.Tensor] | None = None,
    steps: int = 0,
) -> Pending | None:
    """Issue a bucket's all-reduce as one flat buffer reduced where it lies (`Reduced`).

    Args:
        ctx: the running replica's context.
        op: SUM or MEAN.
        grads: this replica's gradient of each parameter of the bucket (None: none
            arrived: it adds zeros, and its `used` flag is 0); `flat_reducible`.
        params: the bucket's parameters (shapes, dtypes, devices).
        wire_dtype: the dtype gradients travel in between workers (None: their own).
        plan: `FlatPlan(params)`, kept from step to step by the caller (None: made now).
        parts: `plan.parts(grads, params)` where the caller has them (`checked_parts`).
        steps: the optimizer steps taken on these parameters so far, compared across
            workers: a worker that skipped a step fails here, not drifts away.

    Returns:
        The pending all-reduce, or None where the strategy has no such path (nothing
        was issued: take `issue`).
    """
    if plan is None:
        plan = FlatPlan(params)
    reduce_flat = ctx.strategy.extended._replica_reduce_flat_async  # type: ignore[attr-defined]
    replica = ctx.replica_id_in_sync_group
    if parts is None:
        parts = plan.parts(grads, params)
    with stepped(ctx, steps):
        pending = reduce_flat(replica, op, parts, plan.leaves, wire_dtype)
    if pending is None:
        return None
    return Then([pending], plan.views)


def issue(
    ctx: ReplicaContext,
    op: ReduceOp,
    grads: Sequence[torch.Tensor | None],
    params: Sequence[torch.nn.Parameter],
    shared: bool,
    steps: int = 0,
) -> Pending:
    """Issue a bucket's all-reduce as `ReplicaContext.all_reduce` does; `wait()`: `Reduced`.

    Args (as `issue_flat`'s, and):
        shared: the replicas keep one reduced gradient (`_replica_all_reduce_shared`).
    """
    local = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params, strict=True)]
    used = torch.tensor([g is not None for g in grads], dtype=torch.float32)
    if shared:
        extended = ctx.strategy.extended
        replica = ctx.replica_id_in_sync_group
        with stepped(ctx, steps):
            reduced, one_buffer = extended._replica_all_reduce_shared(replica, op, [*local, used])
        return Done((reduced[:-1], reduced[-1], one_buffer))
    with stepped(ctx, steps):
        pending = all_reduce_async(ctx, op, [*local, used])
    return Then([pending], lambda reduced: (reduced[:-1], reduced[-1], False))


def stepped(ctx: ReplicaContext, steps: int) -> Any:
    """The gradients' `purpose`: the step count, in errors and (modulo 4) in the call site.

    Workers compare it with the call: one that skipped or repeated `optimizer.step()`
    differs from its peers by 1 or 2 at its next backward, and every worker fails there.
    (Replicas of one process meet in `MirroredOptimizer.step()` itself: nothing to add.)
    """
    if getattr(ctx.strategy.extended, "_worker_communicator", None) is None:
        return contextlib.nullcontext()
    return purpose(f"gradients after {steps} optimizer.step() calls", steps & 3, GRADIENTS_SITE)


def flat_reducible(
    extended: Any, grads: Sequence[torch.Tensor | None], params: Sequence[torch.nn.Parameter]
) -> bool:
    """Whether a bucket may take the flat path: one floating dtype and device, no graph."""
    if not hasattr(extended, "_replica_reduce_flat_async"):
        return False
    return uniform(params) and not needs_graph(grads)


def uniform(params: Sequence[torch.nn.Parameter]) -> bool:
    """Whether the parameters share one floating dtype and one device (a flat buffer)."""
    first = params[0]
    if not first.dtype.is_floating_point:
        return False
    return all(p.dtype == first.dtype and p.device == first.device for p in params)


def needs_graph(grads: Sequence[torch.Tensor | None]) -> bool:
    """Whether a gradient requires grad (create_graph=True): autograd must route it."""
    return any(g is not None and g.requires_grad for g in grads)


class FlatPlan:
    """What a flat bucket's all-reduce needs that stays the same from step to step.

    The buffer's layout: the gradients flattened, in bucket order, then the `used`
    flags. A bucket's plan is made once and kept while its parameters keep their shapes
    and dtype (`fits`): per step, only the gradients are read.

    Args:
        params: the bucket's parameters (`uniform`).
    """

    __slots__ = ("_all_used", "_dtype", "_shapes", "_stand_ins", "leaves", "numel")

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        first = params[0]
        self._dtype = first.dtype
        self._shapes = tuple(p.shape for p in params)
        #: What the flat buffer holds, for the workers to compare: each shape and dtype.
        self.leaves = (
            *((tuple(p.shape), str(p.dtype)) for p in params),
            ("used", len(params)),
        )
        # One tensor per member, of its shape and no memory (a 0-d tensor expanded):
        # what torch's `unflatten_dense_tensors` reads to cut the reduced buffer into
        # views, in one call (a Python slice and reshape per member cost 4x as much).
        one = torch.empty((), dtype=first.dtype)
        self._stand_ins = [one.expand(s) for s in (*self._shapes, (len(params),))]
        # The flags when every gradient arrived, kept from step to step: the strategy only
        # reads the parts (`reduce_flat_async` copies them into its flat buffer).
        self._all_used = torch.ones(len(params), dtype=first.dtype, device=first.device)
        #: Elements of the flat buffer: the gradients', then one flag per parameter.
        self.numel = sum(p.numel() for p in params) + len(params)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the flat buffer (every parameter's)."""
        return self._dtype

    def fits(self, params: Sequence[torch.nn.Parameter]) -> bool:
        """Whether `params` still have the shapes and dtype this plan was made for."""
        dtype = self._dtype
        return len(params) == len(self._shapes) and all(
            p.dtype == dtype and p.shape == shape
            for p, shape in zip(params, self._shapes, strict=True)
        )

    def parts(
        self, grads: Sequence[torch.Tensor | None], params: Sequence[torch.nn.Parameter]
    ) -> list[torch.Tensor]:
        """The bucket's gradients flattened, in order, then the `used` flags."""
        parts = [
            p.new_zeros(p.numel()) if g is None else g.reshape(-1)
            for g, p in zip(grads, params, strict=True)
        ]
        if any(g is None for g in grads):
            first = params[0]
            flags = [g is not None for g in grads]
            parts.append(torch.tensor(flags, dtype=first.dtype, device=first.device))
        else:
            parts.append(self._all_used)
        return parts

    def checked_parts(
        self, grads: Sequence[torch.Tensor | None], params: Sequence[torch.nn.Parameter]
    ) -> list[torch.Tensor] | None:
        """`parts`, or None where the plan does not fit `params` or a gradient needs the graph.

        `fits`, `needs_graph` and `parts` in one pass over the bucket: the per-step case.
        """
        shapes = self._shapes
        if len(params) != len(shapes):
            return None
        dtype = self._dtype
        parts = []
        missing = False
        for g, p, shape in zip(grads, params, shapes, strict=True):
            if p.dtype != dtype or p.shape != shape:
                return None
            if g is None:
                missing = True
                parts.append(p.new_zeros(p.numel()))
            elif g.requires_grad:
                return None
            else:
                parts.append(g.reshape(-1))
        if missing:
            flags = [g is not None for g in grads]
            parts.append(torch.tensor(flags, dtype=dtype, device=params[0].device))
        else:
            parts.append(self._all_used)
        return parts

    def views(self, total: Any) -> Reduced:
        """Each parameter's reduced gradient as a view into the reduced flat buffer."""
        *grads, used = torch._C._nn.unflatten_dense_tensors(total, self._stand_ins)
        return grads, used, False
