"""Argument checks shared by the public entry points, run before any replica blocks.

Each public entry point makes one call here, so every input gets the same clear answer
whichever door it came through (design §5: what was expected, what was received, what to
do). The checks:

* `reducible`: only numbers are reduced. A nest given to `all_reduce`, `reduce`,
  `reduce_to`, `batch_reduce_to` or a `CrossDeviceOps` must hold integer, floating-point or
  complex leaves. Strings, bytes, objects, datetimes and None raise TypeError naming the
  leaf's path in the nest and its dtype. Booleans too, as in TensorFlow, whose reduction
  kernels take no bool (NumPy would silently turn SUM into logical OR): cast to an integer
  type to count. Gathers are not reductions and take any dtype.
* `function`: `run(fn)` and `merge_call(fn)` need a callable.
* `timeout_seconds`: a finite number of seconds up to `MAX_TIMEOUT_SECONDS`, or None.
* `single_device`: `OneDeviceStrategy` takes one device string, not a list.
* `axes`: the axis of `reduce` (an int or distinct ints), `gather`, `all_gather` and
  `CrossDeviceOps` gathers (one int), checked against the value's rank: TypeError for
  the wrong type, ValueError out of range or repeated, as TF.
* `describe` / `safe_repr`: a received value for messages, safe for any value (an int
  too long for `repr`, a repr that raises) and cut at 200 characters.

Devices that do not exist are checked where devices are parsed
(`devices.check_device_exists`, which `crossdevice.device` and every strategy call).
"""

from __future__ import annotations

import inspect
import math
import types
from typing import Any, Final

import numpy as np
import optree

__all__ = [
    "MAX_TIMEOUT_SECONDS",
    "axes",
    "describe",
    "function",
    "lazy_result",
    "reducible",
    "safe_repr",
    "single_device",
    "timeout_seconds",
]

#: The longest `timeout_seconds` accepted: 30 days. Longer waits are no timeout at all
#: (pass None), and waits beyond `threading.TIMEOUT_MAX` (about 292 years) overflow.
MAX_TIMEOUT_SECONDS: Final = 30 * 24 * 3600.0

#: NumPy dtype kinds that are reduced: signed and unsigned integers, floats, complex.
_NUMERIC_KINDS: Final = frozenset("iufc")

_NEST: Final[dict[str, Any]] = {"none_is_leaf": True, "namespace": "crossdevice"}

#: Code flags of a function whose call returns before its body runs.
_ASYNC: Final = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_LAZY_BODY: Final = inspect.CO_GENERATOR | _ASYNC
_LAZY_TYPES: Final = (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)


_DISTRIBUTED: list[Any] = []


def register_distributed_values(cls: type, default_devices: Any) -> None:
    """Tell the checks which class is `DistributedValues` and how its default devices go.

    `crossdevice._values.values` calls it when it is imported: `_core` is below `_values`
    and must not import it (tests/test_layers.py).

    Args:
        cls: `DistributedValues`.
        default_devices: `default_devices(values)`, the devices a value made without
            `devices=` gets.
    """
    _DISTRIBUTED[:] = [cls, default_devices]


def _distributed_values_type() -> Any:
    return _DISTRIBUTED[0] if _DISTRIBUTED else ()


def _problem(x: Any) -> str | None:
    """Why the leaf `x` cannot be reduced (its type or dtype, described), or None if it can."""
    if isinstance(x, bool):
        return "a Python bool"
    if isinstance(x, int | float | complex):
        return None
    if x is None:
        return "None"
    if isinstance(x, str | bytes):
        return f"a {type(x).__name__} ({x!r})"
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return f"a {type(x).__name__} (not a number or an array)"
    if isinstance(dtype, np.dtype):
        return None if dtype.kind in _NUMERIC_KINDS else f"of dtype {dtype}"
    # torch dtypes: everything but bool is a number type, but torch (2.x, CPU) has no add
    # for the unsigned types wider than 8 bits ("add_stub not implemented").
    name = str(dtype)
    if name == "torch.bool":
        return "of dtype torch.bool"
    if name in _TORCH_UNADDABLE:
        return f"of dtype {name}, which torch cannot add"
    return None


