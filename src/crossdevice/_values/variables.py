"""`Variable`: a mutable array with a device and a name (`tf.Variable`).

Outside a strategy scope `crossdevice.Variable(...)` is a plain variable. Inside a scope
the strategy creates it: a `MirroredVariable`, a `SyncOnReadVariable` or, under
`CentralStorageStrategy`, one variable on the parameter device. That hand-off goes
through a hook the strategy layer installs (`set_variable_creator`), so this layer does
not import the layers above it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from crossdevice._arrays import backend_for, is_torch
from crossdevice._core import context
from crossdevice._core.coerce import coerce_enum
from crossdevice._core.devices import canonicalize, current_device
from crossdevice._core.reduce_op import VariableAggregation, VariableSynchronization
from crossdevice._core.validate import describe
from crossdevice._values.operators import ArrayOperators

__all__ = [
    "AssignMethods",
    "Variable",
    "as_aggregation",
    "as_synchronization",
    "check_update",
    "make_initial_value",
    "resolve_trainable",
    "set_variable_creator",
]

VariableCreator = Callable[..., Any]
_CREATOR: dict[str, VariableCreator | None] = {"creator": None}


def set_variable_creator(creator: VariableCreator) -> None:
    """Install the function that creates variables under a strategy scope (strategy layer)."""
    _CREATOR["creator"] = creator


def unique_name(name: str | None) -> str:
    """The variable's name: `"Variable"` by default.

    TF 2 does not make eager variable names unique (every `tf.Variable(0.)` is named
    `'Variable:0'`), so neither do we.
    """
    return name or "Variable"


def as_synchronization(value: Any) -> VariableSynchronization:
    """A `VariableSynchronization` from the enum or its name; None means AUTO (as TF)."""
    return coerce_enum(
        value,
        VariableSynchronization,
        default=VariableSynchronization.AUTO,
        message="Invalid variable synchronization mode: {value}; expected one of {choices}",
    )


def as_aggregation(value: Any) -> VariableAggregation:
    """A `VariableAggregation` from the enum or its name; None means NONE (as TF)."""
    return coerce_enum(
        value,
        VariableAggregation,
        default=VariableAggregation.NONE,
        message="Invalid variable aggregation mode: {value} for variable; expected one of "
        "{choices}",
    )


def resolve_trainable(trainable: bool | None, synchronization: VariableSynchronization) -> bool:
    """`trainable`, or TF's default when it is None: False for ON_READ, else True.

    TF (`variables.validate_synchronization_aggregation_trainable`): sync-on-read
    variables hold metrics and statistics, which optimisers must not update.
    """
    if trainable is None:
        return synchronization != VariableSynchronization.ON_READ
    return bool(trainable)


def make_initial_value(initial_value: Any, dtype: Any, *, copy: bool = True) -> Any:
    """The initial array: call a callable, convert (TF dtype rules), cast to `dtype`, copy.

    `copy=False` may return the caller's own array (for a caller that copies it anyway).
    """
    if initial_value is None:
        raise ValueError("initial_value must be specified (an array, a number or a callable)")
    if callable(initial_value):
        initial_value = initial_value()
    if isinstance(initial_value, Variable):
        initial_value = initial_value.read_value()
    backend = backend_for(initial_value)
    value = backend.asarray(initial_value)
    if dtype is not None:
        value = value.to(dtype) if is_torch(value) else np.asarray(value, dtype=dtype)
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    if kind in _NON_NUMERIC_KINDS:
        # Variables are updated and aggregated arithmetically (assign_add, SUM/MEAN of
        # replicas); a string or object array would be "added" by concatenation.
        raise TypeError(
            f"a crossdevice.Variable holds numbers or booleans, got an initial value of "
            f"dtype {value.dtype}: {initial_value!r}; keep strings and objects in plain "
            "Python or NumPy values"
        )
    return backend.copy(value) if copy else value


#: NumPy dtype kinds a variable cannot hold: strings, bytes, objects, datetimes, voids.
_NON_NUMERIC_KINDS = frozenset("USOMmV")


class _VariableMeta(type):
    """Routes `Variable(...)` to the strategy in scope.

    It also makes distributed variables pass `isinstance(v, crossdevice.Variable)`, as
    they do in TF.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        frame = context.current_frame()
        creator = _CREATOR["creator"]
        if cls is Variable and frame is not None and creator is not None:
            return creator(frame, *args, **kwargs)
        return super().__call__(*args, **kwargs)

    def __instancecheck__(cls, instance: Any) -> bool:
        if cls is Variable and getattr(type(instance), "_is_distributed_variable", False):
            return True
        return super().__instancecheck__(instance)


