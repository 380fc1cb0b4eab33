"""TF's loss-scaling helpers: the global batch's average loss, a regulariser's share."""

from __future__ import annotations

from typing import Any

import torch

from crossdevice._strategies.context import get_replica_context

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def compute_average_loss(
    per_example_loss: torch.Tensor, global_batch_size: int | None = None
) -> torch.Tensor:
    """`sum(per_example_loss) / global_batch_size` (`tf.nn.compute_average_loss`).

    With gradients SUMmed across replicas (crossdevice's and TF's default), each
    replica's loss must be its share of the global mean: divide by the global batch, not
    by the replica's own. Then N replicas give the gradient of one device's mean loss
    over the whole batch, also for a short last batch.

    Args:
        per_example_loss: the replica's per-example losses, shape `[batch, ...]`.
        global_batch_size: the number of examples in the step across all replicas;
            default: this replica's batch size times `num_replicas_in_sync` (exact only
            when every replica has a full slice).

    Returns:
        A scalar tensor.

    Raises:
        ValueError: a non-positive `global_batch_size`.
    """
    if global_batch_size is None:
        ctx = get_replica_context()
        replicas = 1 if ctx is None else ctx.num_replicas_in_sync
        global_batch_size = (
            per_example_loss.shape[0] * replicas if per_example_loss.dim() else replicas
        )
    if isinstance(global_batch_size, bool) or int(global_batch_size) != global_batch_size:
        raise ValueError(f"global_batch_size must be an int, got {global_batch_size!r}")
    if global_batch_size <= 0:
        if global_batch_size == 0 and per_example_loss.numel() == 0:
            return per_example_loss.sum()
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    return per_example_loss.sum() / global_batch_size


def scale_regularization_loss(regularization_loss: Any) -> torch.Tensor:
    """`sum(regularization_loss) / num_replicas_in_sync` (`tf.nn.scale_regularization_loss`).

    Every replica adds the regulariser (an L2 penalty on the weights) to its loss, and
    the gradients are SUMmed across replicas: added as it is, it would count once per
    replica. Scaled by this, the replicas' shares add up to it once, as on one device:
    `loss = compute_average_loss(per_example, global_batch) +
    scale_regularization_loss(l2)`.

    Args:
        regularization_loss: a tensor (summed), or a list of tensors (each summed, then
            added up).

    Returns:
        A scalar tensor.

    Raises:
        RuntimeError: called in cross-replica context of a strategy (TF's error): the
            replicas' shares are only meant inside `strategy.run`.
    """
    ctx = get_replica_context()
    if ctx is None:
        raise RuntimeError(
            "scale_regularization_loss was called in cross-replica context; call it inside "
            "the step function (strategy.run), where each replica adds its share to its loss"
        )
    if isinstance(regularization_loss, list | tuple):
        if not regularization_loss:
            raise ValueError("scale_regularization_loss got an empty list of losses")
        total = torch.stack([torch.as_tensor(x).sum() for x in regularization_loss]).sum()
    else:
        total = torch.as_tensor(regularization_loss).sum()
    # Times 1/N, not divided by N: a sum divided by N where N replicas happen to be the
    # length of what was summed reads as a local mean (`backward.py` warns of those).
    return total * (1.0 / ctx.num_replicas_in_sync)
