"""A replica's values as the arrays a collective takes, and the host all-reduce of GPU replicas.

Shared by `StrategyExtended`'s merge-call collectives (`extended.py`) and the replica
threads' own (`replicated.py`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from crossdevice._arrays import backend_for, is_array
from crossdevice._arrays.handout import hand_out, hand_out_all
from crossdevice._comm.devices import algorithms
from crossdevice._core import nest
from crossdevice._core.devices import local_host_device
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._cross_device import inputs
from crossdevice._sync.call import CallSignature
from crossdevice._values.values import DistributedValues, Mirrored
from crossdevice._values.variables import Variable

__all__ = ["as_reducible_leaf", "host_all_reduce", "leaf_call", "on_host", "placed"]


def as_reducible_leaf(x: Any) -> Any:
    """A replica's leaf as an array of its own (Python numbers become new arrays)."""
    if isinstance(x, Variable):
        return x.read_value()
    if isinstance(x, DistributedValues):
        x = x._get()
        if isinstance(x, Variable):
            return x.read_value()
        return x
    return backend_for(x).asarray(x)


def placed(x: Any, device: str) -> Any:
    """`x` on `device` when it is an array (anything else as it is)."""
    return backend_for(x).to_device(x, device) if is_array(x) else x


def on_host(value: DistributedValues) -> bool:
    """Every component is a host array (NumPy, or a torch CPU tensor)."""
    for component in value.values:
        if backend_for(component).device_of(component) is not None:
            return False
        device = getattr(component, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            return False
    return True


def host_all_reduce(op: ReduceOp, value: DistributedValues) -> Any:
    """`value`'s host components reduced in replica order on the host, one per replica.

    The components are checked to agree first (one array library, dtype and shape), as
    every cross-device op checks them.
    """
    arrays = inputs.component_arrays(value)
    total = algorithms.reduce_to_one(arrays, local_host_device(), op)
    if isinstance(total, np.generic):
        total = np.asarray(total)
    if len(arrays) == 1:
        # One replica (OneDeviceStrategy on a GPU): its value, as every single-replica
        # reduction gives (a Mirrored of one reached the user from `run`).
        return hand_out(total, copy=False)
    return Mirrored(hand_out_all(total, len(arrays)), devices=value._devices)


def leaf_call(
    leaves: list[Any], structure: Any, kind: str, argument: str, axis: int | None
) -> tuple[tuple[Any, ...], CallSignature]:
    """A nest's leaves as arrays, and the call the replicas must agree on."""
    arrays = tuple(as_reducible_leaf(x) for x in leaves)
    sig = tuple((backend_for(x).shape(x), backend_for(x).dtype_name(x)) for x in arrays)
    # Compared as TF's nest compares (namedtuple classes by name and fields).
    return arrays, CallSignature(kind, argument, nest.Structure(structure), sig, axis)
