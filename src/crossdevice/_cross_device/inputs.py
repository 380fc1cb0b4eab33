"""Input checks for cross-device ops: values, options, pairs and axes.

Everything here runs before any work, so a call that fails has changed nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from crossdevice._arrays import backend_for, is_array, is_torch
from crossdevice._core.options import CommunicationOptions
from crossdevice._core.validate import describe
from crossdevice._cross_device.destinations import host_device
from crossdevice._values.values import DistributedValues, PerReplica
from crossdevice._values.variables import Variable

__all__ = [
    "as_array",
    "check_options",
    "check_pairs",
    "component_arrays",
    "make_per_replica",
]


def as_array(x: Any) -> Any:
    """A component as an array: a Variable's buffer, Python numbers as NumPy (TF's dtypes)."""
    if type(x) is np.ndarray or is_torch(x):  # the common case first: this runs per component
        return x
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, Variable) and not isinstance(x, DistributedValues):
        return x._value
    if is_array(x):
        return backend_for(x).asarray(x)
    raise ValueError(
        "expected an array (a NumPy array, a torch tensor or a Python number) or a "
        f"Variable; got {describe(x)}. Convert the value to an array first"
    )


def make_per_replica(value: Any) -> DistributedValues:
    """`value` as a distributed value (TF's `_make_tensor_into_per_replica`).

    A `DistributedValues` passes; an array or a `Variable` becomes a one-component
    `PerReplica` on its device (a host array: the current `device_scope`, else CPU:0).

    Raises:
        ValueError: a list or tuple (TF says so in `reduce` but silently returns None in
            places; we are strict everywhere), or anything without a device.
    """
    if isinstance(value, DistributedValues):
        return value
    if isinstance(value, list | tuple):
        raise ValueError(
            "Cannot convert `input_tensor` to a `PerReplica` object, got "
            f"{describe(value)} but expected an object that is not a tuple or list. "
            "Pass a PerReplica (one component per replica) or a single array"
        )
    if isinstance(value, Variable):
        return PerReplica((value._value,), devices=(value.device,))
    if is_array(value):
        array = as_array(value)
        own = backend_for(array).device_of(array)
        return PerReplica((array,), devices=(own or host_device(),))
    raise ValueError(
        "Cannot convert `input_tensor` to a `PerReplica` object because it doesn't have a "
        f"device set: expected a DistributedValues, an array or a Variable, got {describe(value)}"
    )


def component_arrays(value: DistributedValues, *, gather_axis: int | None = None) -> list[Any]:
    """The components of `value` as arrays, checked to agree.

    Args:
        value: the distributed value.
        gather_axis: None for a reduction (shapes must be equal); an axis for a gather
            (shapes may differ along it only).

    Returns:
        One array per component.

    Raises:
        ValueError: no components, mixed array libraries, or mismatched dtypes or shapes.
    """
    arrays = [as_array(c) for c in value.values]
    if not arrays:
        raise ValueError("`per_replica_value` must be non-empty; got a value with no components")
    first = arrays[0]
    kind, dtype, shape = type(first), first.dtype, tuple(first.shape)
    for i, array in enumerate(arrays[1:], start=1):
        # Compare dtype and shape objects directly (fast); names only for the message.
        if type(array) is kind and array.dtype == dtype and array.shape == shape:
            continue
        _raise_mismatch(value, arrays, i, gather_axis)
    return arrays


def _raise_mismatch(
    value: DistributedValues, arrays: list[Any], i: int, gather_axis: int | None
) -> None:
    """Raise ValueError for component `i`, unless it only differs along `gather_axis`."""
    backend, other = backend_for(arrays[0]), backend_for(arrays[i])
    if other is not backend:
        raise ValueError(
            f"all components of a distributed value must be of one array library; "
            f"component 0 is a {backend.name} array and component {i} a {other.name} one. "
            "Convert them to one library first"
        )
    dtype, shape = backend.dtype_name(arrays[0]), backend.shape(arrays[0])
    other_dtype, other_shape = other.dtype_name(arrays[i]), other.shape(arrays[i])
    if other_dtype == dtype and _shapes_agree(shape, other_shape, gather_axis):
        return
    what = "shape" if gather_axis is None else f"shape except along axis {gather_axis}"
    raise ValueError(
        f"all components of a distributed value must have the same dtype and {what}; "
        f"component 0 on {value._devices[0]} is {dtype}{list(shape)} but component {i} "
        f"on {value._devices[i]} is {other_dtype}{list(other_shape)}"
    )


def _shapes_agree(a: tuple[int, ...], b: tuple[int, ...], axis: int | None) -> bool:
    if axis is None:
        return a == b
    if len(a) != len(b):
        return False
    axis %= len(a)
    return all(x == y for k, (x, y) in enumerate(zip(a, b, strict=True)) if k != axis)


def check_options(options: Any) -> CommunicationOptions:
    """`options` or the default options; TypeError for anything else."""
    if options is None:
        return CommunicationOptions()
    if not isinstance(options, CommunicationOptions):
        raise TypeError(
            "options must be a crossdevice.experimental.CommunicationOptions or None; got "
            f"{describe(options)}"
        )
    return options


def check_pairs(value_destination_pairs: Any) -> list[tuple[DistributedValues, Any]]:
    """Validate and normalise `batch_reduce`'s pairs (TF's `_normalize_value_destination_pairs`).

    Returns:
        A new list of `(distributed value, destinations)` pairs.

    Raises:
        ValueError: not a sequence of 2-tuples, or a value that cannot be converted.
    """
    if isinstance(value_destination_pairs, str | bytes | DistributedValues) or not isinstance(
        value_destination_pairs, Sequence
    ):
        raise ValueError(
            "value_destination_pairs should be a list or tuple of (value, destinations) "
            f"tuples; got {describe(value_destination_pairs)}"
        )
    pairs = []
    for i, pair in enumerate(value_destination_pairs):
        if not isinstance(pair, tuple):
            raise ValueError(
                "Each element of `value_destination_pairs` should be a tuple; element "
                f"{i} is {describe(pair)}. Write [(value, destinations), ...]"
            )
        if len(pair) != 2:
            raise ValueError(
                "Each element of `value_destination_pairs` should be a tuple of size 2; "
                f"element {i} has {len(pair)} items: {describe(pair)}"
            )
        pairs.append((make_per_replica(pair[0]), pair[1]))
    return pairs
