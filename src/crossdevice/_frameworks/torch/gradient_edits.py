"""Changes to the all-reduced gradients before a step: every replica and worker alike.

After backward every replica holds the same reduced gradients; code between backward
and `step()` may change them (`clip_grad_norm_`, `p.grad.mul_(...)`, `p.grad = None`).
Made on every replica it trains as plain torch; made on some replicas or workers only
(`if replica_id == 0: clip_grad_norm_(...)`, `if rank == 0: ...`), each steps with its
own gradients and the "mirrored" parameters go apart, silently (the bug hunt of session
56: 0.25 apart after 3 steps with local copies, DDP's workers alike). So do changes
made on every replica alike in number but not in value: noise from each replica's own
random stream (`p.grad.add_(torch.randn_like(p.grad) * 0.01)`: gradient noise, SGLD),
a scale that depends on the replica or the worker, each worker clipping to its own
norm (session 58: copies 0.04 apart after 5 steps of such noise, two workers 0.07 after 3).

So each replica takes, when it steps, the changes made since the reduction to the
gradients it is about to use (`changes`: the in-place writes each reduced `.grad`'s
version counter saw, and each one set to None; a replacement is refused at the step
already, `GradientSync.check_step`), and a fingerprint of each changed gradient's bits
(`step_check.gradient_prints`: an exact integer sum of its words, the same on every
CPU and thread count; one pass over the gradient, no more than clipping's own):

* local replicas meet at their step (`step_check.StepCheck.meet`): where any replica
  changed a gradient, each gradient any of them changed is compared between all of them
  by its print (`step_check.check_edits`), and gradients that differ are an error naming
  each, with every replica's count and what it holds. Counts may differ (a `call_once`
  change that replica 0 made and the others copied counts differently and leaves the
  same gradients). Where the replicas share storage the one step reads replica 0's
  gradients: after gradient accumulation each replica holds its own, and a change made
  on another replica (`if replica_id == 1: p.grad.mul_(0)`, its own noise) was dropped,
  silently (session 58); it is compared so too. Without accumulation they keep one
  reduced gradient, which a replica other than 0 may not change (`GradientSync.
  check_step`): nothing to compare;
* across workers, replica 0's count and prints (each changed gradient's name and print)
  go into the next backward pass's state (`step_state.py`), compared with the
  gradients' all-reduce: a worker that changed its gradients alone, or otherwise than
  the others, fails on every worker, one update later, before any further update.

Compared bitwise: deterministic changes made alike (`clip_grad_norm_` to the global
norm, `mul_` by a constant, noise from a generator seeded alike on every replica and
worker) leave the same bits and pass; NaNs agree where their bits do, -0.0 differs
from 0.0. Gradients of one flat bucket share a version counter, so a write to one
counts for each of them and each is printed (more work, never an error).

Not seen: writes that no version counter records (`p.grad.data.mul_(...)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from crossdevice._frameworks.torch import step_state
from crossdevice._frameworks.torch.step_check import Edited, gradient_prints

__all__ = ["before_step", "changes"]


def before_step(groups: dict[Any, list[int]], replica: int, local: bool) -> Edited:
    """`replica`'s changes to its reduced gradients before this step, over `groups`.

    `groups`: each gradient sync and the optimizer's parameters among its. Taken where
    they are compared: across workers (replica 0's recorded for the next pass,
    `step_state.edited`) and, with `local`, between local replicas (`_own`: those
    each holds on its own); nothing elsewhere.
    """
    edited = Edited()
    for sync, indices in groups.items():
        watched = step_state.watched(sync)
        if not sync.enabled or not (watched or local):
            continue
        count, changed = changes(sync, replica, indices)
        own = _own(sync, replica, changed) if local else []
        # Replica 0's go across workers (what the one step reads), each replica's own here.
        printed = changed if watched and replica == 0 else own
        params = sync.params(replica)
        prints = dict(zip(printed, gradient_prints([params[i].grad for i in printed]), strict=True))
        if own:
            edited.count += count
            edited.prints.update(((sync, i), prints[i]) for i in own)
        if watched:
            names = sync._names
            shown = tuple((names[i], prints[i]) for i in changed) if replica == 0 else ()
            step_state.edited(sync, replica, count, shown)
    return edited


def _own(sync: Any, replica: int, changed: list[int]) -> list[int]:
    """The gradients among `changed` that `replica` holds on its own.

    Where the replicas share storage and keep one reduced gradient, a change made on
    replica 0 is every replica's (one on another replica is refused at the step,
    `GradientSync.check_step`): nothing to compare. After gradient accumulation each
    holds its own, and the one step reads replica 0's: the others' changes must agree.
    """
    if not sync.shared:
        return changed
    one = sync._states[replica].produced_shared
    return [i for i in changed if not one[i]]


def changes(sync: Any, replica: int, indices: Sequence[int]) -> tuple[int, list[int]]:
    """Changes since the reduction to `replica`'s reduced gradients among `indices`.

    Returns:
        (count, changed): each in-place write (the gradient's version counter) and each
        gradient set to None count one; `changed` are the indices of those gradients.
        Gradients not reduced in this step (set by hand, or none) count nothing.
    """
    state = sync._states[replica]
    params = sync.params(replica)
    synced, produced, versions = state.synced, state.produced, state.produced_version
    total = 0
    changed = []
    for index in indices:
        if not synced[index]:
            continue
        grad = params[index].grad
        if grad is None:
            total += 1
            changed.append(index)
        elif grad is produced[index]():
            writes = grad._version - versions[index]
            if writes:
                total += writes
                changed.append(index)
    return total, changed
