"""TF's loss-scaling helper: the per-example loss averaged over the global batch."""

from __future__ import annotations

import torch

from crossdevice._strategies.context import get_replica_context

__all__ = ["compute_average_loss"]


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
