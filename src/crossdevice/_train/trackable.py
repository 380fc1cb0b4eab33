"""What each kind of object puts into a checkpoint, and how it takes its state back.

A `Checkpoint` tracks:

* `crossdevice.Variable`s of every kind, saved once as TF saves them (values_util.py): a
  mirrored variable's value, a sync-on-read variable's cross-replica aggregate, a
  central-storage variable's one value. On restore a mirrored value goes to every
  component; a `SUM` sync-on-read total is split so that the replicas add up to it
  again (TF divides by the replica count; for integers we spread the remainder instead
  of truncating it away), on any number of replicas. The replicas' own parts are not
  saved: a float SUM or MEAN that keeps accumulating after a restore may then differ from
  an uninterrupted run in the last bits, also on the same layout (docs/guides/checkpoints.md);
* anything with `state_dict()` and `load_state_dict()`: torch modules and optimizers
  (mirrored ones save replica 0's copy, in the original module's keys, and load every
  replica), LR schedulers, `GradScaler`s, crossdevice's distributed datasets and
  iterators, your own classes;
* random generators you hold: `numpy.random.Generator`, `numpy.random.RandomState`,
  `torch.Generator`;
* lists, tuples and dicts of the above.

`capture` returns the state by reference (the checkpoint stages one copy); `validate`
checks a saved state against the object before anything is loaded, so that a model of
another shape is an error naming the key and both shapes, with nothing changed;
`apply` loads it.

A torch optimizer's state also names its class (`optimizer_class`, the qualified name):
torch's `load_state_dict` takes another class's state without a word, and then steps
with its hyperparameters (Adam's into AdamW: weight_decay 0) or fails at the first step
(Adam's into SGD: `KeyError: 'momentum'`). `validate` refuses another class and param
groups whose keys differ. Checkpoints without the class name (older ones) get the key
check only. An LR scheduler's state names its class the same way (`scheduler_class`):
torch's `load_state_dict` copies any scheduler's state into its attributes, so a
`CosineAnnealingLR` given a `StepLR`'s keeps its own `T_max` and gains a stray
`step_size`. `validate` refuses another class; older checkpoints are not checked.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from crossdevice._arrays import is_torch
from crossdevice._core.reduce_op import VariableAggregation
from crossdevice._values.distributed_variables import (
    DistributedVariable,
    MirroredVariable,
    SyncOnReadVariable,
    split_sum,
)
from crossdevice._values.variables import Variable

__all__ = ["apply", "capture", "check_trackable", "is_scheduler", "strategy_of", "validate"]

_ACCEPTED = (
    "a crossdevice.Variable, an object with state_dict() and load_state_dict() (a torch "
    "module, optimizer, LR scheduler or GradScaler, a distributed dataset or iterator), a "
    "numpy.random.Generator or RandomState, a torch.Generator, or a list, tuple or dict of these"
)


def _is_generator(obj: Any) -> bool:
    torch: Any = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Generator)


#: The key of a torch optimizer's class name in its saved state (not torch's own key).
_OPTIMIZER_CLASS = "optimizer_class"


def _is_optimizer(obj: Any) -> bool:
    torch: Any = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.optim.Optimizer)


#: The key of an LR scheduler's class name in its saved state (not torch's own key).
_SCHEDULER_CLASS = "scheduler_class"


def is_scheduler(obj: Any) -> bool:
    """Whether `obj` is a torch LR scheduler (`ReduceLROnPlateau` too)."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return False
    schedulers = torch.optim.lr_scheduler
    # ReduceLROnPlateau derives from LRScheduler only since torch 2.2.
    return isinstance(obj, schedulers.LRScheduler | schedulers.ReduceLROnPlateau)


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _optimizer_class(optimizer: Any) -> str:
    """The qualified class name of `optimizer` (of its replicas' for a mirrored one)."""
    if isinstance(getattr(type(optimizer), "replicas", None), property):
        optimizer = optimizer.replicas[0]
    return _qualified_name(type(optimizer))


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def check_trackable(obj: Any, name: str) -> None:
    """TypeError unless a checkpoint can track `obj` (see the module doc)."""
    if isinstance(obj, Variable | np.random.Generator | np.random.RandomState):
        return
    if _is_generator(obj) or _is_stateful(obj):
        return
    if isinstance(obj, list | tuple):
        for i, item in enumerate(obj):
            check_trackable(item, f"{name}.{i}")
        return
    if isinstance(obj, Mapping):
        for key, item in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"a tracked dict needs str keys; {name} has the key {key!r}")
            check_trackable(item, f"{name}.{key}")
        return
    raise TypeError(
        f"a Checkpoint cannot track {name}={obj!r} ({type(obj).__name__}): expected {_ACCEPTED}. "
        "Keep plain arrays in a crossdevice.Variable"
    )


