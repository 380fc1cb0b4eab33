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
checks a saved state against the object, for all a load can fail on, before anything is
loaded, so that a model of another shape is an error naming the key and both shapes;
`apply` loads it; `crossdevice._train.rollback` puts back what a load overwrote, should
one still fail.

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

import copy
import sys
from collections.abc import Callable, Mapping
from typing import Any, Final

import numpy as np

from crossdevice._arrays import is_torch
from crossdevice._core.reduce_op import VariableAggregation
from crossdevice._input.position import Positioned
from crossdevice._values.distributed_variables import (
    DistributedVariable,
    MirroredVariable,
    SyncOnReadVariable,
    split_sum,
)
from crossdevice._values.variables import Variable

__all__ = [
    "apply",
    "capture",
    "check_trackable",
    "is_generator",
    "is_optimizer",
    "is_scheduler",
    "is_stateful",
    "replicas_of",
    "strategy_of",
    "validate",
]

_ACCEPTED = (
    "a crossdevice.Variable, an object with state_dict() and load_state_dict() (a torch "
    "module, optimizer, LR scheduler or GradScaler, a distributed dataset or iterator), a "
    "numpy.random.Generator or RandomState, a torch.Generator, or a list, tuple or dict of these"
)


def is_generator(obj: Any) -> bool:
    """Whether `obj` is a `torch.Generator` (False while torch is not imported)."""
    torch: Any = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Generator)


#: The key of a torch optimizer's class name in its saved state (not torch's own key).
_OPTIMIZER_CLASS = "optimizer_class"


def is_optimizer(obj: Any) -> bool:
    """Whether `obj` is a torch optimizer (a `torch.optim.Optimizer`)."""
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


def replicas_of(obj: Any) -> tuple[Any, ...]:
    """A mirrored module's or optimizer's local replicas' copies; `(obj,)` for a plain one."""
    if isinstance(getattr(type(obj), "replicas", None), property):
        return tuple(dict.fromkeys(obj.replicas))  # an optimizer shared by the replicas once
    return (obj,)


def _optimizer_class(optimizer: Any) -> str:
    """The qualified class name of `optimizer` (of its replicas' for a mirrored one)."""
    return _qualified_name(type(replicas_of(optimizer)[0]))


