"""How many intra-op threads torch may use while replicas run in parallel.

torch parallelises each operator over `torch.get_num_threads()` threads, by default one
per core. N replica threads each running such operators ask for N times the cores, and
the machine spends its time switching (on 2 cores with 4 replicas, one thread per
replica made a CNN epoch 18% faster). The thread count is per process, so it is decided
once, when a module is mirrored: `cores // local replicas`, at least 1. Pass
`threads_per_replica` to `prepare`/`MirroredModule` to choose, or 0 to leave torch's
setting alone.

The change is one of torch's process-wide patches (`crossdevice._arrays.torch_patches`):
torch's count is put back when the last strategy with several replicas is closed or
collected, unless the user set another count since.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

from crossdevice._arrays import torch_patches

__all__ = ["all_cores", "apply_thread_policy", "default_threads_per_replica"]

_LOG = logging.getLogger("crossdevice.torch")


def default_threads_per_replica(local_replicas: int) -> int:
    """`cores // local_replicas` (at least 1): the cores each parallel replica can use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, local_replicas))


def apply_thread_policy(local_replicas: int, threads_per_replica: int | None) -> int:
    """Set torch's intra-op thread count for `local_replicas` parallel replicas.

    Args:
        local_replicas: replicas running at the same time in this process.
        threads_per_replica: None for `default_threads_per_replica`, 0 to leave torch's
            setting alone, or a positive count.

    Returns:
        torch's thread count afterwards.

    Raises:
        ValueError: a negative or non-integer `threads_per_replica`.
    """
    if threads_per_replica is not None and (
        isinstance(threads_per_replica, bool)
        or not isinstance(threads_per_replica, int)
        or threads_per_replica < 0
    ):
        raise ValueError(
            "threads_per_replica must be None (cores // replicas), 0 (leave torch's "
            f"setting) or a positive int, got {threads_per_replica!r}"
        )
    current = torch.get_num_threads()
    if threads_per_replica == 0 or local_replicas <= 1:
        return current
    if _ACTIVE is None:
        return current  # the patches are not in force (no strategy needs parallel replicas)
    if threads_per_replica is None:
        # Only ever lower torch's count: a user who chose fewer threads keeps them.
        target = min(current, default_threads_per_replica(local_replicas))
    else:
        target = threads_per_replica
    if target != current:
        torch.set_num_threads(target)
        _ACTIVE.ours = target
        _LOG.info(
            "crossdevice.torch: %d replicas run in parallel; torch intra-op threads set "
            "from %d to %d (pass threads_per_replica= to choose, 0 to keep torch's)",
            local_replicas,
            current,
            target,
        )
    return target


@contextlib.contextmanager
def all_cores() -> Iterator[None]:
    """Torch's intra-op threads raised to every core while the block runs.

    For work done once while every replica waits (the one optimizer step of replicas
    that store their parameters once): the cores the replicas share are idle then.
    """
    current = torch.get_num_threads()
    cores = default_threads_per_replica(1)
    if cores <= current:
        yield
        return
    torch.set_num_threads(cores)
    try:
        yield
    finally:
        torch.set_num_threads(current)


class _ThreadCount:
    """torch's intra-op thread count before the policy lowered it; `remove` puts it back."""

    def __init__(self) -> None:
        self.before = torch.get_num_threads()
        self.ours: int | None = None  # the count the policy set, if it set one

    def remove(self) -> None:
        global _ACTIVE
        _ACTIVE = None
        if self.ours is not None and torch.get_num_threads() == self.ours:
            torch.set_num_threads(self.before)


#: The thread count to restore while the patches are in force.
_ACTIVE: _ThreadCount | None = None


def _install() -> _ThreadCount:
    global _ACTIVE
    _ACTIVE = _ThreadCount()
    return _ACTIVE


torch_patches.register(torch_patches.Patch(hook=_install))
