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
  bring their counts; counts that differ are looked into (`step_check.check_edits`):
  gradients that differ in value are an error naming each replica's count. Equal values
  pass (a `call_once` or cross-replica change that replica 0 made and the others copied
  counts differently and leaves the same gradients);
* across workers, replica 0's count goes into the next backward pass's state
  (`step_state.py`), compared with the gradients' all-reduce: a worker that changed its
  gradients alone fails on every worker, one update later, before any further update.

Changes alike in number but not in value (each worker clipping to its own norm) are not
seen across workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from crossdevice._frameworks.torch import step_state

__all__ = ["before_step", "count"]


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
