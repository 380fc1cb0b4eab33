"""The per-thread context stack: which strategy is current and in which mode.

TF keeps one stack per graph; in eager code it behaves per thread. An empty stack means
the default strategy in its default replica context (replica id 0). A frame is one of:

* cross-replica (`strategy.scope()`, `merge_fn`): `replica_context is None`;
* replica (`strategy.run`): `replica_context` is the `ReplicaContext` of this thread;
* update (`extended.update` component i): cross-replica with `update_replica_id = i`.

Only data lives here; the strategy and replica layers give it meaning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

from crossdevice._core.errors import CROSS_REPLICA_REQUIRED

__all__ = [
    "Frame",
    "copy_stack",
    "current_frame",
    "default_scope_open",
    "enter_default_scope",
    "entered",
    "pop_frame",
    "push_frame",
    "require_cross_replica",
    "stack_depth",
    "swap_stack",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """One entry of the context stack.

    Attributes:
        strategy: the strategy this frame belongs to.
        replica_context: the replica context (replica mode), or None (cross-replica).
        local_replica_id: index of this replica's component in local values.
        update_replica_id: in an update context, the component being updated.
    """

    strategy: Any
    replica_context: Any = None
    local_replica_id: int | None = None
    update_replica_id: int | None = None


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[Frame] = []
        # Open `with default_strategy.scope()` blocks: they push no frame (TF).
        self.default_scopes = 0


_LOCAL = _Local()


def current_frame() -> Frame | None:
    """The innermost frame of this thread, or None in the default context."""
    stack = _LOCAL.stack
    return stack[-1] if stack else None


def push_frame(frame: Frame) -> None:
    """Enter `frame` on this thread."""
    _LOCAL.stack.append(frame)


def pop_frame(frame: Frame) -> None:
    """Leave `frame`, which must be the innermost one on this thread."""
    stack = _LOCAL.stack
    if not stack or stack[-1] is not frame:
        raise RuntimeError(
            "context stack corrupted: leaving a scope that is not the innermost one; "
            "exit `with strategy.scope()` blocks in the order they were entered"
        )
    stack.pop()


def copy_stack() -> list[Frame]:
    """A copy of this thread's context stack (what a new cooperative replica 0 starts with)."""
    return list(_LOCAL.stack)


def swap_stack(stack: list[Frame]) -> list[Frame]:
    """Replace this thread's context stack, returning the old one.

    Cooperative replicas share their thread: each has its own stack, swapped in while it
    runs (`crossdevice._sync.waiting`).
    """
    old = _LOCAL.stack
    _LOCAL.stack = stack
    return old


def enter_default_scope(opened: bool) -> None:
    """Count a default strategy's scope opened (`opened`) or closed on this thread.

    TF's default scope pushes no context but installs a variable creator that refuses
    variables of any other strategy while it is open (`_DefaultDistributionContext`).
    """
    _LOCAL.default_scopes += 1 if opened else -1


def default_scope_open() -> bool:
    """Whether this thread is inside a `with default_strategy.scope()` block."""
    return _LOCAL.default_scopes > 0


def stack_depth() -> int:
    """How many frames this thread has entered."""
    return len(_LOCAL.stack)


@contextlib.contextmanager
def entered(frame: Frame) -> Iterator[Frame]:
    """Push `frame` on this thread for the duration of a `with` block."""
    push_frame(frame)
    try:
        yield frame
    finally:
        pop_frame(frame)


def require_cross_replica(strategy: Any) -> None:
    """Raise TF's RuntimeError unless in `strategy`'s cross-replica (or the default) context."""
    frame = current_frame()
    if frame is None:
        return
    if frame.replica_context is not None:
        raise RuntimeError(CROSS_REPLICA_REQUIRED)
    if frame.strategy is not strategy:
        raise RuntimeError(
            f"Mixing different crossdevice.Strategy objects: {frame.strategy!r} is not "
            f"{strategy!r}; use each strategy's API inside its own scope"
        )