#: torch dtypes without an add kernel: reducing them would fail inside torch.
_TORCH_UNADDABLE: Final = frozenset({"torch.uint16", "torch.uint32", "torch.uint64"})


def _hint(problem: str) -> str:
    if "torch cannot add" in problem:
        return (
            "cast to a signed type wide enough for the sum, e.g. x.to(torch.int32) for "
            "uint16 or x.to(torch.int64) for uint32 (NumPy arrays of these types reduce)"
        )
    if "bool" in problem:
        return (
            "TensorFlow does not reduce booleans either (summing them in NumPy would be a "
            "logical OR): cast to an integer type to count them, e.g. x.astype(np.int32)"
        )
    if problem == "None":
        return "return a number (or an array) from every replica, or leave the entry out"
    return "gather non-numeric values instead (all_gather or strategy.gather)"


def _path(keys: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in keys)


def reducible(value: Any, what: str) -> None:
    """Raise TypeError unless every leaf of the nest `value` is a number or numeric array.

    Distributed values (`PerReplica`, `Mirrored`, distributed variables) are checked
    component by component.

    Args:
        value: the nest about to be reduced.
        what: the entry point, for the message (e.g. `"ReplicaContext.all_reduce"`).

    Raises:
        TypeError: naming the first bad leaf's path in the nest and its dtype.
    """
    kind = type(value)
    if kind is float or kind is int:
        return  # one plain leaf (a loss, a count): no nest to walk
    if (kind is np.ndarray or isinstance(value, np.generic)) and (
        value.dtype.kind in _NUMERIC_KINDS
    ):
        return
    leaves = optree.tree_leaves(value, **_NEST)
    distributed = None
    for leaf in leaves:
        # The common cases first, without the general checks below (`all_reduce` is hot).
        kind = type(leaf)
        if kind is float or kind is int:
            continue
        if (kind is np.ndarray or isinstance(leaf, np.generic)) and (
            leaf.dtype.kind in _NUMERIC_KINDS
        ):
            continue
        if distributed is None:
            distributed = _distributed_values_type()
        components = leaf.values if isinstance(leaf, distributed) else (leaf,)
        for component in components:
            if _problem(component) is not None:
                _raise(value, what)


def fits_strategy(value: Any, strategy: Any, what: str, *, whole_worker: bool = True) -> None:
    """Raise ValueError unless every distributed value in `value` fits `strategy`'s replicas.

    A `PerReplica` or `Mirrored` value must have one component per local replica (TF
    silently reduced a 3-component value on 2 replicas, and `run` dropped the extra one;
    a `merge_fn`'s result of 3 components for 2 replicas lost one, and of 1 raised a
    bare `IndexError`); a distributed variable must be one of `strategy`'s own.

    Args:
        value: a nest (arguments of `run`, a value about to be reduced or gathered, a
            `merge_fn`'s result).
        strategy: the strategy whose method was called.
        what: the entry point, for the message.
        whole_worker: a value of one component may stand for the whole worker
            (`MultiWorkerMirroredStrategy`'s values to reduce); False where each local
            replica takes its own component (a `merge_fn`'s result).
    """
    distributed = _distributed_values_type()
    if not distributed:
        return
    strategy_devices: tuple[Any, ...] = ()
    replicas = -1  # the strategy's, read at the first distributed leaf
    per_worker = False
    # The leaves' paths only for a message: flattening with paths costs more than the
    # check itself, and `run` checks its arguments every step.
    for position, leaf in enumerate(optree.tree_leaves(value, **_NEST)):
        if not isinstance(leaf, distributed):
            continue
        if replicas < 0:
            strategy_devices = tuple(strategy.extended._local_devices)
            replicas = len(strategy_devices)
            per_worker = whole_worker and getattr(strategy.extended, "_num_workers", 1) > 1
        owner = getattr(leaf, "_strategy", None)
        if owner is not None:  # a distributed variable: its components are the strategy's
            if owner is not strategy:
                raise ValueError(
                    f"{_where(value, position, leaf, what)} belongs to {owner!r}, not to "
                    f"{strategy!r}: each strategy reduces only its own distributed "
                    "variables; read it (`.numpy()`) or create it under this strategy's "
                    "scope()"
                )
            continue
        count = len(leaf.values)
        if count == 1 and per_worker:
            continue  # MultiWorkerMirroredStrategy: one value for this whole worker
        devices = leaf._devices
        if (
            count == replicas
            and devices != strategy_devices
            and devices != _DISTRIBUTED[1](leaf.values)
        ):
            # Devices given explicitly and not ours: a value of another strategy.
            raise ValueError(
                f"{_where(value, position, leaf, what)} lives on {list(devices)}, but "
                f"{strategy!r} runs on {list(strategy_devices)}: it was made by another "
                "strategy. Make it with this strategy (run, "
                "experimental_distribute_values_from_function)"
            )
        if count != replicas:
            raise ValueError(
                f"{_where(value, position, leaf, what)} has {count} components, but "
                f"{strategy!r} has {replicas} local replica{'s' if replicas != 1 else ''}: "
                "expected one component per replica "
                "(strategy.experimental_distribute_values_from_function makes such values)"
            )


