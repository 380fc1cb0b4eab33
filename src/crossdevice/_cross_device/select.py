"""`select_cross_device_ops`: the default `CrossDeviceOps` for a set of devices."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from crossdevice._core.devices import canonicalize, device_type
from crossdevice._cross_device import nccl
from crossdevice._cross_device.base import CrossDeviceOps
from crossdevice._cross_device.reduce_to_one import ReductionToOneDevice

__all__ = ["select_cross_device_ops"]

_LOG = logging.getLogger("crossdevice")


def select_cross_device_ops(devices: Sequence[Any]) -> CrossDeviceOps:
    """The `CrossDeviceOps` `MirroredStrategy` uses by default for `devices`.

    All host (CPU) devices get `HostAllReduce()` (TF picks ReductionToOneDevice, which
    gives the same sums at a fraction of the speed). GPUs on which NCCL can run get
    `NcclAllReduce(num_packs=1)` (logical GPUs sharing a card too: it sums them packed on
    the card); anything else (CPUs mixed with GPUs, no CUDA, torch
    without NCCL, a GPU listed twice) gets `ReductionToOneDevice()`, as in TF. It never
    picks an implementation that cannot run.

    Args:
        devices: device strings (or objects with a `.name`, such as `LogicalDevice`).

    Returns:
        A new `CrossDeviceOps`.

    Raises:
        ValueError: no devices, or a string that is not a device string.

    Example:
        >>> type(select_cross_device_ops(["CPU:0", "CPU:1"])).__name__
        'HostAllReduce'
    """
    if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(
            f"select_cross_device_ops expects a non-empty list of device strings, got {devices!r}"
        )
    names = tuple(canonicalize(d if isinstance(d, str) else d.name) for d in devices)
    if all(device_type(name) == "CPU" for name in names):
        from crossdevice._cross_device.host import HostAllReduce

        return HostAllReduce()
    if any(device_type(name) != "GPU" for name in names):
        return ReductionToOneDevice()
    mode, reason = nccl.nccl_mode(names)
    if mode != nccl.FALLBACK:
        # "shared_card": logical GPUs on one card, which NcclAllReduce sums packed there.
        return nccl.NcclAllReduce(num_packs=1)
    _LOG.warning(
        "NCCL cannot all-reduce between %s: %s. Using ReductionToOneDevice instead.",
        list(names),
        reason,
    )
    return ReductionToOneDevice()