def is_stateful(obj: Any) -> bool:
    """Whether `obj` has `state_dict()` and `load_state_dict()`, to save and load through."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def check_trackable(obj: Any, name: str) -> None:
    """TypeError unless a checkpoint can track `obj` (see the module doc)."""
    if isinstance(obj, Variable | np.random.Generator | np.random.RandomState):
        return
    if is_generator(obj) or is_stateful(obj):
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
    if is_generator(obj):
        return obj.get_state()
    if is_optimizer(obj):
        return {**obj.state_dict(), _OPTIMIZER_CLASS: _optimizer_class(obj)}
    if is_scheduler(obj):
        return {**obj.state_dict(), _SCHEDULER_CLASS: _qualified_name(type(obj))}
    if is_stateful(obj):
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
        if not (is_torch(state) or isinstance(state, np.ndarray | np.generic)):
            raise ValueError(
                f"cannot restore {name!r}: the checkpoint holds a {type(state).__name__} "
                f"there, and the variable {obj.name!r} takes an array of shape {obj.shape}. "
                "Track there what was tracked when the checkpoint was written"
            )
        saved, have = _shape_dtype(state), _shape_dtype(obj)
        if saved != have:
            raise ValueError(
                f"cannot restore {name!r}: the checkpoint holds shape {saved[0]} dtype "
                f"{saved[1]}, and the variable {obj.name!r} has shape {have[0]} dtype "
                f"{have[1]}. Create the variable as it was when the checkpoint was written"
            )
        return
    if isinstance(obj, list | tuple) and not is_stateful(obj):
        if not isinstance(state, list) or len(state) != len(obj):
            count = len(state) if isinstance(state, list) else type(state).__name__
            raise ValueError(
                f"cannot restore {name!r}: the checkpoint holds {count} entries and the "
                f"tracked {type(obj).__name__} has {len(obj)}"
            )
        for i, (item, saved_item) in enumerate(zip(obj, state, strict=True)):
            validate(item, saved_item, f"{name}.{i}")
        return
    if isinstance(obj, Mapping) and not is_stateful(obj):
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
        bits = copy.deepcopy(obj.bit_generator)  # a throwaway one
        _try_load(name, "numpy Generator", lambda: setattr(bits, "state", state))
    elif isinstance(obj, np.random.RandomState):
        _try_load(name, "numpy RandomState", lambda: np.random.RandomState().set_state(state))
    elif is_generator(obj):
        _try_load(name, "torch.Generator", lambda: type(obj)(obj.device).set_state(state))
    elif isinstance(obj, Positioned):
        obj._check_state(state, f"cannot restore the data position {name!r}")
    torch: Any = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        _validate_module(obj.state_dict(), state, name)
    if is_optimizer(obj):
        _validate_optimizer(obj, state, name)
    if is_scheduler(obj):
        _validate_scheduler(obj, state, name)


def _try_load(name: str, kind: str, load: Callable[[], Any]) -> None:
    """Load a saved state into a throwaway object like the tracked one: ValueError if it fails."""
    try:
        load()
    except (TypeError, ValueError, KeyError, RuntimeError) as err:
        raise ValueError(
            f"cannot restore {name!r}: its saved state does not load into a {kind} like the "
            f"tracked one ({type(err).__name__}: {err}). Track there what was tracked when the "
            "checkpoint was written, or restore an undamaged checkpoint"
        ) from err


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
    if hasattr(scheduler, "mode_worse"):  # ReduceLROnPlateau checks these after its update
        modes = [state.get(key) for key in ("mode", "threshold", "threshold_mode")]
        _try_load(name, "ReduceLROnPlateau", lambda: copy.copy(scheduler)._init_is_better(*modes))
    inner = getattr(scheduler, "_schedulers", None)  # SequentialLR, ChainedScheduler
    if isinstance(inner, list):
        saved_inner = state.get("_schedulers")
        if not isinstance(saved_inner, list) or len(saved_inner) != len(inner):
            count = len(saved_inner) if isinstance(saved_inner, list) else "no"
            raise ValueError(
                f"cannot restore the LR scheduler {name!r}: the checkpoint holds {count} inner "
                f"schedulers, the tracked one chains {len(inner)}. {todo}"
            )
        for i, (each, saved) in enumerate(zip(inner, saved_inner, strict=True)):
            _validate_scheduler(each, saved, f"{name}._schedulers.{i}")


def _validate_optimizer(optimizer: Any, state: Any, name: str) -> None:
    todo = "Build the optimizer as it was when the checkpoint was written (its class and options)"
    parts = state if isinstance(state, Mapping) else {}
    if not isinstance(parts.get("param_groups"), list) or not isinstance(parts.get("state"), dict):
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
    _validate_moments(optimizer, state, name, todo)


#: torch's optimizers' state of their parameter's shape (not Adafactor's, LBFGS's), which
#: torch's `load_state_dict` takes of any shape: the first `step()` fails, or broadcasts.
_PARAMETER_SHAPED: Final = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg"}
    | {"acc_delta", "sum", "exp_inf", "ax", "prev", "step_size"}
)


def _validate_moments(optimizer: Any, state: Mapping[str, Any], name: str, todo: str) -> None:
    """Each saved state tensor against the tensor it replaces, or else its parameter's shape."""
    first = replicas_of(optimizer)[0]
    own = type(first).__module__.startswith("torch.optim")
    params = {
        saved_id: param
        for saved, group in zip(state["param_groups"], first.param_groups, strict=True)
        for saved_id, param in zip(saved.get("params", ()), group["params"], strict=True)
    }
    for saved_id, entry in state["state"].items():
        param = params.get(saved_id)
        if param is None or not isinstance(entry, Mapping):
            continue  # torch keeps it as it is
        current = first.state.get(param, {})
        for key, value in entry.items():
            have = current.get(key, param if own and key in _PARAMETER_SHAPED else None)
            if is_torch(value) and is_torch(have) and value.shape != have.shape:
                raise ValueError(
                    f"cannot restore the optimizer {name!r}: its state {key!r} of parameter "
                    f"{saved_id} has shape {tuple(value.shape)} in the checkpoint, and that "
                    f"parameter (shape {tuple(param.shape)}) takes {tuple(have.shape)}: the "
                    f"state is another model's. {todo}"
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
        if is_torch(value) != is_torch(state[key]) or not hasattr(state[key], "shape"):
            raise ValueError(
                f"cannot restore {name}.{key}: the checkpoint holds a {type(state[key]).__name__}"
                f" there, the module a {type(value).__name__}. The checkpoint was written from "
                "another kind of object: track there what was tracked when it was written"
            )
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
    elif isinstance(obj, np.random.RandomState) or is_generator(obj):
        obj.set_state(state)
    elif is_optimizer(obj):
        obj.load_state_dict({k: v for k, v in state.items() if k != _OPTIMIZER_CLASS})
    elif is_scheduler(obj):
        obj.load_state_dict({k: v for k, v in state.items() if k != _SCHEDULER_CLASS})
    elif is_stateful(obj):
        obj.load_state_dict(state)
    elif isinstance(obj, list | tuple):
        for item, saved in zip(obj, state, strict=True):
            apply(item, saved)
    else:
        for key, item in obj.items():
            apply(item, state[key])
