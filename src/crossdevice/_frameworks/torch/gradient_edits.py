"""Changes to the all-reduced gradients before a step: every replica and worker alike.

After backward every replica holds the same reduced gradients; code between backward
and `step()` may change them (`clip_grad_norm_`, `p.grad.mul_(...)`, `p.grad = None`).
Made on every replica it trains as plain torch; made on some replicas or workers only
(`if replica_id == 0: clip_grad_norm_(...)`, `if rank == 0: ...`), each steps with its
own gradients and the "mirrored" parameters go apart, silently (the bug hunt of session
56: 0.25 apart after 3 steps with local copies, DDP's workers alike).

So each replica counts, when it steps, the changes made since the reduction to the
gradients it is about to use (`count`: the in-place writes each reduced `.grad`'s
version counter saw, and each one set to None; a replacement is refused at the step
already, `GradientSync.check_step`):

* local replicas with a copy each meet at their step (`step_check.StepCheck.meet`) and
  bring their counts; counts that differ are looked into (`check_local`): gradients that
  differ in value are an error naming each replica's count. Equal values pass (a
  `call_once` or cross-replica change that replica 0 made and the others copied counts
  differently and leaves the same gradients);
* across workers, replica 0's count goes into the next backward pass's state
  (`step_state.py`), compared with the gradients' all-reduce: a worker that changed its
  gradients alone fails on every worker, one update later, before any further update.

Changes alike in number but not in value (each worker clipping to its own norm) are not
seen across workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from crossdevice._frameworks.torch import step_state

__all__ = ["before_step", "check_local", "count"]


def before_step(groups: dict[Any, list[int]], replica: int, local: bool) -> int:
    """`replica`'s changes to its reduced gradients before this step, over `groups`.

    `groups`: each gradient sync and the optimizer's parameters among its. Counted where
    they are compared: across workers (recorded for the next pass, `step_state.edited`)
    and, with `local`, between local replicas with a copy each; 0 elsewhere.
    """
    total = 0
    for sync, indices in groups.items():
        watched = step_state.watched(sync)
        if sync.enabled and (watched or local):
            changes = count(sync, replica, indices)
            total += changes
            if watched:
                step_state.edited(sync, replica, changes)
    return total


def count(sync: Any, replica: int, indices: Sequence[int]) -> int:
    """Changes since the reduction to `replica`'s reduced gradients among `indices`.

    Each in-place write (the gradient's version counter) and each gradient set to None.
    Gradients not reduced in this step (set by hand, or none) count nothing.
    """
    state = sync._states[replica]
    params = sync.params(replica)
    synced, produced, versions = state.synced, state.produced, state.produced_version
    total = 0
    for index in indices:
        if not synced[index]:
            continue
        grad = params[index].grad
        if grad is None:
            total += 1
        elif grad is produced[index]():
            total += grad._version - versions[index]
    return total


def check_local(optimizers: Sequence[torch.optim.Optimizer], counts: Sequence[int]) -> None:
    """Local replicas' counts (`count`) at their step meeting: an error if they disagree.

    Counts that differ are checked by value: every replica's gradients against replica
    0's (the same tensors, None alike, equal values).

    Raises:
        RuntimeError: gradients that differ, naming each replica's count.
    """
    if len(set(counts)) < 2 or _same_gradients(optimizers):
        return
    each = ", ".join(f"replica {r}: {c}" for r, c in enumerate(counts))
    raise RuntimeError(
        "MirroredOptimizer.step(): the replicas changed their all-reduced gradients "
        f"differently before this step (in-place writes and gradients set to None: {each}), "
        "so each would update with its own gradients and the replicas would go apart. "
        "Make the same changes on every replica (clip_grad_norm_ on every replica, not "
        "under `if replica_id == 0`), or change them once for all replicas in "
        "crossdevice.torch.call_once(fn)"
    )


def _same_gradients(optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    first = _gradients(optimizers[0])
    for optimizer in optimizers[1:]:
        for a, b in zip(first, _gradients(optimizer), strict=True):
            if (a is None) != (b is None):
                return False
            if a is None or b is None:
                continue
            if not _equal(a, b):
                return False
    return True


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_sparse or b.is_sparse:
        a, b = a.coalesce().to_dense(), b.coalesce().to_dense()
    return a.shape == b.shape and torch.equal(a, b.to(a.device))


def _gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor | None]:
    return [p.grad for group in optimizer.param_groups for p in group["params"]]