def _where(value: Any, position: int, leaf: Any, what: str) -> str:
    """How a message names leaf number `position` of `value` (`fits_strategy`)."""
    keys = optree.tree_flatten_with_path(value, **_NEST)[0][position]
    return f"{what}: the {type(leaf).__name__} at {_path(keys) or 'the top'}"


def _raise(value: Any, what: str) -> None:
    distributed = _distributed_values_type()
    paths, leaves, _ = optree.tree_flatten_with_path(value, **_NEST)
    for keys, leaf in zip(paths, leaves, strict=True):
        if isinstance(leaf, distributed):
            named = [(f"{_path(keys)} (replica {i})", c) for i, c in enumerate(leaf.values)]
        else:
            named = [(_path(keys), leaf)]
        for where, component in named:
            problem = _problem(component)
            if problem is not None:
                raise TypeError(
                    f"{what}: only numbers are reduced (integer, floating-point or complex "
                    f"dtypes), but the value{where} is {problem}; {_hint(problem)}"
                )
    raise AssertionError("unreachable: a bad leaf was found but not named")  # pragma: no cover


def function(fn: Any, what: str) -> None:
    """Raise TypeError unless `fn` is callable and runs its body when called.

    `run(None)`, `merge_call(None)`; and a generator function or `async def`: called,
    it returns a generator or a coroutine without running its body, whose collectives
    then run later, outside the replicas (the default context's: a sum over one
    replica), silently (the bug hunt of session 57).
    """
    if not callable(fn):
        raise TypeError(
            f"{what} needs a function to call, got {type(fn).__name__}: {fn!r}; pass the "
            "function itself (fn, not fn())"
        )
    code = getattr(fn, "__code__", None)
    if code is not None and code.co_flags & _LAZY_BODY:
        kind = "an async function" if code.co_flags & _ASYNC else "a generator function"
        raise TypeError(
            f"{what} got {kind}, {getattr(fn, '__qualname__', fn)!r}: called, it returns "
            "a generator or coroutine without running its body, which would run later, "
            "outside the replicas. Pass a plain function (collect what it yields in a list "
            "and return that)"
        )


def lazy_result(value: Any, what: str) -> None:
    """Raise TypeError if `value` (a replica's result) is a generator or coroutine.

    Its body has not run, and would run later outside the replicas (see `function`).
    """
    if isinstance(value, _LAZY_TYPES):
        if isinstance(value, types.CoroutineType):
            value.close()  # (never awaited: no RuntimeWarning besides this error)
        raise TypeError(
            f"{what} returned a {type(value).__name__} whose body has not run; it would "
            "run later, outside the replicas. Return its values (list(...)), not the "
            "generator or coroutine"
        )


