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

from collections.abc import Sequence
from typing import Any

import torch

from crossdevice._arrays.packing import Pack
from crossdevice._comm.protocol import Done, Pending, Then
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._strategies.replica import ReplicaContext, all_reduce_async

__all__ = ["Reduced", "flat_reducible", "issue", "issue_flat"]

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
) -> Pending | None:
    """Issue a bucket's all-reduce as one flat buffer reduced where it lies (`Reduced`).

    Args:
        ctx: the running replica's context.
        op: SUM or MEAN.
        grads: this replica's gradient of each parameter of the bucket (None: none
            arrived: it adds zeros, and its `used` flag is 0); `flat_reducible`.
        params: the bucket's parameters (shapes, dtypes, devices).
        wire_dtype: the dtype gradients travel in between workers (None: their own).

    Returns:
        The pending all-reduce, or None where the strategy has no such path (nothing
        was issued: take `issue`).
    """
    reduce_flat = ctx.strategy.extended._replica_reduce_flat_async  # type: ignore[attr-defined]
    replica = ctx.replica_id_in_sync_group
    pending = reduce_flat(replica, op, _parts(grads, params), _leaves(params), wire_dtype)
    if pending is None:
        return None
    return Then([pending], lambda total: _views(total, params))


def issue(
    ctx: ReplicaContext,
    op: ReduceOp,
    grads: Sequence[torch.Tensor | None],
    params: Sequence[torch.nn.Parameter],
    shared: bool,
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
        reduced, one_buffer = extended._replica_all_reduce_shared(replica, op, [*local, used])
        return Done((reduced[:-1], reduced[-1], one_buffer))
    pending = all_reduce_async(ctx, op, [*local, used])
    return Then([pending], lambda reduced: (reduced[:-1], reduced[-1], False))


def flat_reducible(
    extended: Any, grads: Sequence[torch.Tensor | None], params: Sequence[torch.nn.Parameter]
) -> bool:
    """Whether a bucket may take the flat path: one floating dtype and device, no graph."""
    if not hasattr(extended, "_replica_reduce_flat_async"):
        return False
    first = params[0]
    if not first.dtype.is_floating_point:
        return False
    for p in params:
        if p.dtype != first.dtype or p.device != first.device:
            return False
    # Gradients that require grad (create_graph=True) are routed through autograd.
    return not any(g is not None and g.requires_grad for g in grads)


def _parts(
    grads: Sequence[torch.Tensor | None], params: Sequence[torch.nn.Parameter]
) -> list[torch.Tensor]:
    """The bucket's gradients flattened, in order, then the `used` flags (one flat buffer)."""
    first = params[0]
    parts = [
        p.new_zeros(p.numel()) if g is None else g.reshape(-1)
        for g, p in zip(grads, params, strict=True)
    ]
    parts.append(
        torch.tensor([g is not None for g in grads], dtype=first.dtype, device=first.device)
    )
    return parts


def _leaves(params: Sequence[torch.nn.Parameter]) -> tuple[Any, ...]:
    """What the flat buffer holds, for the workers to compare: each shape and dtype."""
    return (*((tuple(p.shape), str(p.dtype)) for p in params), ("used", len(params)))


def _views(total: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> Reduced:
    """Each parameter's reduced gradient as a view into the reduced flat buffer."""
    # The buffer's layout (`_parts`): the gradients in the parameters' shapes, then the
    # `used` flags.
    *grads, used = Pack.of([*(tuple(p.shape) for p in params), (len(params),)]).unpack(total)
    return grads, used, False
