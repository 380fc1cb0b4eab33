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
"""

from __future__ import annotations

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


torch_patches.register(
    torch_patches.Patch(lambda: torch.nn.functional, "_no_grad_embedding_renorm_", _rescale_agreed)
)
