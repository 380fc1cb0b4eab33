"""Which local replica's copy of a mirrored module each parameter is.

Code that takes parameters by hand (`params = list(model.parameters())` before
`prepare`, then `clip_grad_norm_(params, ...)` inside the step) hands every replica the
same tensors: replica 0's, the original module's own. `once.py`'s gradient clipping maps
them to the right gradients: where the replicas keep one shared reduced gradient, to
replica 0's (`canonical`: clipped once for all); with a copy per replica
(`share_storage=False`, every GPU layout), to the running replica's own copies
(`own_copies`). Without that map, every replica clipped replica 0's gradients (4 times
on 4 replicas, from 4 threads at once) and left its own unclipped: replicas 0.5 apart
after 6 steps, silently (the bug hunt of session 53). Torch's two-step clipping reads
the gradients first (`get_total_norm([p.grad for p in params])`): with a copy per
replica those map to the running replica's own gradients (`own_gradients`), or a replica
later than replica 0 took the norm of gradients replica 0 had clipped already.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["canonical", "own_copies", "own_gradients", "register"]

# id(parameter) -> (its GradientSync, the local replica, its index there), for every
# parameter of every mirrored module (a finalizer removes the entry).
_OWNERS: dict[int, tuple[weakref.ref[Any], int, int]] = {}


def register(sync: Any, params: Sequence[Sequence[torch.nn.Parameter]]) -> None:
    """`params[r][k]` is parameter k of replica r of `sync`'s mirrored module."""
    ref = weakref.ref(sync)
    for replica, replica_params in enumerate(params):
        for index, param in enumerate(replica_params):
            _OWNERS[id(param)] = (ref, replica, index)
            weakref.finalize(param, _OWNERS.pop, id(param), None)


def canonical(params: Sequence[Any]) -> list[torch.nn.Parameter] | None:
    """Replica 0's parameters for `params`, if every one keeps a shared gradient, else None.

    Code that changes gradients in place once for all replicas (`once.py`'s gradient
    clipping) applies it to replica 0's parameters, whose gradients every replica sees.
    """
    found = []
    for param in params:
        entry = _OWNERS.get(id(param))
        sync = entry[0]() if entry is not None else None
        if sync is None or not sync.shared:
            return None
        assert entry is not None
        found.append(sync.params(0)[entry[2]])
    return found if found else None


def own_copies(params: Sequence[Any], replica: int) -> list[Any]:
    """`params`, each mirrored parameter (any local replica's copy) as `replica`'s copy.

    Other tensors stay as they are.
    """
    out = []
    for param in params:
        entry = _OWNERS.get(id(param))
        sync = entry[0]() if entry is not None else None
        out.append(param if sync is None or entry is None else sync.params(replica)[entry[2]])
    return out


def own_gradients(tensors: Sequence[Any], replica: int) -> list[Any]:
    """`tensors`, each gradient of another replica's copy as `replica`'s copy's gradient.

    Only parameters kept per replica map (with a shared gradient every replica reads the
    same one); other tensors stay as they are.
    """
    wanted = {id(t) for t in tensors}
    found: dict[int, Any] = {}
    for ref, other, index in list(_OWNERS.values()):
        sync = ref()
        if other == replica or sync is None or sync.shared:
            continue
        grad = sync.params(other)[index].grad
        if grad is not None and id(grad) in wanted:
            found[id(grad)] = sync.params(replica)[index].grad
    return [found.get(id(t), t) for t in tensors]
