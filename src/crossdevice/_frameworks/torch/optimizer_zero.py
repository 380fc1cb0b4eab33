"""`MirroredOptimizer.zero_grad` for one replica's parameters, as torch's own loop.

torch's `Optimizer.zero_grad` opens a profiler range on every call, the most of its
cost per step; a mirrored optimizer clears each replica's gradients with the same loop
without it (`zero`), where the class keeps torch's own `zero_grad` and no profiler
records (`plain_zero_grad`). Moved out of `optimizer.py` (at its line limit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

__all__ = ["plain_zero_grad", "zero"]


def plain_zero_grad(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.zero_grad` is torch's own and no profiler records its range."""
    return (
        type(optimizer).zero_grad is _TORCH_ZERO_GRAD
        and "zero_grad" not in optimizer.__dict__
        and not torch._C._autograd._profiler_enabled()
    )


_TORCH_ZERO_GRAD: Final = torch.optim.Optimizer.zero_grad


def zero(params: Sequence[torch.Tensor], set_to_none: bool) -> None:
    """`Optimizer.zero_grad` for one replica's parameters.

    As torch's: `set_to_none` drops each gradient; otherwise each leaves the graph and is
    zeroed in place, dense ones by one `torch._foreach_zero_` per device and dtype.
    """
    if set_to_none:
        for param in params:
            if param.grad is not None:
                param.grad = None
        return
    dense: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if grad.grad_fn is not None:
            grad.detach_()
        else:
            grad.requires_grad_(False)
        if grad.is_sparse:
            grad.zero_()
        else:
            dense.setdefault((grad.device, grad.dtype), []).append(grad)
    for grads in dense.values():
        torch._foreach_zero_(grads)
