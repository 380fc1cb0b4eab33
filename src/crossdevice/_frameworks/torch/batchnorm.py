"""`SyncBatchNorm`: batch normalisation over the global batch of every replica.

Plain BatchNorm normalises each replica's slice with that slice's statistics, which
differs from a single-device run over the global batch. `SyncBatchNorm` all-reduces the
per-channel sums (one collective for the mean, one for the variance: two passes keep the
variance accurate) and normalises with the global statistics, so training on N replicas
matches one device on the global batch. The all-reduces are differentiable
(`ReplicaContext.all_reduce`), so gradients flow through the global statistics. Running
statistics are updated from the global ones and stay equal on every replica. Outside
`strategy.run`, or on a single replica in sync, it is an ordinary BatchNorm.
"""

from __future__ import annotations

from typing import Any

import torch

from crossdevice._core import context

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """BatchNorm with statistics over every replica's batch (torch's `SyncBatchNorm`).

    Takes the arguments of `torch.nn.BatchNorm2d` and accepts inputs of any rank
    `(N, C, ...)`. Convert a model's BatchNorm layers with `convert_sync_batchnorm`.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"expected an input of at least 2 dimensions (N, C, ...), got {input.dim()}D"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise `input` with the global batch's statistics (in training mode)."""
        self._check_input_dim(input)
        frame = context.current_frame()
        ctx = None if frame is None else frame.replica_context
        use_batch_stats = self.training or not self.track_running_stats
        if ctx is None or ctx.num_replicas_in_sync == 1 or not use_batch_stats:
            return super().forward(input)
        dims = [0, *range(2, input.dim())]
        count = torch.tensor(
            float(input.numel() // input.shape[1]), dtype=input.dtype, device=input.device
        )
        total, n = ctx.all_reduce("sum", [input.sum(dims), count])
        mean = total / n
        shape = (1, -1, *([1] * (input.dim() - 2)))
        centred = input - mean.reshape(shape)
        (squares,) = ctx.all_reduce("sum", [(centred * centred).sum(dims)])
        var = squares / n
        if self.training and self.track_running_stats:
            assert self.running_mean is not None
            assert self.running_var is not None
            with torch.no_grad():
                self.num_batches_tracked.add_(1)  # type: ignore[union-attr]
                momentum = (
                    1.0 / float(self.num_batches_tracked)  # type: ignore[arg-type]
                    if self.momentum is None
                    else self.momentum
                )
                unbiased = var * (n / (n - 1).clamp(min=1))
                self.running_mean.lerp_(mean.detach(), momentum)
                self.running_var.lerp_(unbiased.detach(), momentum)
        out = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out


def convert_sync_batchnorm(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every BatchNorm layer of `module` by a `SyncBatchNorm` with its state.

    Returns the converted module (`module` itself unless it is a BatchNorm layer).
    """
    converted: Any = module
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, SyncBatchNorm
    ):
        like = next(iter([*module.parameters(), *module.buffers()]), None)
        floating = [t for t in (module.weight, module.running_mean) if t is not None]
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            device=None if like is None else like.device,
            dtype=floating[0].dtype if floating else None,
        )
        with torch.no_grad():
            if module.affine:
                converted.weight.copy_(module.weight)
                converted.bias.copy_(module.bias)
                converted.weight.requires_grad_(module.weight.requires_grad)
                converted.bias.requires_grad_(module.bias.requires_grad)
            if module.track_running_stats:
                converted.running_mean.copy_(module.running_mean)
                converted.running_var.copy_(module.running_var)
                converted.num_batches_tracked.copy_(module.num_batches_tracked)
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child))
    return converted
