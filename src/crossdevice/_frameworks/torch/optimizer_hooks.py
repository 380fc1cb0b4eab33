"""`torch.optim.Optimizer`'s hook registration, for a `MirroredOptimizer`.

A `MirroredOptimizer` is one optimizer per replica (or one for all, where the replicas
store their parameters once), and never runs `torch.optim.Optimizer.__init__`: the
hook dictionaries torch's `register_*_hook` methods write to are its replicas'. So each
registration goes to every replica's optimizer, as a hook registered before `prepare`
does (each replica's copy keeps it): a step hook runs once per replica's step, with that
replica's optimizer as its first argument, and one handle removes them all. (Inherited
as they are, the methods raised an internal `AttributeError`: the bug hunt of session 57.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ReplicaHandles", "on_every_replica"]


class ReplicaHandles:
    """The handles of one hook registered on every replica's optimizer.

    `remove()` removes them all; as a context manager it removes them on exit, as
    torch's `RemovableHandle` does.
    """

    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = tuple(handles)

    def remove(self) -> None:
        """Remove the hook from every replica's optimizer."""
        for handle in self.handles:
            handle.remove()

    def __enter__(self) -> ReplicaHandles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def on_every_replica(name: str) -> Any:
    """`torch.optim.Optimizer.<name>` for a `MirroredOptimizer` (see the module doc)."""

    def register(self: Any, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._index() is not None:
            raise RuntimeError(
                f"{name}() was called inside strategy.run, where each replica would register "
                "the hook on every replica's optimizer again; register optimizer hooks "
                "outside strategy.run (once: they run on every replica)"
            )
        optimizers = dict.fromkeys(self.__dict__["_optimizers"])  # once where shared
        return ReplicaHandles([getattr(o, name)(hook, *args, **kwargs) for o in optimizers])

    register.__name__ = register.__qualname__ = name
    register.__doc__ = (
        f"`torch.optim.Optimizer.{name}`, registered on every replica's optimizer.\n\n"
        "The hook gets that replica's optimizer as its first argument; the returned "
        "handle's `remove()` removes it from all. Call it outside `strategy.run`."
    )
    return register
