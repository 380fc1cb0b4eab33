"""Putting back what a restore loaded: `snapshot(obj)`, taken before a load, undoes it.

`Checkpoint.restore` and `read` change every tracked object or none. The checks before
the first load (`trackable.validate`) refuse what a load is known to fail on, but a load
can still fail after them: a user object's `load_state_dict`, a torch load hook, a state
no check foresaw. TF and torch leave the objects loaded before it (and part of the one
that failed) restored, and a caller that catches the error and trains on, from an older
checkpoint or afresh, would silently train a half-restored model; across workers, one
worker's failed load would leave it apart from the others. So `Checkpoint._load` takes a
snapshot of each object just before loading it and, should any load fail (on this worker
or another), calls the undos last-first.

A snapshot keeps what `trackable.apply` overwrites and no more, by the cheapest means that
is exact: references where a load replaces state, copies where it writes in place.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from crossdevice._input.position import Positioned
from crossdevice._train.trackable import (
    is_generator,
    is_optimizer,
    is_scheduler,
    is_stateful,
    replicas_of,
)
from crossdevice._values.distributed_variables import (
    DistributedVariable,
    MirroredVariable,
    SyncOnReadVariable,
)
from crossdevice._values.variables import Variable

__all__ = ["Undo", "snapshot"]

#: A function that puts an object back as it was when its snapshot was taken.
Undo = Callable[[], None]


def snapshot(obj: Any) -> Undo:
    """A function that puts back what `trackable.apply(obj, ...)` overwrites, as it is now.

    Cheap: references where a load replaces state (an optimizer's `state` and
    `param_groups`, a scheduler's attributes), copies only of what a load writes in place
    (parameters and buffers, on the host; variables; generators). A distributed dataset or
    iterator keeps its own (`Positioned._snapshot`: a `state_dict()` loaded back would
    move its epoch). Other objects with `state_dict()` get a deep copy of theirs loaded
    back: exact where `load_state_dict(state_dict())` is the identity, as for GradScalers.
    """
    torch: Any = sys.modules.get("torch")
    if isinstance(obj, Variable):  # what apply writes: each component, or the one value
        parts = [obj._primary if isinstance(obj, DistributedVariable) else obj]
        if isinstance(obj, MirroredVariable | SyncOnReadVariable):
            parts = list(obj.values)
        kept = [(part, part.read_value()) for part in parts]
        return _all([functools.partial(p.assign, v, read_value=False) for p, v in kept])
    if isinstance(obj, np.random.Generator):
        return functools.partial(setattr, obj.bit_generator, "state", obj.bit_generator.state)
    if isinstance(obj, np.random.RandomState):
        return functools.partial(obj.set_state, obj.get_state(legacy=False))
    if is_generator(obj):
        return functools.partial(obj.set_state, obj.get_state())
    if torch is not None and isinstance(obj, torch.nn.Module):
        return _module_snapshot(torch, obj)
    if is_optimizer(obj):
        return _all([_optimizer_snapshot(each) for each in replicas_of(obj)])
    if is_scheduler(obj):
        return _attributes_snapshot(_scheduler_parts(obj))
    if isinstance(obj, Positioned):
        return obj._snapshot()
    if is_stateful(obj):
        state = obj.state_dict()
        with contextlib.suppress(Exception):  # else by reference: fine unless changed in place
            state = copy.deepcopy(state)
        return lambda: obj.load_state_dict(state)
    items = obj if isinstance(obj, list | tuple) else list(obj.values())
    return _all([snapshot(item) for item in items])


def _all(undos: list[Callable[[], Any]]) -> Undo:
    """One undo of many: each of `undos`, last first."""

    def undo() -> None:
        for each in reversed(undos):
            each()

    return undo


def _module_snapshot(torch: Any, module: Any) -> Undo:
    """Every replica's parameters, buffers and extra states, which load_state_dict writes."""
    tensors, extra = [], []
    for sub in (sub for replica in replicas_of(module) for sub in replica.modules()):
        for table in (sub._parameters, sub._buffers):
            kept = [
                (k, t, t.detach().to("cpu", copy=True)) for k, t in table.items() if t is not None
            ]
            tensors += [(table, *each) for each in kept]
        if type(sub).get_extra_state is not torch.nn.Module.get_extra_state:
            extra.append((sub, copy.deepcopy(sub.get_extra_state())))

    def undo() -> None:
        with torch.no_grad():
            for table, key, tensor, value in tensors:
                table[key] = tensor  # the very object, should a load hook have replaced it
                tensor.copy_(value)
        for sub, state in extra:
            sub.set_extra_state(state)

    return undo


def _optimizer_snapshot(optimizer: Any) -> Undo:
    """Torch's load_state_dict replaces `state` and `param_groups` (new dicts): keep the old."""
    state, groups = optimizer.state, optimizer.param_groups
    contents = [dict(group) for group in groups]

    def undo() -> None:
        for group, content in zip(groups, contents, strict=True):
            group.clear()
            group.update(content)
        optimizer.__dict__.update(state=state, param_groups=groups)

    return undo


def _scheduler_parts(scheduler: Any) -> list[Any]:
    """A scheduler, its inner schedulers and its callable objects: what its load updates."""
    parts = [scheduler]
    for inner in getattr(scheduler, "_schedulers", None) or ():
        parts += _scheduler_parts(inner)
    lambdas = getattr(scheduler, "lr_lambdas", None) or ()
    return parts + [f for f in lambdas if not hasattr(f, "__code__") and hasattr(f, "__dict__")]


def _attributes_snapshot(objects: list[Any]) -> Undo:
    """Each object's attributes as they are, by reference: for loads that set attributes."""
    kept = [(vars(each), dict(vars(each))) for each in objects]

    def undo() -> None:
        for attributes, before in kept:
            attributes.clear()
            attributes.update(before)

    return undo