def strategy_of(obj: Any) -> Any:
    """The strategy `obj` belongs to (a distributed variable's, a mirrored module's), or None."""
    if isinstance(obj, DistributedVariable):
        return obj.distribute_strategy
    if isinstance(obj, list | tuple):
        found = [strategy_of(item) for item in obj]
    elif isinstance(obj, Mapping):
        found = [strategy_of(item) for item in obj.values()]
    else:
        strategy = getattr(type(obj), "strategy", None)
        return obj.strategy if isinstance(strategy, property) else None
    return next((s for s in found if s is not None), None)


def capture(obj: Any) -> Any:
    """The state of `obj` to save (arrays by reference; the caller copies them)."""
    if isinstance(obj, Variable):
        if isinstance(obj, SyncOnReadVariable):
            if obj.aggregation == VariableAggregation.NONE:
                return obj._primary._value  # TF cannot read it across replicas either
            return obj._read_array()
        if isinstance(obj, DistributedVariable):
            return obj._primary._value
        return obj._value
    if isinstance(obj, np.random.Generator):
        return obj.bit_generator.state
    if isinstance(obj, np.random.RandomState):
        return obj.get_state(legacy=False)
    if _is_generator(obj):
        return obj.get_state()
    if _is_optimizer(obj):
        return {**obj.state_dict(), _OPTIMIZER_CLASS: _optimizer_class(obj)}
    if is_scheduler(obj):
        return {**obj.state_dict(), _SCHEDULER_CLASS: _qualified_name(type(obj))}
    if _is_stateful(obj):
        before = getattr(obj, "_before_checkpoint", None)  # (a mirrored module's warning)
        if before is not None:
            before()
        return obj.state_dict()
    if isinstance(obj, list | tuple):
        return [capture(item) for item in obj]
    return {key: capture(item) for key, item in obj.items()}


def _shape_dtype(array: Any) -> tuple[tuple[int, ...], str]:
    return tuple(array.shape), str(array.dtype).removeprefix("torch.")


def validate(obj: Any, state: Any, name: str) -> None:
    """ValueError if `state` cannot be loaded into `obj`, naming the key, shape or dtype."""
    if isinstance(obj, Variable):
        saved, have = _shape_dtype(state), _shape_dtype(obj)
        if saved != have:
            raise ValueError(
                f"cannot restore {name!r}: the checkpoint holds shape {saved[0]} dtype "
                f"{saved[1]}, and the variable {obj.name!r} has shape {have[0]} dtype "
                f"{have[1]}. Create the variable as it was when the checkpoint was written"
            )
        return
    if isinstance(obj, list | tuple) and not _is_stateful(obj):
        if not isinstance(state, list) or len(state) != len(obj):
            count = len(state) if isinstance(state, list) else type(state).__name__
            raise ValueError(
                f"cannot restore {name!r}: the checkpoint holds {count} entries and the "
                f"tracked {type(obj).__name__} has {len(obj)}"
            )
        for i, (item, saved_item) in enumerate(zip(obj, state, strict=True)):
            validate(item, saved_item, f"{name}.{i}")
        return
    if isinstance(obj, Mapping) and not _is_stateful(obj):
        if not isinstance(state, Mapping) or set(state) != set(obj):
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"cannot restore {name!r}: the checkpoint holds the keys {keys!r} and the "
                f"tracked dict has {sorted(obj)!r}"
            )
        for key, item in obj.items():
            validate(item, state[key], f"{name}.{key}")
        return
    if isinstance(obj, np.random.Generator):
        have = obj.bit_generator.state["bit_generator"]
        saved_kind = state.get("bit_generator") if isinstance(state, Mapping) else None
        if saved_kind != have:
            raise ValueError(
                f"cannot restore {name!r}: the checkpoint holds the state of a {saved_kind!r} "
                f"bit generator, and the tracked Generator uses {have!r}"
            )
    torch: Any = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        _validate_module(obj.state_dict(), state, name)
    if _is_optimizer(obj):
        _validate_optimizer(obj, state, name)
    if is_scheduler(obj):
        _validate_scheduler(obj, state, name)


def _validate_scheduler(scheduler: Any, state: Any, name: str) -> None:
    todo = "Build the scheduler as it was when the checkpoint was written (its class and options)"
    if not isinstance(state, Mapping):
        raise ValueError(
            f"cannot restore the LR scheduler {name!r}: the checkpoint holds no scheduler state "
            f"there (a {type(state).__name__}). {todo}"
        )
    saved_class, have_class = state.get(_SCHEDULER_CLASS), _qualified_name(type(scheduler))
    if saved_class is not None and saved_class != have_class:
        raise ValueError(
            f"cannot restore the LR scheduler {name!r}: the checkpoint holds the state of a "
            f"{saved_class}, and the tracked scheduler is a {have_class}; torch would load it "
            f"anyway and schedule the learning rate by neither. {todo}, or restore the other "
            "objects without it (track it under another name)"
        )


