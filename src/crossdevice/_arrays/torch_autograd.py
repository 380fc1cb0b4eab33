"""Differentiable all-reduce and all-gather for torch tensors in a replica context.

TF's `ReplicaContext.all_reduce` is differentiable, with the rule that the gradient of a
SUM all-reduce is the SUM all-reduce of the upstream gradients (MEAN: the MEAN): the
training loss is the sum of every replica's loss, and every replica's input reaches
every replica's output. The gradient of an all-gather is the slice, for this replica's
part, of the SUM all-reduce of the upstream gradients. The backward collectives run on
each replica's thread inside its own backward pass, so every replica must run backward
through the same collectives, as it ran them forward.

The collectives themselves are given as functions (`reduce(op, tensors)`,
`gather(tensors, axis)`), so that this module, like the rest of the array layer, knows
nothing of replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from crossdevice._core.purpose import purpose
from crossdevice._sync import waiting as cooperative

__all__ = ["all_gather", "all_reduce", "needs_grad"]

Reduce = Callable[[Any, list[torch.Tensor]], list[torch.Tensor]]
#: The user's line that asked for a collective (`_cross_device/call_site.py`), or None.
Site = tuple[str, str, int] | None
Gather = Callable[[list[torch.Tensor], int], list[torch.Tensor]]

# What these collectives are for (`_core/purpose.py`): replicas compare it, so one whose
# value requires grad never meets another's plain collective, and a backward pass's
# all-reduce never meets a forward collective of the same shapes (a sum of unrelated
# values, silently, before: TF pairs its collectives by order alone). Across workers
# they carry the user's line that asked for the forward one (the stack walk would find
# torch's `Function.apply` for all of them), the backward's tagged apart.
_FORWARD = (
    "a differentiable collective (its values require grad: every replica's must, or "
    "none's; detach() them where no gradient should flow)"
)
_BACKWARD = (
    "the backward pass of a differentiable all_reduce or all_gather (every replica must "
    "run backward through it, in the same order)"
)
_BACKWARD_TAG = 1
_FORWARD_TAG = 2


def needs_grad(leaves: Sequence[Any]) -> bool:
    """Whether grad mode is on and a torch leaf requires grad (the differentiable path)."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)


def _filled(grads: Sequence[torch.Tensor | None], like: Sequence[Any]) -> list[torch.Tensor]:
    """The upstream gradients, zeros where autograd passed none (every replica must send)."""
    return [
        g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
        for g, (shape, dtype, device) in zip(grads, like, strict=True)
    ]


def _check_backward_thread() -> None:
    if cooperative.in_cooperative_replica():
        raise RuntimeError(
            "the backward pass of a differentiable all_reduce/all_gather ran on a "
            "cooperative replica: torch's autograd engine keeps per-thread state that "
            "replicas taking turns on one thread would mix. Run this step on replica "
            "threads: crossdevice.config.set_replica_execution('threads')"
        )


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, reduce: Reduce, op: Any, site: Site, *tensors: torch.Tensor) -> Any:
        ctx.reduce = reduce
        ctx.op = op
        ctx.site = site
        ctx.like = [(t.shape, t.dtype, t.device) for t in tensors]
        with purpose(_FORWARD, _FORWARD_TAG, site):
            return tuple(reduce(op, [t.detach() for t in tensors]))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        _check_backward_thread()
        filled = _filled(grads, ctx.like)
        with purpose(_BACKWARD, _BACKWARD_TAG, ctx.site):
            return (None, None, None, *ctx.reduce(ctx.op, filled))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        gather: Gather,
        reduce: Reduce,
        sum_op: Any,
        axis: int,
        index: int,
        sizes: list[list[int]],
        site: Site,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.site = site
        ctx.reduce = reduce
        ctx.sum_op = sum_op
        ctx.axis = axis
        ctx.index = index
        ctx.sizes = sizes
        with purpose(_FORWARD, _FORWARD_TAG, site):
            gathered = tuple(gather([t.detach() for t in tensors], axis))
        ctx.like = [(t.shape, t.dtype, t.device) for t in gathered]
        return gathered

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        _check_backward_thread()
        filled = _filled(grads, ctx.like)
        with purpose(_BACKWARD, _BACKWARD_TAG, ctx.site):
            summed = ctx.reduce(ctx.sum_op, filled)
        out = []
        for total, sizes in zip(summed, ctx.sizes, strict=True):
            start = sum(sizes[: ctx.index])
            axis = ctx.axis % total.dim() if total.dim() else 0
            out.append(total.narrow(axis, start, sizes[ctx.index]))
        return (None, None, None, None, None, None, None, *out)


def all_reduce(
    reduce: Reduce, op: Any, tensors: list[torch.Tensor], site: Site = None
) -> list[torch.Tensor]:
    """`reduce(op, tensors)` with TF's gradient (the same all-reduce of the gradients).

    `site`: the user's line that asked for it (None: walk the stack).
    """
    return list(_AllReduce.apply(reduce, op, site, *tensors))  # type: ignore[no-untyped-call]


def all_gather(
    gather: Gather,
    reduce: Reduce,
    sum_op: Any,
    tensors: list[torch.Tensor],
    axis: int,
    index: int,
    site: Site = None,
) -> list[torch.Tensor]:
    """`gather(tensors, axis)` with TF's gradient (this replica's slice of the summed grads).

    Args:
        gather: the non-differentiable all-gather.
        reduce: the non-differentiable all-reduce (for the backward pass).
        sum_op: the SUM reduce op to pass to `reduce`.
        tensors: this replica's tensors.
        axis: the axis to concatenate along.
        index: this replica's position among the gathered parts.
        site: the user's line that asked for it (None: walk the stack).
    """
    # Every replica's size along `axis`, for each tensor: parts may differ in size.
    local = [torch.tensor([t.shape[axis] if t.dim() else 1]) for t in tensors]
    with purpose(_FORWARD, _FORWARD_TAG, site):
        gathered_sizes = gather(local, 0)
    sizes = [[int(s) for s in g.tolist()] for g in gathered_sizes]
    return list(_AllGather.apply(gather, reduce, sum_op, axis, index, sizes, site, *tensors))  # type: ignore[no-untyped-call]
