"""Refuse torch modules and optimizers that every replica shares and mutates.

Inside `strategy.run`, N replicas calling one `torch.nn.Module` with trainable
parameters, or one optimizer's `step()`, race on the same tensors: on threads they crash
at a random step ("modified by an inplace operation"); on cooperative replicas they
silently train a different model. TF has no such hazard because a Keras model built
under `strategy.scope()` has mirrored variables. Here the fix is one call
(`crossdevice.torch.prepare`), and these global hooks turn the mistake into an error at
the first call, naming that fix.

A module is refused when it runs in a replica of a strategy with more than one replica
in sync and it has parameters that require grad, or is in training mode with floating
buffers (BatchNorm statistics); frozen modules in eval mode may be shared. Copies made
by `crossdevice.torch` carry a mark naming their strategy and replica, and are refused
only in another replica than their own.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any, Final

from crossdevice._core import context

__all__ = ["REPLICA_MARK", "install", "mark"]

#: Attribute set on each replica copy of a mirrored module (every submodule) and
#: optimizer: `(strategy, local_replica_index)`.
REPLICA_MARK: Final = "_crossdevice_replica"

_FIX: Final = (
    "Mirror it once, before the training loop: "
    "`model, optimizer = crossdevice.torch.prepare(model, optimizer)` (under "
    "`strategy.scope()` or with strategy=...), then call the returned objects inside "
    "strategy.run."
)

_INSTALLED: dict[str, Any] = {}
_LOCK = threading.Lock()


def mark(obj: Any, strategy: Any, index: int | None) -> None:
    """Mark `obj` (a module or optimizer) as replica `index`'s copy under `strategy`.

    `index=None` marks an object that dispatches to the running replica's copy itself
    (a mirrored module or optimizer): every replica of `strategy` may use it.
    """
    obj.__dict__[REPLICA_MARK] = (strategy, index)


def install() -> None:
    """Register the global module and optimizer hooks (once per process; torch imported)."""
    if _INSTALLED:
        return
    with _LOCK:
        if _INSTALLED:
            return
        torch = sys.modules["torch"]
        _INSTALLED["module"] = torch.nn.modules.module.register_module_forward_pre_hook(
            _check_module
        )
        optim = importlib.import_module("torch.optim.optimizer")
        _INSTALLED["optimizer"] = optim.register_optimizer_step_pre_hook(_check_optimizer)


def _replica_frame() -> context.Frame | None:
    frame = context.current_frame()
    if frame is None or frame.replica_context is None:
        return None
    if frame.strategy.num_replicas_in_sync <= 1:
        return None
    return frame


def _check_mark(obj: Any, frame: context.Frame, what: str) -> bool:
    """True if `obj` is this replica's own copy; raises if it is another replica's."""
    mark = obj.__dict__.get(REPLICA_MARK)
    if mark is None:
        return False
    strategy, index = mark
    if strategy is frame.strategy and index in (None, frame.local_replica_id):
        return True
    raise RuntimeError(
        f"replica {frame.local_replica_id} used {what} {type(obj).__name__}, which is "
        f"replica {index}'s copy under {strategy!r}. Inside strategy.run use the mirrored "
        "objects returned by crossdevice.torch.prepare (they pick the running replica's "
        "copy), not the original module or optimizer."
    )


def _check_module(module: Any, args: Any) -> None:
    frame = _replica_frame()
    if frame is None or _check_mark(module, frame, "module"):
        return
    trainable = any(p.requires_grad for p in module.parameters(recurse=False))
    stateful = module.training and any(b.is_floating_point() for b in module.buffers(recurse=False))
    if not (trainable or stateful):
        return
    reason = "trainable parameters" if trainable else "buffers updated in training mode"
    raise RuntimeError(
        f"module {type(module).__name__} is shared by all {frame.strategy.num_replicas_in_sync} "
        f"replicas of {frame.strategy!r} and has {reason}: replicas would race on it and "
        f"train the wrong model. {_FIX} (A frozen module may be shared: "
        "requires_grad_(False) and eval().)"
    )


def _check_optimizer(optimizer: Any, args: Any, kwargs: Any) -> None:
    frame = _replica_frame()
    if frame is None or _check_mark(optimizer, frame, "optimizer"):
        return
    raise RuntimeError(
        f"optimizer {type(optimizer).__name__}.step() was called inside strategy.run on "
        f"an optimizer shared by all {frame.strategy.num_replicas_in_sync} replicas of "
        f"{frame.strategy!r}: every replica would update the same parameters with its own "
        f"gradients. {_FIX}"
    )