class AssignMethods:
    """`assign`, `assign_add`, `assign_sub` with TF's signatures, over one `_update` hook.

    Each returns `_assigned()` (what TF's assign returns: for a plain variable the
    variable itself, so later assigns show through it; for distributed variables, in the
    contexts where TF returns one, a snapshot of the value the update wrote), or None with
    `read_value=False` (TF 2 eager).
    """

    __slots__ = ()

    def _update(self, method: str, value: Any) -> None:
        raise NotImplementedError

    def _assigned(self) -> Any:
        """The result of an update with `read_value=True`: the variable itself.

        TF's `ResourceVariable.assign` returns an unread view of the variable, so a
        later assign shows through it (`w = q.assign(5.); q.assign(9.)`: `w` reads 9).
        """
        return self

    def assign(
        self,
        value: Any,
        use_locking: bool | None = None,
        name: str | None = None,
        read_value: bool = True,
    ) -> Any:
        """Set the value (under the variable's synchronisation and aggregation rules).

        Returns TF's result with `read_value=True` (the default): a plain variable
        itself, live; for a distributed variable, a snapshot of the value written where
        TF takes one (the porting guide, "What an assign returns"). None with
        `read_value=False`.
        """
        del use_locking, name
        check_update(self, "assign", value)
        self._update("assign", value)
        return self._assigned() if read_value else None

    def assign_add(
        self,
        delta: Any,
        use_locking: bool | None = None,
        name: str | None = None,
        read_value: bool = True,
    ) -> Any:
        """Add `delta` (under the variable's synchronisation and aggregation rules).

        Returns TF's result with `read_value=True` (the default): a plain variable
        itself, live; for a distributed variable, a snapshot of the value written where
        TF takes one (the porting guide, "What an assign returns"). None with
        `read_value=False`.
        """
        del use_locking, name
        check_update(self, "assign_add", delta)
        self._update("assign_add", delta)
        return self._assigned() if read_value else None

    def assign_sub(
        self,
        delta: Any,
        use_locking: bool | None = None,
        name: str | None = None,
        read_value: bool = True,
    ) -> Any:
        """Subtract `delta` (under the variable's synchronisation and aggregation rules).

        Returns TF's result with `read_value=True` (the default): a plain variable
        itself, live; for a distributed variable, a snapshot of the value written where
        TF takes one (the porting guide, "What an assign returns"). None with
        `read_value=False`.
        """
        del use_locking, name
        check_update(self, "assign_sub", delta)
        self._update("assign_sub", delta)
        return self._assigned() if read_value else None


