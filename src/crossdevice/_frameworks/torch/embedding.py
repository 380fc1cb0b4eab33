"""`max_norm` embeddings rescale the rows of the whole global batch, on every replica.

`torch.nn.Embedding(max_norm=...)` (and `F.embedding`, `F.embedding_bag` with `max_norm`)
rescales in place the weight rows its input looks up, before the lookup: on one device,
every row of the global batch. A replica sees its own slice only. Left alone, each
replica would rescale its own rows: with a copy per replica the copies drift apart for
good, silently (each replica's write count is the same, so the mirror's check cannot
tell); with storage shared, every replica would write the one weight at once. DDP has
the same gap between processes.

So inside `strategy.run`, with several replicas in sync, the rescaling is one
`merge_call`: every replica's rows are gathered (across workers too), and the rows of all
of them are rescaled on every replica's weight (once where the replicas share it). Each
row is rescaled by itself, from its own values, so this is bitwise what one device does
with the global batch. The same holds for copies a user made and declared
(`mark_replica_copy`: copies of one model) and for one embedding that every replica
shares (allowed in eval mode under `no_grad`, where `max_norm` still writes): rescaled
once. Per-replica modules that are neither are refused before they run
(`_arrays/torch_guard.py`). Outside `run`, with one replica, and while `torch.compile`
traces, torch's function runs as it is.

`scale_grad_by_freq=True` divides each row's gradient by how often the row occurs in the
lookup: on one device, in the global batch's lookup. A replica's own backward would
count its slice only (DDP has the same gap). So the lookup is made with
`scale_grad_by_freq=False` on the weight seen through `_RowScale`, whose backward divides
each row's gradient by the row's count over every replica's (and worker's) indices,
gathered in one `all_gather`: each replica's gradient is its share of plain torch's
(`grad_local(row) / count_global(row)`), and the gradient reduction adds them up to it.
The lookups of the replicas are counted as slices of one global lookup (as
`SyncBatchNorm` takes their batches): a lookup that every replica makes with the same
indices is counted once per replica, which one device does for identical slices of its
batch but not for indices every replica builds alike (positions); that case warns.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any, Final

import torch

from crossdevice._arrays import torch_patches
from crossdevice._core import context
from crossdevice._values.values import PerReplica

__all__: list[str] = []

_is_compiling: Final = torch.compiler.is_compiling


def _rescale_agreed(original: Callable[..., Any]) -> Callable[..., Any]:
    def rescale(weight: Any, input: Any, max_norm: float, norm_type: float) -> Any:
        frame = context.current_frame()
        if (
            _is_compiling()
            or frame is None
            or frame.replica_context is None
            or frame.strategy.num_replicas_in_sync == 1
        ):
            return original(weight, input, max_norm, norm_type)
        ctx = frame.replica_context
        every = torch.unique(ctx.all_gather(torch.unique(input.reshape(-1)), axis=0))

        def merge_fn(strategy: Any, weights: Any) -> None:
            del strategy
            done: set[tuple[int, torch.device]] = set()
            for w in weights.values if isinstance(weights, PerReplica) else [weights]:
                where = (w.data_ptr(), w.device)
                if where not in done:  # storage shared: rescaled once
                    done.add(where)
                    original(w, every.to(w.device), max_norm, norm_type)

        ctx.merge_call(merge_fn, (weight,))
        return None

    rescale.__doc__ = original.__doc__
    rescale.__wrapped__ = original  # type: ignore[attr-defined]
    return rescale


class _RowScale(torch.autograd.Function):
    """The weight as it is, whose gradient rows are multiplied by `scale` on the way back."""

    @staticmethod
    def forward(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return weight.view_as(weight)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        scale = ctx.scale.to(grad.dtype).unsqueeze(1)
        return grad * scale, None


#: The ids of the live weights already warned about a lookup every replica made alike.
_WARNED: Final[set[int]] = set()


def _global_scale(frame: Any, weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """1 / each row's count over every replica's `indices` (1 for rows none looks up)."""
    rows, counts = torch.unique(indices.reshape(-1), return_counts=True)
    # One block per replica, its length first: the gathered blocks can be told apart.
    header = torch.tensor([[rows.numel(), 0]], dtype=torch.int64, device=rows.device)
    mine = torch.cat([header, torch.stack([rows.to(torch.int64), counts.to(torch.int64)], 1)])
    every = frame.replica_context.all_gather(mine, axis=0).to(weight.device)
    total = torch.zeros(weight.shape[0], dtype=torch.int64, device=weight.device)
    blocks, at = [], 0
    while at < every.shape[0]:
        size = int(every[at, 0])
        block = every[at + 1 : at + 1 + size]
        total.index_add_(0, block[:, 0], block[:, 1])
        blocks.append(block)
        at += 1 + size
    if frame.local_replica_id == 0 and all(torch.equal(blocks[0], b) for b in blocks[1:]):
        _warn_alike(weight, len(blocks))  # (each worker's first replica: once per process)
    dtype = torch.promote_types(weight.dtype, torch.float32)  # half: counts in float
    scale = torch.ones(weight.shape[0], dtype=dtype, device=weight.device)
    seen = total > 0
    scale[seen] = 1.0 / total[seen].to(dtype)
    return scale


def _warn_alike(weight: torch.Tensor, replicas: int) -> None:
    if id(weight) in _WARNED:  # (replica 0's weight: one thread)
        return
    _WARNED.add(id(weight))
    weakref.finalize(weight, _WARNED.discard, id(weight))
    warnings.warn(
        f"every one of the {replicas} replicas in sync looked up the same indices in an "
        "embedding with scale_grad_by_freq=True. Each lookup is counted as one replica's "
        "slice of the global batch's lookup (each row's gradient divided by its count over "
        "every replica, as one device does for the concatenated batch); indices that every "
        "replica builds alike (positions) are counted once on one device: pass "
        "scale_grad_by_freq=False for such a lookup (with distinct indices it changes "
        "nothing). (Given once per embedding.)",
        UserWarning,
        stacklevel=4,
    )


def _scaled_lookup(weight: Any, indices: Any, sparse: Any) -> Any:
    """`weight` seen through `_RowScale` with the global counts, or None (count locally).

    None outside `strategy.run`, with one replica in sync, while `torch.compile` traces,
    when no gradient flows to the weight, and for sparse gradients (which torch's
    backward refuses to scale: the lookup as it is raises torch's own error there).
    """
    if (
        _is_compiling()
        or sparse
        or not (torch.is_grad_enabled() and getattr(weight, "requires_grad", False))
    ):
        return None
    frame = context.current_frame()
    if frame is None or frame.replica_context is None or frame.strategy.num_replicas_in_sync == 1:
        return None
    scale = _global_scale(frame, weight, indices)
    return _RowScale.apply(weight, scale)  # type: ignore[no-untyped-call]


def _embedding_agreed(original: Callable[..., Any]) -> Callable[..., Any]:
    def embedding(
        weight: Any,
        indices: Any,
        padding_idx: int = -1,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> Any:
        if scale_grad_by_freq:
            scaled = _scaled_lookup(weight, indices, sparse)
            if scaled is not None:
                return original(scaled, indices, padding_idx, False, sparse)
        return original(weight, indices, padding_idx, scale_grad_by_freq, sparse)

    embedding.__doc__ = original.__doc__
    embedding.__wrapped__ = original  # type: ignore[attr-defined]
    return embedding


def _embedding_bag_agreed(original: Callable[..., Any]) -> Callable[..., Any]:
    def embedding_bag(
        weight: Any,
        indices: Any,
        offsets: Any,
        scale_grad_by_freq: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        # F.embedding_bag calls torch.embedding_bag(weight, indices, offsets,
        # scale_grad_by_freq, mode, sparse, per_sample_weights, include_last_offset,
        # padding_idx); torch refuses scale_grad_by_freq in mode "max" before this
        if scale_grad_by_freq:
            sparse = args[1] if len(args) > 1 else kwargs.get("sparse", False)
            scaled = _scaled_lookup(weight, indices, sparse)
            if scaled is not None:
                return original(scaled, indices, offsets, False, *args, **kwargs)
        return original(weight, indices, offsets, scale_grad_by_freq, *args, **kwargs)

    embedding_bag.__doc__ = original.__doc__
    embedding_bag.__wrapped__ = original  # type: ignore[attr-defined]
    return embedding_bag


torch_patches.register(
    torch_patches.Patch(lambda: torch.nn.functional, "_no_grad_embedding_renorm_", _rescale_agreed),
    torch_patches.Patch(lambda: torch, "embedding", _embedding_agreed),
    torch_patches.Patch(lambda: torch, "embedding_bag", _embedding_bag_agreed),
)
