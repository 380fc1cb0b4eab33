"""`AllReduceCrossDeviceOps`: what `HierarchicalCopyAllReduce` and `NcclAllReduce` share.

An all-reduce happens only when the value's devices are the destination devices (TF's
`_devices_match`); anything else goes to an internal `ReductionToOneDevice`. A batch
whose values all match is packed (see `packing`), all-reduced piece by piece by the
subclass's algorithm, and unpacked.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from crossdevice._core.options import CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._cross_device import inputs, packing, results
from crossdevice._cross_device.base import CrossDeviceOps
from crossdevice._cross_device.destinations import (
    all_devices_match,
    devices_match,
    get_devices_from,
)
from crossdevice._cross_device.reduce_to_one import ReductionToOneDevice
from crossdevice._values.values import DistributedValues

__all__ = ["AllReduceCrossDeviceOps"]

_LOG = logging.getLogger("crossdevice")


class AllReduceCrossDeviceOps(CrossDeviceOps):
    """Base of the all-reduce implementations (TF's `AllReduceCrossDeviceOps`).

    Args:
        num_packs: the number of flat buffers per dtype a batch is packed into; 0 means
            one all-reduce per array.

    Raises:
        ValueError: `num_packs` is negative (with the subclass's TF message).
        TypeError: `num_packs` is not an int.
    """

    #: TF's error for a negative `num_packs`, formatted with the value.
    _NUM_PACKS_ERROR: ClassVar[str] = "all-reduce requires num_packs >= 0, but {} is specified"
    #: The algorithm's name in log messages.
    _ALGORITHM: ClassVar[str] = "all-reduce"

    def __init__(self, num_packs: int = 1) -> None:
        if isinstance(num_packs, bool) or not isinstance(num_packs, int | np.integer):
            raise TypeError(
                f"num_packs must be a non-negative int, got {type(num_packs).__name__}: "
                f"{num_packs!r}"
            )
        if num_packs < 0:
            raise ValueError(
                self._NUM_PACKS_ERROR.format(num_packs)
                + "; pass 0 (no packing) or a positive number of packs"
            )
        self.num_packs = int(num_packs)
        self._simple_cross_replica_ops = ReductionToOneDevice()
        self._warn_lock = threading.Lock()
        self._gather_warned = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_packs={self.num_packs})"

    # --- what subclasses provide ------------------------------------------------------
    def _can_all_reduce(self, devices: tuple[str, ...]) -> bool:
        """Whether this algorithm can run on `devices` (else the fallback is used)."""
        del devices
        return True

    @abc.abstractmethod
    def _all_reduce_pieces(
        self,
        reduce_op: ReduceOp,
        pieces: list[list[Any]],
        devices: tuple[str, ...],
        borrowed: Sequence[bool],
    ) -> list[list[Any]]:
        """All-reduce `pieces[device][k]` across devices for every k.

        Args:
            reduce_op: SUM or MEAN.
            pieces: per device, its pieces (all devices have the same count, shapes and
                dtypes).
            devices: the device of each entry of `pieces`.
            borrowed: per piece index, whether the pieces are (views of) the user's
                arrays: those must never be written.

        Returns:
            Per device, its reduced pieces.
        """

    # --- hooks ------------------------------------------------------------------------
    def reduce_implementation(
        self,
        reduce_op: ReduceOp,
        per_replica_value: DistributedValues,
        destinations: Any,
        options: CommunicationOptions,
    ) -> Any:
        """All-reduce when the destinations are the value's devices, else reduce to one.

        TF also sends every reduce with a CPU destination to the fallback; we all-reduce
        on logical CPU devices too (their copies are free).
        """
        if devices_match(per_replica_value, destinations) and self._can_all_reduce(
            per_replica_value._devices
        ):
            return self._batch_all_reduce(reduce_op, [per_replica_value], [destinations])[0]
        return self._simple_cross_replica_ops._reduce_checked(
            reduce_op, per_replica_value, destinations, options
        )

    def batch_reduce_implementation(
        self,
        reduce_op: ReduceOp,
        value_destination_pairs: list[tuple[DistributedValues, Any]],
        options: CommunicationOptions,
    ) -> list[Any]:
        """One packed all-reduce when every pair is an all-reduce on the same devices."""
        if (
            all_devices_match(value_destination_pairs)
            and _same_device_lists(value_destination_pairs)
            and self._can_all_reduce(value_destination_pairs[0][0]._devices)
        ):
            return self._batch_all_reduce(
                reduce_op,
                [value for value, _ in value_destination_pairs],
                [destinations for _, destinations in value_destination_pairs],
            )
        # TF: "if destinations are different, split into several _batch_reduce invocations"
        # is a TODO there; each pair is reduced on its own (all-reduced where it matches).
        return [
            self._reduce_checked(reduce_op, value, destinations, options)
            for value, destinations in value_destination_pairs
        ]

    def _gather_implementation(
        self,
        per_replica_value: DistributedValues,
        destinations: Any,
        axis: int,
        options: CommunicationOptions,
    ) -> Any:
        """Gather on one device, then broadcast (TF has no all-reduce gather either)."""
        with self._warn_lock:
            warn, self._gather_warned = not self._gather_warned, True
        if warn:
            _LOG.warning(
                "gather/all_gather with %s is not supported. Falling back to gather on one "
                "device and then broadcast (logged once per instance).",
                type(self).__name__,
            )
        return self._simple_cross_replica_ops._gather_implementation(
            per_replica_value, destinations, axis, options
        )

    # --- the batched all-reduce -------------------------------------------------------
    def _batch_all_reduce(
        self,
        reduce_op: ReduceOp,
        values: Sequence[DistributedValues],
        destinations: Sequence[Any],
    ) -> list[Any]:
        devices = tuple(values[0]._devices)
        per_value = [_arrays_in_order(value, devices) for value in values]
        per_device = [[arrays[j] for arrays in per_value] for j in range(len(devices))]
        plan = packing.plan_packs(per_device[0], self.num_packs)
        _LOG.debug(
            "batch_all_reduce: %d all-reduces with algorithm = %s, num_packs = %d",
            len(values),
            self._ALGORITHM,
            self.num_packs,
        )
        pieces = [packing.pack(plan, batch) for batch in per_device]
        reduced = self._all_reduce_pieces(reduce_op, pieces, devices, plan.borrowed_pieces())
        # On host devices every device's pieces are the same objects: unpack them once.
        unpacked: dict[tuple[int, ...], list[Any]] = {}
        per_device_out = []
        for device_pieces in reduced:
            key = tuple(id(p) for p in device_pieces)
            if key not in unpacked:
                unpacked[key] = packing.unpack(plan, device_pieces)
            per_device_out.append(unpacked[key])
        out = []
        for i, arrays in enumerate(per_value):
            column = [per_device_out[j][i] for j in range(len(devices))]
            if plan.borrows:
                column = _owned_column(column, arrays)
            out.append(
                results.mirror(
                    column,
                    devices,
                    get_devices_from(destinations[i]),
                    # Per value: a nest may mix NumPy leaves with torch tensors.
                    like_numpy=isinstance(arrays[0], np.ndarray),
                )
            )
        return out


def _same_device_lists(pairs: Sequence[tuple[DistributedValues, Any]]) -> bool:
    """Every value lists the first one's distinct devices, in any order (batchable)."""
    first = pairs[0][0]._devices
    if len(set(first)) != len(first):
        return False
    ordered = sorted(first)
    return all(sorted(value._devices) == ordered for value, _ in pairs)


def _arrays_in_order(value: DistributedValues, devices: tuple[str, ...]) -> list[Any]:
    """The components of `value` ordered as `devices` (TF assumes one order; we reorder)."""
    arrays = inputs.component_arrays(value)
    if tuple(value._devices) == devices:
        return arrays
    position = {device: k for k, device in enumerate(value._devices)}
    return [arrays[position[device]] for device in devices]


def _owned_column(column: list[Any], user_arrays: Sequence[Any]) -> list[Any]:
    """Copy results that are (views of) the user's arrays (borrowed pieces, one device)."""
    copies: dict[int, Any] = {}
    out = []
    for x in column:
        if id(x) not in copies:
            copies[id(x)] = results.owned(x, user_arrays)
        out.append(copies[id(x)])
    return out
