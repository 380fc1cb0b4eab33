"""Destinations of a reduction: validation, their devices, and matching.

A destination is what TF's `reduce(..., destinations)` accepts: a device string, a
`DistributedValues` (including distributed variables), a `Variable`, or an array. Only
its devices matter: a variable passed as destination is never updated.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from crossdevice._arrays import backend_for, is_torch
from crossdevice._core.devices import (
    canonicalize,
    check_device_exists,
    current_device,
    get_logical_cpu_devices,
)
from crossdevice._core.validate import describe
from crossdevice._values.values import DistributedValues
from crossdevice._values.variables import Variable

__all__ = [
    "all_devices_match",
    "check_devices_exist",
    "devices_match",
    "get_devices_from",
    "host_device",
    "validate_destinations",
]

_KINDS = "a DistributedValues object, a Variable object, or a device string"


def host_device() -> str:
    """The device of a host array: the current `device_scope`, else `CPU:0`."""
    return current_device() or canonicalize("CPU:0")


@functools.lru_cache(maxsize=1024)
def _check_cached(devices: tuple[str, ...], num_cpus: int) -> None:
    del num_cpus  # part of the cache key: the answer changes with the logical CPU count
    for device in devices:
        check_device_exists(device)


def check_devices_exist(devices: tuple[str, ...]) -> None:
    """Raise ValueError naming the existing devices when one of `devices` does not exist.

    Args:
        devices: canonical device strings.
    """
    # Cached per device tuple: a training step reduces hundreds of values on the same
    # devices, and parsing each device string again would dominate small reductions.
    _check_cached(devices, get_logical_cpu_devices())


def _is_array_destination(x: object) -> bool:
    # Python numbers are not accepted: like TF (a float is no Tensor), they have no device.
    return isinstance(x, np.ndarray | np.generic) or is_torch(x)


def get_devices_from(destinations: Any) -> tuple[str, ...]:
    """The canonical devices of `destinations`, after validating it.

    Unlike TF, the devices of a `DistributedValues` are canonical (our values
    canonicalise them at construction) and every device is checked to exist.

    Args:
        destinations: a device string, a `DistributedValues`, a `Variable`, or an array
            (a torch CUDA tensor names its GPU; a host array lives on the current
            `device_scope` device, else `CPU:0`).

    Returns:
        The devices, in order (a `DistributedValues` may list a device twice).

    Raises:
        ValueError: not one of the kinds above, empty, unparsable, or naming a device
            that does not exist.

    Example:
        >>> get_devices_from("cpu:1")
        ('/job:localhost/replica:0/task:0/device:CPU:1',)
    """
    if isinstance(destinations, DistributedValues):
        devices = tuple(destinations._devices)
    elif isinstance(destinations, str):
        if not destinations.strip():
            raise ValueError(
                f"destinations can not be empty; got {destinations!r}. Pass a device string "
                "such as 'CPU:0', or the value itself for an all-reduce"
            )
        devices = (canonicalize(destinations),)
    elif isinstance(destinations, Variable):
        devices = (canonicalize(destinations.device),)
    elif _is_array_destination(destinations):
        own = backend_for(destinations).device_of(destinations)
        devices = (own or host_device(),)
    else:
        raise ValueError(
            f"destinations must be one of {_KINDS}; got {describe(destinations)}. "
            "To reduce to several devices pass a DistributedValues on them (or the value "
            "itself for an all-reduce), not a list of device strings"
        )
    if not devices:
        raise ValueError(f"destinations can not be empty; got {describe(destinations)}")
    check_devices_exist(devices)
    return devices


def validate_destinations(destinations: Any) -> None:
    """Raise ValueError unless `destinations` is a valid destination (see `get_devices_from`)."""
    get_devices_from(destinations)


def devices_match(left: Any, right: Any) -> bool:
    """Whether two values or destinations are on the same set of devices (order ignored).

    TF's `_devices_match`: `left is right` or the device sets are equal.
    """
    return left is right or set(get_devices_from(left)) == set(get_devices_from(right))


def all_devices_match(value_destination_pairs: Sequence[tuple[Any, Any]]) -> bool:
    """Whether every value matches its destination and the first value (TF's rule)."""
    if not value_destination_pairs:
        return False
    first = value_destination_pairs[0][0]
    return all(
        devices_match(value, destination) and devices_match(value, first)
        for value, destination in value_destination_pairs
    )
