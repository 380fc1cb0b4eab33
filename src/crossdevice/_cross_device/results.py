"""Turning computed arrays into what the user gets back.

Rules (docs/design.md §3): results never alias inputs; host (NumPy) results are read-only and
every host destination may share one buffer (TF tensors are immutable too); torch
results are one tensor per destination, so an in-place edit on one replica's result
cannot leak into another's. One destination device gives the bare array, several a
`Mirrored` (TF's regroup unwraps 1-tuples).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from crossdevice._arrays import NUMPY, backend_for, is_torch
from crossdevice._arrays.handout import hand_out, hand_out_each
from crossdevice._comm.devices import algorithms
from crossdevice._values.values import Mirrored

__all__ = ["aliases", "mirror", "owned", "simple_broadcast"]


def aliases(result: Any, inputs: Sequence[Any]) -> bool:
    """Whether `result` is, or may share memory with, one of `inputs`."""
    for x in inputs:
        if result is x:
            return True
        if isinstance(result, np.ndarray) and isinstance(x, np.ndarray):
            if np.may_share_memory(result, x):
                return True
        elif is_torch(result) and is_torch(x) and result.device == x.device:
            # Zero-size tensors may report a null pointer: treat them as aliasing (cheap).
            ptr = result.untyped_storage().data_ptr()
            if ptr == 0 or ptr == x.untyped_storage().data_ptr():
                return True
    return False


def owned(result: Any, inputs: Sequence[Any]) -> Any:
    """`result`, copied when it aliases one of `inputs` (so it may be frozen or handed out)."""
    if type(result) is np.ndarray:  # the per-step case: `aliases` of a NumPy result
        for x in inputs:
            if result is x or (isinstance(x, np.ndarray) and np.may_share_memory(result, x)):
                return NUMPY.copy(result)
        return result
    if aliases(result, inputs):
        return backend_for(result).copy(result)
    return result


def _host_like(value: Any, like_numpy: bool) -> Any:
    """A torch CPU tensor back to NumPy when the inputs were NumPy (a GPU reduce device)."""
    if like_numpy and is_torch(value) and value.device.type == "cpu":
        return NUMPY.asarray(backend_for(value).to_numpy(value))
    return value


def mirror(
    per_device: Sequence[Any],
    result_devices: Sequence[str],
    destinations: Sequence[str],
    *,
    like_numpy: bool,
) -> Any:
    """The user-facing result on `destinations` from arrays already computed.

    Args:
        per_device: owned result arrays (none aliases a user's input), one per entry of
            `result_devices`; host results may all be one object.
        result_devices: the device of each result.
        destinations: the destination devices; each takes the result on its device, else
            a copy of the first result.
        like_numpy: the inputs were NumPy arrays (host results stay NumPy).

    Returns:
        The bare array for one destination device, else a `Mirrored` over `destinations`.
    """
    first = per_device[0]
    if (
        type(first) is np.ndarray
        and all(x is first for x in per_device)
        and not any("GPU" in d for d in destinations)
    ):
        # The common host case: one read-only buffer serves every destination.
        shared = hand_out(first, copy=len(destinations) > 1)
        if len(destinations) == 1:
            return shared
        return Mirrored([shared] * len(destinations), devices=destinations)
    by_device: dict[str, Any] = {}
    scalars: dict[int, np.ndarray] = {}
    for device, computed in zip(result_devices, per_device, strict=True):
        value = computed
        if isinstance(value, np.generic):
            # NumPy ufuncs turn 0-d arrays into scalars; hand back 0-d arrays like the inputs.
            value = scalars.setdefault(id(computed), np.asarray(computed))
        by_device.setdefault(device, value)
    placed = []
    for device in destinations:
        source = by_device.get(device, next(iter(by_device.values())))
        placed.append(_host_like(backend_for(source).to_device(source, device), like_numpy))
    # One read-only buffer may serve every host destination; a tensor handed out twice
    # is copied.
    out = hand_out_each(placed)
    if len(out) == 1:
        return out[0]
    return Mirrored(out, devices=destinations)


def simple_broadcast(
    value: Any,
    destinations: Sequence[str],
    *,
    inputs: Sequence[Any],
    like_numpy: bool | None = None,
) -> Any:
    """Copy `value` to each destination device (TF's `simple_broadcast`).

    Args:
        value: an array (computed or the user's).
        destinations: canonical destination devices.
        inputs: the user's arrays: `value` is copied first when it aliases one of them.
        like_numpy: host results are NumPy arrays; default: whether `value` is one.

    Returns:
        The bare array for one destination device, else a `Mirrored`.
    """
    if like_numpy is None:
        like_numpy = isinstance(value, np.ndarray | np.generic)
    value = owned(value, inputs)
    if isinstance(value, np.generic):
        value = np.asarray(value)
    # Every destination at once: between CUDA devices this is one NCCL broadcast.
    copies = algorithms.broadcast(value, destinations)
    return mirror(copies, destinations, destinations, like_numpy=like_numpy)
