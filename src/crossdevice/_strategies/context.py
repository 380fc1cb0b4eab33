"""The functions that say which strategy and replica context are current.

The per-thread stack lives in `crossdevice._core.context`. An empty stack is the default
replica context of the default strategy (replica id 0); `strategy.scope()` pushes a
cross-replica frame; `strategy.run` pushes a replica frame on each replica's thread. This
is the only module that knows the default strategy; `ReplicaContext` itself is in
`crossdevice._strategies.replica`.
"""

from __future__ import annotations

from typing import Any

from crossdevice._core import context
from crossdevice._strategies.base import Strategy
from crossdevice._strategies.default import default_strategy
from crossdevice._strategies.replica import ReplicaContext

__all__ = [
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "replica_context",
]

#: The default replica context (replica 0 of the default strategy), made on first use.
_DEFAULT_REPLICA: list[ReplicaContext] = []


def _default_replica_context() -> ReplicaContext:
    if not _DEFAULT_REPLICA:
        _DEFAULT_REPLICA.append(ReplicaContext(default_strategy(), 0))
    return _DEFAULT_REPLICA[0]


def get_replica_context() -> ReplicaContext | None:
    """The current `ReplicaContext`, or None in cross-replica context.

    Outside any strategy this is the default replica context (replica 0 of the default
    strategy); inside `strategy.scope()` (and in `merge_fn`) it is None; inside
    `strategy.run` it is the running replica's context.
    """
    frame = context.current_frame()
    if frame is None:
        return _default_replica_context()
    return frame.replica_context


def replica_context() -> ReplicaContext:
    """The current `ReplicaContext`, for code that runs inside `strategy.run` (ours).

    TensorFlow has only `get_replica_context()`, which returns None in cross-replica
    context, so typed step functions must check for None on every call. This accessor
    returns a `ReplicaContext` or raises, so `ctx = crossdevice.replica_context()` needs no
    check. Outside any strategy it is the default replica context, as
    `get_replica_context()` is.

    Returns:
        The running replica's context.

    Raises:
        RuntimeError: in cross-replica context (inside `strategy.scope()` or a
            `merge_fn`), where there is no replica.

    Example:
        >>> import crossdevice, numpy as np
        >>> strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> def step() -> int:
        ...     return crossdevice.replica_context().replica_id_in_sync_group
        >>> strategy.experimental_local_results(strategy.run(step))
        (0, 1)
    """
    ctx = get_replica_context()
    if ctx is None:
        raise RuntimeError(
            "crossdevice.replica_context() was called in cross-replica context (inside "
            "`strategy.scope()` or a `merge_fn`), where there is no replica; call it inside the "
            "function passed to `strategy.run`, or use `crossdevice.get_replica_context()`, "
            "which returns None here"
        )
    return ctx


def in_cross_replica_context() -> bool:
    """True inside `strategy.scope()` or `merge_fn`, False in a replica or the default context."""
    frame = context.current_frame()
    return frame is not None and frame.replica_context is None


def get_cross_replica_context() -> Strategy | None:
    """The current strategy in cross-replica context, else None."""
    frame = context.current_frame()
    if frame is not None and frame.replica_context is None:
        return frame.strategy
    return None


def get_strategy() -> Strategy:
    """The current strategy: the one whose scope or replica we are in, else the default."""
    frame = context.current_frame()
    return frame.strategy if frame is not None else default_strategy()


def has_strategy() -> bool:
    """Whether a strategy other than the default one is current."""
    return get_strategy() is not default_strategy()


_SET_STRATEGY: dict[str, Any] = {}


def experimental_set_strategy(strategy: Strategy | None) -> None:
    """Make `strategy` current without `with strategy.scope()` (None to undo).

    Raises:
        RuntimeError: inside a `strategy.scope()` block.
    """
    previous = _SET_STRATEGY.get("scope")
    depth = _SET_STRATEGY.get("depth", 0)
    if context.stack_depth() != depth:
        raise RuntimeError(
            "Must not be called inside a `crossdevice.Strategy` scope; leave the "
            "`with strategy.scope():` block first"
        )
    if previous is not None:
        previous.__exit__(None, None, None)
        _SET_STRATEGY.clear()
    if strategy is not None:
        scope = strategy.scope()
        scope.__enter__()
        _SET_STRATEGY["scope"] = scope
        _SET_STRATEGY["depth"] = context.stack_depth()
