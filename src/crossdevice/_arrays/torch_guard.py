"""Refuse torch modules and optimizers that several replicas would share and mutate.

Inside `strategy.run`, N replicas calling one `torch.nn.Module` with trainable
parameters, or one optimizer's `step()`, race on the same tensors: on threads they crash
at a random step ("modified by an inplace operation"); on cooperative replicas they
silently train a different model. TF has no such hazard because a Keras model built
under `strategy.scope()` has mirrored variables. Here the fix is one call
(`crossdevice.torch.prepare`), and this guard turns the mistake into an error at the
first call, naming that fix.

A module is refused when a replica of a strategy with several replicas in sync calls it
with grad mode on and it has parameters that require grad, or in training mode with
floating buffers (BatchNorm statistics); a module that cannot change (frozen, or called
under `torch.no_grad()` in eval mode) may be shared. Replica copies made by
`crossdevice.torch` (and copies a user declares with `mark_replica_copy`) carry a mark
naming their strategy and replica, and are refused only in another replica than their
own. The marks live here, outside the objects, so marked modules deep-copy and pickle as
plain torch objects (a copy is unmarked).

The checks run from `torch.nn.Module.__call__` and torch's global optimizer step
pre-hook, installed by `torch_patches` (a global *module* hook would make every
`torch.compile`d module warn and take torch's slow call path).
"""

from __future__ import annotations

import importlib
import threading
import weakref
from typing import Any, Final

from crossdevice._arrays import torch_patches
from crossdevice._core import context

__all__ = ["is_marked", "mark", "mark_of"]

_FIX: Final = (
    "Mirror it once, before the training loop: "
    "`model, optimizer = crossdevice.torch.prepare(model, optimizer)` (under "
    "`strategy.scope()` or with strategy=...), then call the returned objects inside "
    "strategy.run."
)
_OWN_COPIES: Final = (
    "If you made one copy per replica yourself, declare each with "
    "crossdevice.torch.mark_replica_copy(copy, replica_id)."
)

# id(obj) -> (strategy, local replica index or None). Keyed by id, not by a weak
# reference, because lookups run on every module call; a finalizer removes the entry.
_MARKS: dict[int, tuple[Any, int | None]] = {}
_MARKS_LOCK = threading.Lock()


def mark(obj: Any, strategy: Any, index: int | None) -> None:
    """Mark `obj` (a module or optimizer) as local replica `index`'s copy under `strategy`.

    `index=None` marks an object that dispatches to the running replica's copy itself
    (a mirrored module or optimizer): every replica of `strategy` may use it.
    """
    key = id(obj)
    with _MARKS_LOCK:
        known = key in _MARKS
        _MARKS[key] = (strategy, index)
    if not known:
        weakref.finalize(obj, _MARKS.pop, key, None)


def mark_of(obj: Any) -> tuple[Any, int | None] | None:
    """`(strategy, local replica index)` of a marked object, else None."""
    return _MARKS.get(id(obj))


def is_marked(obj: Any) -> bool:
    """Whether `obj` is a replica copy made (or declared) for some strategy."""
    return id(obj) in _MARKS


def _replica_frame() -> context.Frame | None:
    frame = context.current_frame()
    if frame is None or frame.replica_context is None:
        return None
    if frame.strategy.num_replicas_in_sync <= 1:
        return None
    return frame


def _own(obj: Any, frame: context.Frame, what: str) -> bool:
    """True if `obj` is this replica's own copy; raises if it is another replica's."""
    marked = _MARKS.get(id(obj))
    if marked is None:
        return False
    strategy, index = marked
    if strategy is frame.strategy and index in (None, frame.local_replica_id):
        return True
    where = "" if strategy is frame.strategy else f" under {strategy!r}"
    raise RuntimeError(
        f"replica {frame.local_replica_id} used {what} {type(obj).__name__}, which is "
        f"replica {index}'s copy{where}. Inside strategy.run use the mirrored "
        "objects returned by crossdevice.torch.prepare (they pick the running replica's "
        "copy), not the original module or optimizer, nor another replica's copy."
    )


def _describe(obj: Any) -> str:
    text = repr(obj).replace("\n", " ")
    text = " ".join(text.split())
    return text if len(text) <= 90 else text[:87] + "..."


def _sharers(frame: context.Frame) -> str:
    strategy = frame.strategy
    kind = type(strategy).__name__
    local = len(strategy.extended.worker_devices)
    total = strategy.num_replicas_in_sync
    if local == 1:
        return (
            f"it is not mirrored, so its gradients would not be combined with the other "
            f"{total - 1} replica(s) in sync of the {kind}"
        )
    return (
        f"replica {frame.local_replica_id} called it, and every one of the {local} replicas "
        f"that the {kind} runs in this process would share it"
    )


def check_module(module: Any) -> None:
    """Refuse `module` if the running replica would share and mutate it (see the doc)."""
    frame = _replica_frame()
    if frame is None or _own(module, frame, "module"):
        return
    import torch

    trainable = torch.is_grad_enabled() and any(
        p is not None and p.requires_grad for p in module._parameters.values()
    )
    stateful = module.training and any(
        b is not None and b.is_floating_point() for b in module._buffers.values()
    )
    if not (trainable or stateful):
        return
    reason = "trainable parameters" if trainable else "buffers updated in training mode"
    raise RuntimeError(
        f"module {_describe(module)} has {reason} and belongs to no replica: "
        f"{_sharers(frame)}, racing on it and training the wrong model. {_FIX} "
        f"{_OWN_COPIES} (A module that cannot change may be shared: freeze it with "
        "requires_grad_(False) and eval(), or call it under torch.no_grad() in eval mode.)"
    )


def _check_optimizer(optimizer: Any, args: Any, kwargs: Any) -> None:
    frame = _replica_frame()
    if frame is None or _own(optimizer, frame, "optimizer"):
        return
    raise RuntimeError(
        f"optimizer {type(optimizer).__name__}.step() was called inside strategy.run on an "
        f"optimizer that belongs to no replica: {_sharers(frame)}, each updating the same "
        f"parameters with its own gradients. {_FIX} {_OWN_COPIES}"
    )


def _guarded_call(original: Any) -> Any:
    import torch

    is_compiling = torch.compiler.is_compiling
    pending = torch_patches.dynamo_pending

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        # While torch.compile traces, the check stays out of the graph (it reads this
        # thread's context): compiled code is not checked, and the optimizer hook still
        # refuses a shared optimizer's step.
        if not is_compiling():
            if pending:  # a compiled module's first call runs here before dynamo traces
                torch_patches.check_dynamo()
            frame = context.current_frame()
            if frame is not None and frame.replica_context is not None:
                # The per-call case first: the running replica's own copy passes.
                marked = _MARKS.get(id(self))
                if (
                    marked is None
                    or marked[0] is not frame.strategy
                    or (marked[1] is not None and marked[1] != frame.local_replica_id)
                ):
                    check_module(self)
        return original(self, *args, **kwargs)

    call.__name__ = call.__qualname__ = "__call__"
    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call


def _optimizer_hook() -> Any:
    optimizer = importlib.import_module("torch.optim.optimizer")  # not an attribute of torch.optim
    return optimizer.register_optimizer_step_pre_hook(_check_optimizer)


def _module_class() -> Any:
    import torch

    return torch.nn.Module


torch_patches.register(
    torch_patches.Patch(_module_class, "__call__", _guarded_call),
    torch_patches.Patch(hook=_optimizer_hook),
)
