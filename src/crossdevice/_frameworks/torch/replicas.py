"""Which replica is running, and where each replica's tensors live.

A mirrored module or optimizer keeps one copy per local replica; every method picks the
copy of the replica that calls it (the context stack of `crossdevice._core.context`),
and replica 0's in cross-replica context, where it reads like a `MirroredVariable`.
"""

from __future__ import annotations

from typing import Any

import torch

from crossdevice._arrays import get_torch_backend
from crossdevice._core import context
from crossdevice._strategies.base import Strategy
from crossdevice._strategies.context import get_strategy

__all__ = ["local_replica_index", "local_replicas", "strategy_or_current", "torch_devices"]


def strategy_or_current(strategy: Strategy | None, what: str) -> Strategy:
    """`strategy`, or the current one (`get_strategy()`) when None; checks the context.

    Raises:
        RuntimeError: called inside `strategy.run` (mirroring must happen once, outside).
        TypeError: `strategy` is not a crossdevice strategy.
    """
    frame = context.current_frame()
    if frame is not None and frame.replica_context is not None:
        raise RuntimeError(
            f"{what} must be called in cross-replica context (under `with strategy.scope():` "
            "or outside any strategy), not inside `strategy.run`: every replica would make "
            "its own copies. Create it once, before the training loop."
        )
    if strategy is None:
        strategy = get_strategy() if frame is None else frame.strategy
    if not isinstance(strategy, Strategy):
        raise TypeError(
            f"{what} expects a crossdevice strategy (e.g. crossdevice.MirroredStrategy()), "
            f"got {type(strategy).__name__}: {strategy!r}"
        )
    return strategy


def local_replica_index(strategy: Strategy) -> int | None:
    """The local replica of `strategy` running now, or None in cross-replica context.

    Raises:
        RuntimeError: inside a replica of another strategy.
    """
    frame = context.current_frame()
    if frame is None:
        return None
    if frame.strategy is not strategy:
        if frame.replica_context is None and frame.update_replica_id is None:
            return None
        raise RuntimeError(
            f"an object mirrored by {strategy!r} was used inside a replica of another "
            f"strategy, {frame.strategy!r}; use each strategy's mirrored objects in its own "
            "`run`"
        )
    if frame.replica_context is not None:
        return frame.local_replica_id
    return frame.update_replica_id


def torch_devices(strategy: Strategy) -> list[torch.device]:
    """The torch device of each local replica of `strategy` (host replicas: `cpu`)."""
    backend: Any = get_torch_backend()
    return [backend.torch_device(d) for d in strategy.extended.worker_devices]


def local_replicas(strategy: Strategy) -> int:
    """How many replicas of `strategy` this process runs."""
    return len(strategy.extended.worker_devices)