def _validate_optimizer(optimizer: Any, state: Any, name: str) -> None:
    todo = "Build the optimizer as it was when the checkpoint was written (its class and options)"
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups"), list):
        raise ValueError(
            f"cannot restore the optimizer {name!r}: the checkpoint holds no optimizer state "
            f"there (a {type(state).__name__}). {todo}"
        )
    saved_class, have_class = state.get(_OPTIMIZER_CLASS), _optimizer_class(optimizer)
    if saved_class is not None and saved_class != have_class:
        raise ValueError(
            f"cannot restore the optimizer {name!r}: the checkpoint holds the state of a "
            f"{saved_class}, and the tracked optimizer is a {have_class}; its moments and "
            f"hyperparameters mean something else there. {todo}, or restore the other "
            "objects without it (track it under another name)"
        )
    saved_groups, have_groups = state["param_groups"], optimizer.state_dict()["param_groups"]
    if len(saved_groups) != len(have_groups):
        raise ValueError(
            f"cannot restore the optimizer {name!r}: the checkpoint holds {len(saved_groups)} "
            f"param groups, the optimizer has {len(have_groups)}. {todo}"
        )
    for i, (saved, have) in enumerate(zip(saved_groups, have_groups, strict=True)):
        if not isinstance(saved, Mapping):
            raise ValueError(f"cannot restore the optimizer {name!r}: param group {i} is damaged")
        # Without a recorded class (a checkpoint from before it was), keys the optimizer
        # needs and the checkpoint lacks tell another class (Adam's state into SGD lacks
        # 'momentum'). Keys only the checkpoint has are torch's to carry: a scheduler's
        # 'initial_lr', restored before the scheduler is made, is no mismatch.
        missing = sorted(set(have) - set(saved)) if saved_class is None else []
        if missing:
            raise ValueError(
                f"cannot restore the optimizer {name!r}: its param group {i} needs "
                f"{missing!r}, which the checkpoint's lacks (it holds an optimizer of a "
                f"class not recorded, with {sorted(saved)!r}). {todo}"
            )
        count, params = len(saved.get("params", ())), len(have.get("params", ()))
        if count != params:
            raise ValueError(
                f"cannot restore the optimizer {name!r}: its param group {i} holds {count} "
                f"parameters in the checkpoint and {params} in the optimizer. {todo}"
            )


def _key_difference(have: Mapping[str, Any], saved: Mapping[str, Any]) -> str:
    """What keys `saved` lacks and has beyond `have`, in words; "" when they match."""
    missing, unexpected = sorted(set(have) - set(saved)), sorted(set(saved) - set(have))
    if not (missing or unexpected):
        return ""
    return f"missing from the checkpoint: {missing!r}, in the checkpoint only: {unexpected!r}"


def _validate_module(current: Mapping[str, Any], state: Any, name: str) -> None:
    if not isinstance(state, Mapping):
        raise ValueError(f"cannot restore {name!r}: the checkpoint holds {type(state).__name__}")
    differ = _key_difference(current, state)
    if differ:
        raise ValueError(
            f"cannot restore the module {name!r}: its state_dict keys differ from the "
            f"checkpoint's; {differ}. Build the model as it was when the checkpoint was written"
        )
    for key, value in current.items():
        if not (is_torch(value) or isinstance(value, np.ndarray)):
            continue
        saved, have = _shape_dtype(state[key]), _shape_dtype(value)
        if saved != have:
            raise ValueError(
                f"cannot restore {name}.{key}: the checkpoint holds shape {saved[0]} dtype "
                f"{saved[1]}, the module has shape {have[0]} dtype {have[1]}. Build the "
                "model as it was when the checkpoint was written"
            )


def apply(obj: Any, state: Any) -> None:
    """Load a validated `state` into `obj`."""
    if isinstance(obj, Variable):
        if isinstance(obj, SyncOnReadVariable) and obj.aggregation == VariableAggregation.SUM:
            # Every worker's replicas: global ids w*R .. w*R+R-1 of num_replicas_in_sync.
            strategy = obj.distribute_strategy
            total = strategy.num_replicas_in_sync
            first = strategy.extended._replica_id_offset
            parts = split_sum(state, total)[first : first + len(obj.values)]
            for component, part in zip(obj.values, parts, strict=True):
                component.assign(part, read_value=False)
        elif isinstance(obj, MirroredVariable | SyncOnReadVariable):
            for component in obj.values:
                component.assign(state, read_value=False)
        elif isinstance(obj, DistributedVariable):
            obj._primary.assign(state, read_value=False)
        else:
            obj.assign(state, read_value=False)
    elif isinstance(obj, np.random.Generator):
        obj.bit_generator.state = state
    elif isinstance(obj, np.random.RandomState) or _is_generator(obj):
        obj.set_state(state)
    elif _is_optimizer(obj):
        obj.load_state_dict({k: v for k, v in state.items() if k != _OPTIMIZER_CLASS})
    elif is_scheduler(obj):
        obj.load_state_dict({k: v for k, v in state.items() if k != _SCHEDULER_CLASS})
    elif _is_stateful(obj):
        obj.load_state_dict(state)
    elif isinstance(obj, list | tuple):
        for item, saved in zip(obj, state, strict=True):
            apply(item, saved)
    else:
        for key, item in obj.items():
            apply(item, state[key])
