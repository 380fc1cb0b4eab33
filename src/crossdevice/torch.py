"""PyTorch models trained data-parallel on crossdevice strategies.

    >>> import crossdevice, crossdevice.torch, torch
    >>> strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
    >>> with strategy.scope():
    ...     model = torch.nn.Linear(4, 1)
    ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ...     model, optimizer = crossdevice.torch.prepare(model, optimizer)
    >>> def step(x, y):
    ...     per_example = (model(x) - y).pow(2).squeeze(1)
    ...     loss = crossdevice.torch.compute_average_loss(per_example, global_batch_size=8)
    ...     optimizer.zero_grad()
    ...     loss.backward()          # gradients are all-reduced across replicas here
    ...     optimizer.step()         # every replica applies the same update
    ...     return loss
    >>> x, y = torch.ones(8, 4), torch.zeros(8, 1)
    >>> data = strategy.experimental_distribute_values_from_function(
    ...     lambda ctx: (x[ctx.replica_id_in_sync_group::2], y[ctx.replica_id_in_sync_group::2]))
    >>> _ = strategy.run(step, args=data)

`prepare` mirrors a module (one copy per replica, the same initial values on every
worker) and its optimizer (one copy per replica, per-replica state). Inside
`strategy.run` the mirrored objects use the running replica's copy; gradients are
all-reduced during backward, so the copies stay bitwise identical. Using an unprepared
module with trainable parameters, or an unprepared optimizer, inside `strategy.run` of
several replicas is an error naming `prepare` (`mark_replica_copy` declares copies you
made yourself). Shared objects that change when called (LR schedulers, averaged models,
`call_once` for your own) change once per step. Importing this module needs torch.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without torch
    raise ImportError(
        "crossdevice.torch needs PyTorch: pip install 'crossdevice[torch]' (on a CPU-only "
        "machine first pip install torch==2.13.0, or the CPU wheel for your platform)"
    ) from exc

from crossdevice._arrays.torch_random import replica_generator as replica_generator
from crossdevice._core.exports import fix_module_metadata as _fix_module_metadata
from crossdevice._frameworks.torch.batchnorm import SyncBatchNorm as SyncBatchNorm
from crossdevice._frameworks.torch.batchnorm import (
    convert_sync_batchnorm as convert_sync_batchnorm,
)
from crossdevice._frameworks.torch.gradients import (
    DEFAULT_BUCKET_CAP_BYTES as DEFAULT_BUCKET_CAP_BYTES,
)
from crossdevice._frameworks.torch.module import MirroredModule as MirroredModule
from crossdevice._frameworks.torch.once import call_once as call_once
from crossdevice._frameworks.torch.optimizer import MirroredOptimizer as MirroredOptimizer
from crossdevice._frameworks.torch.prepare import mark_replica_copy as mark_replica_copy
from crossdevice._frameworks.torch.prepare import prepare as prepare
from crossdevice._frameworks.torch.scaler import MirroredGradScaler as MirroredGradScaler
from crossdevice._frameworks.torch.threads import (
    default_threads_per_replica as default_threads_per_replica,
)
from crossdevice._strategies.losses import compute_average_loss as compute_average_loss
from crossdevice._strategies.losses import scale_regularization_loss as scale_regularization_loss

__all__ = [
    "DEFAULT_BUCKET_CAP_BYTES",
    "MirroredGradScaler",
    "MirroredModule",
    "MirroredOptimizer",
    "SyncBatchNorm",
    "call_once",
    "compute_average_loss",
    "convert_sync_batchnorm",
    "default_threads_per_replica",
    "mark_replica_copy",
    "prepare",
    "replica_generator",
    "scale_regularization_loss",
]


# The loss helpers are `crossdevice.nn`'s (they take NumPy arrays too): they keep its name.
_fix_module_metadata(
    globals(),
    [n for n in __all__ if n not in ("compute_average_loss", "scale_regularization_loss")],
    "crossdevice.torch",
)
