"""`prepare`: mirror a model and its optimizer in one call (Accelerate's `prepare`)."""

from __future__ import annotations

from typing import Any

import torch

from crossdevice._core.reduce_op import ReduceOp
from crossdevice._frameworks.torch.gradients import DEFAULT_BUCKET_CAP_BYTES
from crossdevice._frameworks.torch.module import MirroredModule
from crossdevice._frameworks.torch.optimizer import MirroredOptimizer
from crossdevice._frameworks.torch.replicas import strategy_or_current
from crossdevice._strategies.base import Strategy

__all__ = ["prepare"]


def prepare(
    *objects: Any,
    strategy: Strategy | None = None,
    gradient_reduction: ReduceOp | str = ReduceOp.SUM,
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
    sync_buffers: bool = True,
    threads_per_replica: int | None = None,
) -> Any:
    """Mirror modules and optimizers on a strategy; returns them in the order given.

    Modules become `MirroredModule`s, optimizers `MirroredOptimizer`s over those modules'
    parameters. Call it once, in cross-replica context (under `strategy.scope()`, or pass
    `strategy`), then use the returned objects inside `strategy.run`.

    Args:
        *objects: `torch.nn.Module`s and `torch.optim.Optimizer`s.
        strategy: the strategy; default: the current one.
        gradient_reduction: `"sum"` (TF: per-example loss / global batch size) or
            `"mean"` (DDP: each replica's mean loss).
        bucket_cap_bytes: gradient bucket size (see `MirroredModule`).
        sync_buffers: average BatchNorm-style buffers across replicas each step.
        threads_per_replica: torch intra-op threads per parallel replica (None: cores //
            replicas; 0: leave torch's setting).

    Returns:
        The mirrored object for one argument, else a tuple in argument order.

    Raises:
        TypeError: an argument is neither a module nor an optimizer.

    Example:
        >>> import crossdevice, crossdevice.torch, torch
        >>> strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with strategy.scope():
        ...     model = torch.nn.Linear(4, 2)
        ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     model, optimizer = crossdevice.torch.prepare(model, optimizer)
        >>> type(model).__name__, type(optimizer).__name__
        ('MirroredModule', 'MirroredOptimizer')
    """
    strategy = strategy_or_current(strategy, "crossdevice.torch.prepare")
    modules: list[MirroredModule] = []
    out: list[Any] = []
    for obj in objects:
        if isinstance(obj, MirroredModule):
            modules.append(obj)
            out.append(obj)
        elif isinstance(obj, torch.nn.Module):
            mirrored = MirroredModule(
                obj,
                strategy,
                gradient_reduction=gradient_reduction,
                bucket_cap_bytes=bucket_cap_bytes,
                sync_buffers=sync_buffers,
                threads_per_replica=threads_per_replica,
            )
            modules.append(mirrored)
            out.append(mirrored)
        elif isinstance(obj, torch.optim.Optimizer):
            out.append(obj)
        else:
            raise TypeError(
                "crossdevice.torch.prepare takes torch.nn.Module and torch.optim.Optimizer "
                f"objects, got {type(obj).__name__}: {obj!r}"
            )
    for k, obj in enumerate(out):
        if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, MirroredOptimizer):
            if not modules:
                raise ValueError(
                    "crossdevice.torch.prepare got an optimizer but no module: pass the "
                    "model with its optimizer, prepare(model, optimizer)"
                )
            out[k] = MirroredOptimizer(obj, modules)
    return out[0] if len(out) == 1 else tuple(out)
