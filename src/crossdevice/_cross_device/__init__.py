"""Layer 6: TF's cross-device ops (`CrossDeviceOps` and its implementations).

Public names (re-exported by `crossdevice`): `CrossDeviceOps`, `ReductionToOneDevice`,
`HierarchicalCopyAllReduce`, `NcclAllReduce`. The strategy layer also uses
`reduce_non_distributed_value`, `select_cross_device_ops` and the destination helpers.
"""

from __future__ import annotations

from crossdevice._cross_device.all_reduce import AllReduceCrossDeviceOps as AllReduceCrossDeviceOps
from crossdevice._cross_device.base import CrossDeviceOps as CrossDeviceOps
from crossdevice._cross_device.destinations import devices_match as devices_match
from crossdevice._cross_device.destinations import get_devices_from as get_devices_from
from crossdevice._cross_device.destinations import validate_destinations as validate_destinations
from crossdevice._cross_device.hierarchical_copy import (
    HierarchicalCopyAllReduce as HierarchicalCopyAllReduce,
)
from crossdevice._cross_device.host import HostAllReduce as HostAllReduce
from crossdevice._cross_device.nccl import NcclAllReduce as NcclAllReduce
from crossdevice._cross_device.non_distributed import (
    reduce_non_distributed_value as reduce_non_distributed_value,
)
from crossdevice._cross_device.reduce_to_one import ReductionToOneDevice as ReductionToOneDevice
from crossdevice._cross_device.select import select_cross_device_ops as select_cross_device_ops

__all__ = [
    "AllReduceCrossDeviceOps",
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "HostAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "devices_match",
    "get_devices_from",
    "reduce_non_distributed_value",
    "select_cross_device_ops",
    "validate_destinations",
]
