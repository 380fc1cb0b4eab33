"""TF's loss-scaling helpers (`tf.nn.compute_average_loss`, `scale_regularization_loss`).

One implementation for NumPy arrays and torch tensors: `crossdevice.nn` exports it for
any value, `crossdevice.torch` for torch tensors. With gradients SUMmed across replicas
(crossdevice's and TF's default), each replica's loss must be its share of the global
mean: the sum of its per-example losses divided by the global batch, not by its own.

Where TF is looser, these are strict (docs/porting.md): a non-integer
`global_batch_size` (10.0) is refused as in TF, but so is 0 with losses to average (TF's
`div_no_nan` returns 0: a step that silently trains on nothing); weights multiply the
losses in the losses' own dtype (TF casts both to float32 first, losing float64's
precision).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from crossdevice._arrays import NUMPY, is_torch
from crossdevice._core.validate import describe
from crossdevice._strategies.context import get_replica_context

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def compute_average_loss(
    per_example_loss: Any, sample_weight: Any = None, global_batch_size: Any = None
) -> Any:
    """`sum(per_example_loss * sample_weight) / global_batch_size` (TF's, in a replica).

    Then N replicas give the gradient of one device's mean loss over the whole batch,
    also for a short last batch (pass the step's real global batch size).

    Args:
        per_example_loss: the replica's per-example losses, shape `[batch, ...]` (a NumPy
            array, a torch tensor, or a list of Python numbers: float32, as TF).
        sample_weight: optional weights, broadcast to the losses' shape as TF does (a
            scalar, the losses' shape, one dimension fewer: `[batch]` for `[batch, T]`, or
            one more of size 1: `[batch, 1]` for `[batch]`).
        global_batch_size: the number of examples in the step across all replicas (an
            integer); default: this replica's batch size times `num_replicas_in_sync`
            (exact only when every replica has a full slice).

    Returns:
        A scalar of the losses' kind (NumPy or torch) and dtype.

    Raises:
        TypeError: an integer `sample_weight` without `global_batch_size`: TF's order puts
            the weights second, so `compute_average_loss(losses, 64)` is refused (it
            would weigh every loss 64 times) rather than read as a batch size.
        RuntimeError: no `global_batch_size`, in cross-replica context of a strategy
            (TF's error): the replica count says nothing about a batch there.
        ValueError: a scalar `per_example_loss` (already averaged: TF refuses it too),
            weights that do not broadcast to the losses, or a `global_batch_size` that is
            not a non-negative integer (0 only for no losses at all).
    """
    if isinstance(sample_weight, numbers.Integral) and global_batch_size is None:
        raise TypeError(
            "compute_average_loss's second argument is sample_weight, as in TF; got the "
            f"integer {sample_weight!r}. Pass the global batch size by name: "
            f"compute_average_loss(per_example_loss, global_batch_size={sample_weight!r})"
        )
    torch_values = is_torch(per_example_loss) or is_torch(sample_weight)
    losses = _as_array(per_example_loss, torch_values)
    if losses.ndim == 0:
        raise ValueError(
            "compute_average_loss expects per-example losses, a tensor of rank 1 or more "
            f"(shape [batch, ...]); got a scalar, {describe(per_example_loss)}. Pass the "
            "losses before any mean (e.g. reduction='none'), as tf.nn.compute_average_loss"
        )
    if sample_weight is not None:
        losses = losses * _weights(_as_array(sample_weight, torch_values), losses)
    if global_batch_size is None:
        ctx = get_replica_context()
        if ctx is None:
            raise RuntimeError(
                "compute_average_loss was called in cross-replica context without a "
                "global_batch_size, so the number of replicas says nothing about the batch. "
                "Call it inside the step function (strategy.run), or pass global_batch_size"
            )
        global_batch_size = losses.shape[0] * ctx.num_replicas_in_sync
    size = _batch_size(global_batch_size)
    total = losses.sum()
    if size == 0:
        if _numel(losses) == 0:
            return total
        raise ValueError(
            f"compute_average_loss got global_batch_size=0 for {_numel(losses)} losses: "
            "expected the number of examples in the step across all replicas. (TF returns "
            "0 here, training on nothing without a word.) Pass the step's global batch size"
        )
    return total / size


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """`sum(regularization_loss) / num_replicas_in_sync` (`tf.nn.scale_regularization_loss`).

    Every replica adds the regulariser (an L2 penalty on the weights) to its loss, and
    the gradients are SUMmed across replicas: added as it is, it would count once per
    replica. Scaled by this, the replicas' shares add up to it once, as on one device:
    `loss = compute_average_loss(per_example, global_batch_size=global_batch) +
    scale_regularization_loss(l2)`.

    Args:
        regularization_loss: an array or tensor (summed), or a list of them (each summed,
            then added up).

    Returns:
        A scalar of the values' kind (NumPy or torch).

    Raises:
        RuntimeError: called in cross-replica context of a strategy (TF's error): the
            replicas' shares are only meant inside `strategy.run`.
        ValueError: an empty list.
    """
    ctx = get_replica_context()
    if ctx is None:
        raise RuntimeError(
            "scale_regularization_loss was called in cross-replica context; call it inside "
            "the step function (strategy.run), where each replica adds its share to its loss"
        )
    parts = regularization_loss if isinstance(regularization_loss, list | tuple) else None
    if parts is not None and not parts:
        raise ValueError("scale_regularization_loss got an empty list of losses")
    items = [regularization_loss] if parts is None else list(parts)
    torch_values = any(is_torch(x) for x in items)
    sums = [_as_array(x, torch_values).sum() for x in items]
    total = sums[0]
    for part in sums[1:]:
        total = total + part
    # Times 1/N, not divided by N: a sum divided by N where N replicas happen to be the
    # length of what was summed reads as a local mean (`backward.py` warns of those).
    return total * (1.0 / ctx.num_replicas_in_sync)


def _as_array(x: Any, torch_values: bool) -> Any:
    if torch_values:
        import torch

        return x if isinstance(x, torch.Tensor) else torch.as_tensor(NUMPY.asarray(x))
    return NUMPY.asarray(x)


def _numel(x: Any) -> int:
    return int(np.prod(x.shape))


def _weights(weights: Any, losses: Any) -> Any:
    """`weights` shaped to multiply `losses` (TF's `squeeze_or_expand_dimensions` rule)."""
    rank, wrank = losses.ndim, weights.ndim
    if wrank == rank + 1 and weights.shape[-1] == 1:
        weights = weights[..., 0]  # [batch, 1] for [batch]
    elif wrank == rank - 1 and wrank > 0:
        weights = weights[..., None]  # [batch] for [batch, T]
    try:
        shape = np.broadcast_shapes(tuple(weights.shape), tuple(losses.shape))
    except ValueError:
        shape = None
    if shape != tuple(losses.shape):
        raise ValueError(
            f"compute_average_loss: sample_weight of shape {tuple(weights.shape)} does not "
            f"broadcast to the losses' shape {tuple(losses.shape)}; expected a scalar, the "
            "losses' shape, or the batch's shape ([batch] or [batch, 1])"
        )
    if is_torch(losses):
        return weights.to(dtype=losses.dtype, device=losses.device)
    return weights.astype(losses.dtype, copy=False)


def _batch_size(value: Any) -> int:
    """`value` as a non-negative int: Python, NumPy or a one-element integer tensor."""
    if is_torch(value) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    elif isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"global_batch_size must be an integer (the examples in the step across all "
            f"replicas), got {describe(value)}"
        )
    if int(value) < 0:
        raise ValueError(f"global_batch_size must be non-negative, got {int(value)}")
    return int(value)