class Variable(AssignMethods, ArrayOperators, metaclass=_VariableMeta):
    """A mutable array with a device and a name (`tf.Variable`).

    Under a strategy's `scope()` this creates the strategy's kind of variable instead
    (`MirroredVariable`, `SyncOnReadVariable`, or one variable on the parameter device).

    Args:
        initial_value: an array, a number, a nested list, or a callable returning one.
            Python numbers follow `tf.constant`: floats become float32, ints int32.
        trainable: whether optimisers should update it; None (the default) means True,
            except for `synchronization=ON_READ` variables (False, as TF).
        name: the variable's name; `"Variable"` by default (not made unique, as TF 2).
        dtype: cast the initial value to this NumPy (or torch) dtype.
        synchronization: a `VariableSynchronization`; used under a strategy scope.
        aggregation: a `VariableAggregation`; how replica-context updates combine.
        device: the device to place it on; default the current `device_scope`, else CPU:0.

    Example:
        >>> v = Variable(1.0)
        >>> v.assign_add(2.0)
        <crossdevice.Variable 'Variable:0' shape=() dtype=float32, numpy=3.0>
    """

    _is_distributed_variable = False

    def __init__(
        self,
        initial_value: Any = None,
        trainable: bool | None = None,
        name: str | None = None,
        dtype: Any = None,
        synchronization: Any = VariableSynchronization.AUTO,
        aggregation: Any = VariableAggregation.NONE,
        *,
        device: str | None = None,
    ) -> None:
        self._synchronization = as_synchronization(synchronization)
        self._aggregation = as_aggregation(aggregation)
        value = make_initial_value(initial_value, dtype, copy=False)
        backend = backend_for(value)
        own = backend.device_of(value)
        target = canonicalize(device) if device else (own or current_device() or "CPU:0")
        target = canonicalize(target)
        # Moved once, judged by what came back: a NumPy value bound for a GPU comes back
        # as a CUDA tensor, which NumPy's backend cannot see the device of. The variable
        # owns its value: a value that did not move is copied.
        moved = backend.to_device(value, target)
        value = backend.copy(value) if moved is value else moved
        self._value = value
        self._device = target
        self._name = unique_name(name)
        self._trainable = resolve_trainable(trainable, self._synchronization)
        self._distributed_container: Any = None
        self._distribute_strategy: Any = None

    # --- properties -------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The name, with TF's `:0` output suffix."""
        return f"{self._name}:0"

    @property
    def device(self) -> str:
        """The canonical device."""
        return self._device

    @property
    def dtype(self) -> Any:
        """The dtype of the value (a NumPy or torch dtype)."""
        return self._value.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the value."""
        return tuple(self._value.shape)

    @property
    def trainable(self) -> bool:
        """Whether optimisers should update it."""
        return self._trainable

    @property
    def synchronization(self) -> VariableSynchronization:
        """The synchronisation mode given at creation."""
        return self._synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        """The aggregation mode given at creation."""
        return self._aggregation

    # --- reads ------------------------------------------------------------------------
    def read_value(self) -> Any:
        """A snapshot of the value (a new array: later assigns do not change it)."""
        return backend_for(self._value).copy(self._value)

    def value(self) -> Any:
        """Same as `read_value()`."""
        return self.read_value()

    def numpy(self) -> Any:
        """The value as a new NumPy array (a NumPy scalar for 0-d values, as TF's `.numpy()`)."""
        arr = np.array(backend_for(self._value).to_numpy(self._value), copy=True)
        return arr[()] if arr.ndim == 0 else arr

    def _operand(self) -> Any:
        return self._value

    # --- writes -----------------------------------------------------------------------
    def _write(self, new_value: Any) -> None:
        backend = backend_for(self._value)
        if is_torch(self._value):
            new = backend.asarray(_unwrap(new_value))
        else:
            new = np.asarray(backend_for(_unwrap(new_value)).to_numpy(_unwrap(new_value)))
        if tuple(new.shape) != self.shape and math.prod(new.shape) != 1:
            raise ValueError(
                f"Cannot assign a value of shape {tuple(new.shape)} to variable {self.name!r} "
                f"of shape {self.shape}; assign a value of the variable's shape"
            )
        backend.assign(self._value, new)

    def _update(self, method: str, value: Any) -> None:
        if self._distributed_container is None:
            _refuse_shared_update(self, method)
        if method == "assign":
            self._write(value)
        elif method == "assign_add":
            self._write(self._value + _as_operand(self._value, value))
        else:
            self._write(self._value - _as_operand(self._value, value))

    def __repr__(self) -> str:
        return (
            f"<crossdevice.Variable {self.name!r} shape={self.shape} "
            f"dtype={_dtype_str(self.dtype)}, {_library(self._value)}={_numpy_str(self.numpy())}>"
        )


#: How far a value's kind may be cast into a variable's: bool < integers < floats < complex
#: (NumPy's "same_kind" rule, which `np.copyto` applies to NumPy variables; torch's
#: `copy_` would truncate floats into integers and drop imaginary parts silently).
_KIND_RANK: Final = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def _kind(dtype: Any) -> str | None:
    """A NumPy or torch dtype's kind letter ("b", "i", "f", "c"), None if not a number."""
    kind = getattr(dtype, "kind", None)
    if isinstance(kind, str):
        return kind if kind in _KIND_RANK else None
    if dtype.is_complex:
        return "c"
    if dtype.is_floating_point:
        return "f"
    return "b" if str(dtype) == "torch.bool" else "i"


def check_update(variable: Any, method: str, value: Any) -> None:
    """Refuse a value `assign`/`assign_add`/`assign_sub` cannot write, before any write.

    The value (each component of a distributed one) must be numbers that cast to the
    variable's dtype by NumPy's same-kind rule, of the variable's shape or one element.
    Otherwise NumPy or torch would fail somewhere inside the update, naming no variable,
    or (torch) write a truncated value.

    Raises:
        TypeError: not numbers, or numbers of a kind the variable's dtype cannot hold.
        ValueError: a shape that is neither the variable's nor one element.
    """
    target = variable.dtype
    shape = variable.shape
    if isinstance(target, np.dtype):  # the common cases (a gradient step, a metric) first
        kind = type(value)
        if kind is np.ndarray and value.dtype == target and value.shape == shape:
            return
        if kind is float and target.kind in "fc":
            return
    values = value.values if hasattr(value, "_get_on_device_or_primary") else (value,)
    for component in values:
        problem = _update_problem(_unwrap(component), target, shape)
        if problem is not None:
            error = ValueError if problem.startswith("of shape") else TypeError
            raise error(
                f"{type(variable).__name__} {variable.name!r} (dtype {_dtype_str(target)}, "
                f"shape {shape}): {method} needs numbers that cast to "
                f"{_dtype_str(target)} (bool, then integers, then floats, then complex: the "
                f"same kind or a lower one), of shape {shape} or one element; received "
                f"{describe(value)}, {problem}. Convert it first, e.g. "
                f"np.asarray(value, dtype=np.{_dtype_str(target)}); nothing was changed"
            )


def _update_problem(value: Any, target: Any, shape: tuple[int, ...]) -> str | None:
    """Why `value` cannot be written into a variable of `target` dtype and `shape`, or None."""
    if is_torch(value):
        dtype, value_shape = value.dtype, tuple(value.shape)
    else:
        try:
            array = np.asarray(value)
        except (TypeError, ValueError) as exc:  # ragged nested lists, unconvertible objects
            return f"which is not an array ({exc})"
        dtype, value_shape = array.dtype, array.shape
    kind = _kind(dtype)
    if kind is None:
        return f"of dtype {_dtype_str(dtype)}, which is not a number type"
    target_kind = _kind(target)
    if target_kind is not None and _KIND_RANK[kind] > _KIND_RANK[target_kind]:
        return f"of dtype {_dtype_str(dtype)}, a higher kind than {_dtype_str(target)}"
    if value_shape != shape and math.prod(value_shape) != 1:
        return f"of shape {value_shape}"
    return None


def _refuse_shared_update(variable: Variable, method: str) -> None:
    """Refuse a plain variable's update from the replicas of a multi-replica `run`.

    A variable created outside `strategy.scope()` is one object shared by every
    replica; N replicas updating it at once lose updates (494 to 747 where 800 were
    expected, measured). TF runs eager replicas one at a time and adds N times; neither
    is what the program means, so it is an error that names the fix.
    """
    frame = context.current_frame()
    if frame is None or frame.replica_context is None:
        return
    replicas = frame.strategy.num_replicas_in_sync
    if replicas > 1:
        raise RuntimeError(
            f"Variable {variable.name!r} was created outside strategy.scope(), so all "
            f"{replicas} replicas of {frame.strategy!r} share it, and {method} from each "
            "of them would race and lose updates. Create it under `with strategy.scope():` "
            "(its replica-context updates are then aggregated, see `aggregation=`), or "
            "update it outside strategy.run"
        )


def _dtype_str(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


#: Arrays with more elements than this are summarised in reprs (first and last
#: `_REPR_EDGE_ITEMS` per axis). Lower than NumPy's 1000: a distributed variable prints
#: one array per replica, and a 30x30 weight already fills a screen.
_REPR_THRESHOLD = 100
_REPR_EDGE_ITEMS = 3


def _library(value: Any) -> str:
    """What a repr calls the value: `numpy=` (TF's word, for NumPy) or `torch=`."""
    return "torch" if is_torch(value) else "numpy"


def _numpy_str(value: Any) -> str:
    if isinstance(value, np.generic):
        return str(value.item())
    return np.array2string(
        np.asarray(value),
        separator=", ",
        threshold=_REPR_THRESHOLD,
        edgeitems=_REPR_EDGE_ITEMS,
    )


def _unwrap(value: Any) -> Any:
    """A plain array from a Variable or a Mirrored value."""
    if isinstance(value, Variable) and not type(value)._is_distributed_variable:
        return value._value
    from crossdevice._values.values import DistributedValues

    if isinstance(value, DistributedValues):
        return _unwrap(value._get())
    return value


def _as_operand(target: Any, delta: Any) -> Any:
    delta = _unwrap(delta)
    if is_torch(target):
        return backend_for(target).asarray(delta).to(target.device)
    return np.asarray(backend_for(delta).to_numpy(delta))
