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

* local replicas with a copy each meet at their step (`step_check.StepCheck.meet`):
  where any replica changed a gradient, each gradient any of them changed is compared
  between all of them by its print (`step_check.check_edits`), and gradients that
  differ are an error naming each, with every replica's count and what it holds. Counts
  may differ (a `call_once` change that replica 0 made and the others copied counts
  differently and leaves the same gradients);
* across workers, replica 0's count and prints (each changed gradient's name and print)
  go into the next backward pass's state (`step_state.py`), compared with the
  gradients' all-reduce: a worker that changed its gradients alone, or otherwise than
  the others, fails on every worker, one update later, before any further update.

Compared bitwise: deterministic changes made alike (`clip_grad_norm_` to the global
norm, `mul_` by a constant, noise from a generator seeded alike on every replica and
worker) leave the same bits and pass; NaNs agree where their bits do, -0.0 differs
from 0.0. Gradients of one flat bucket share a version counter, so a write to one
counts for each of them and each is printed (more work, never an error).

Not seen: writes that no version counter records (`p.grad.data.mul_(...)`); where the
replicas share storage, a change made on a replica other than 0 to a gradient of its
own (after gradient accumulation): the one step reads replica 0's, and the others' are
dropped (a change to the one reduced gradient is refused, `GradientSync.check_step`).
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
    `step_state.edited`) and, with `local`, between local replicas with a copy each;
    nothing elsewhere.
    """
    edited = Edited()
    for sync, indices in groups.items():
        watched = step_state.watched(sync)
        if not sync.enabled or not (watched or local):
            continue
        count, changed = changes(sync, replica, indices)
        edited.count += count
        shown: step_state.Prints = ()
        if changed and (local or replica == 0):  # replica 0's: what the one step reads
            params, names = sync.params(replica), sync._names
            prints = gradient_prints([params[i].grad for i in changed])
            for index, value in zip(changed, prints, strict=True):
                edited.prints[(sync, index)] = value
            shown = tuple((names[i], v) for i, v in zip(changed, prints, strict=True))
        if watched:
            step_state.edited(sync, replica, count, shown)
    return edited


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
