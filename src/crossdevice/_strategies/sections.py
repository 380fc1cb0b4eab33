"""Cross-replica sections: tell listeners where code may change replica 0's state alone.

Between `strategy.run` calls, and inside a `merge_fn`, code runs once, in cross-replica
context. There a mirrored object reads like its primary (replica 0's) copy, as TF's
`MirroredVariable` does; torch modules have no `assign` that would reach every copy, so
code that changes replica 0's copy in place (`requires_grad_`, an initialiser, an
averaged model's update) changes it alone. A listener (the torch training layer) is told
when such a section starts (`enter_cross_replica`: record the state) and ends
(`leave_cross_replica`: bring every replica to replica 0's state) while the replicas are
not running, so the copies never diverge.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

__all__ = ["CrossReplicaListener", "CrossReplicaSections"]


class CrossReplicaListener(Protocol):
    """What a listener implements."""

    def enter_cross_replica(self) -> None:
        """A cross-replica section starts: remember the state replicas agree on."""

    def leave_cross_replica(self) -> None:
        """It ends: give every replica what replica 0 has now."""


class CrossReplicaSections:
    """A strategy's listeners, held weakly; falsy when there are none."""

    __slots__ = ("_listeners",)

    def __init__(self) -> None:
        self._listeners: list[weakref.ref[Any]] = []

    def add(self, listener: CrossReplicaListener) -> None:
        """Tell `listener` about sections from now on, while it lives."""
        self._listeners.append(weakref.ref(listener))

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def _live(self) -> list[Any]:
        live = [ref() for ref in self._listeners]
        if None in live:
            self._listeners = [ref for ref in self._listeners if ref() is not None]
        return [listener for listener in live if listener is not None]

    def enter(self) -> None:
        """A cross-replica section starts."""
        for listener in self._live():
            listener.enter_cross_replica()

    def leave(self) -> None:
        """A cross-replica section ends; the replicas are about to run."""
        for listener in self._live():
            listener.leave_cross_replica()