def timeout_seconds(value: Any) -> float | None:
    """A checked `timeout_seconds`: None (or 0) for no timeout, else a finite number.

    Raises:
        ValueError: not a number; negative, NaN or infinite; above `MAX_TIMEOUT_SECONDS`.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"timeout_seconds must be None or a number of seconds, got {value!r}")
    if math.isnan(value):
        raise ValueError("timeout_seconds must be a number of seconds or None, got nan")
    if value < 0:
        raise ValueError(f"timeout_seconds must be >= 0 or None, got {value!r}")
    if value > MAX_TIMEOUT_SECONDS:
        raise ValueError(
            f"timeout_seconds must be at most {MAX_TIMEOUT_SECONDS:.0f} (30 days), got "
            f"{value!r}; pass None for no timeout"
        )
    return value or None


def single_device(device: Any, what: str) -> None:
    """Raise TypeError unless `device` is one device string (not a list of them)."""
    if isinstance(device, str):
        return
    if isinstance(device, list | tuple) and len(device) == 1 and isinstance(device[0], str):
        raise TypeError(
            f"{what} takes one device string, got a {type(device).__name__} {device!r}; "
            f"write {what}({device[0]!r})"
        )
    raise TypeError(f"{what} takes one device string such as 'CPU:0', got {device!r}")


def describe(x: object) -> str:
    """`type: repr` of a received value, for error messages (see `safe_repr`)."""
    return f"{type(x).__name__}: {safe_repr(x)}"


def safe_repr(x: object) -> str:
    """`repr(x)` cut at 200 characters, for error messages, whatever the value.

    Python refuses `repr` of an int of more than 4300 digits (ValueError), and a user's
    `__repr__` may raise: neither may replace the error being reported.
    """
    if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 128:
        digits = int(x.bit_length() * math.log10(2)) + 1
        return f"<an int of about {digits} digits>"
    try:
        text = repr(x)
    except Exception as exc:  # the message must survive a broken __repr__
        return f"<unprintable {type(x).__name__}: repr raised {type(exc).__name__}>"
    return text[:200] + "..." if len(text) > 200 else text


def axes(axis: Any, rank: int, what: str, *, several: bool) -> tuple[int, ...]:
    """The axes `axis` names in a value of rank `rank`, each in `[0, rank)`.

    Args:
        axis: what the caller passed.
        rank: the value's number of dimensions.
        what: the entry point, for the message (e.g. `"Strategy.reduce"`).
        several: whether a tuple or list of distinct ints is accepted (reductions); else
            one int (gathers: the result has one element).

    Raises:
        TypeError: not an int (nor, with `several`, a tuple or list of ints), as TF.
        ValueError: an axis out of range (TF: "axis = ... out of range for value with
            rank ..."), a repeated axis, or a gather of a scalar.
    """
    expected = "an int or a tuple/list of distinct ints" if several else "an int"
    named = axis if several and isinstance(axis, list | tuple) else (axis,)
    for a in named:
        if isinstance(a, bool) or not isinstance(a, int | np.integer):
            raise TypeError(
                f"{what}: axis must be {expected}, got {describe(axis)}; pass the axis "
                "number, e.g. axis=0 for the batch axis"
            )
    if rank == 0 and not several:
        raise ValueError(
            f"{what}: axis = {safe_repr(axis)} out of range for value with rank 0: scalars "
            "cannot be gathered; give each replica's value at least one dimension"
        )
    out: list[int] = []
    for a in named:
        if not -rank <= a < rank:
            raise ValueError(
                f"{what}: axis = {safe_repr(axis)} out of range for value with rank {rank}; "
                f"expected {'each axis' if several else 'an int'} in [{-rank}, {rank})"
            )
        k = int(a) % rank
        if k in out:
            raise ValueError(
                f"{what}: axis = {safe_repr(axis)} names axis {k} more than once (a value of "
                f"rank {rank}); expected {expected}: give each axis once"
            )
        out.append(k)
    return tuple(out)
