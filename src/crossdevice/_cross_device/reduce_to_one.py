"""`ReductionToOneDevice`: copy every value to one device, reduce there, broadcast."""

from __future__ import annotations

import logging
from typing import Any, final

import numpy as np

from crossdevice._arrays import is_torch
from crossdevice._comm.devices import algorithms
from crossdevice._comm.devices.algorithms import AccumulationFn
from crossdevice._core.devices import canonicalize
from crossdevice._core.options import CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._cross_device import inputs, results
from crossdevice._cross_device.base import CrossDeviceOps
from crossdevice._cross_device.destinations import check_devices_exist, get_devices_from
from crossdevice._values.values import DistributedValues

__all__ = ["ReductionToOneDevice"]

_LOG = logging.getLogger("crossdevice")


@final
class ReductionToOneDevice(CrossDeviceOps):
    """A `CrossDeviceOps` that copies values to one device to reduce them.

    It always copies the values to one device, reduces them there and broadcasts the
    result to the destinations. It doesn't batch: `batch_reduce` reduces pair by pair.

    Between distinct CUDA devices, without an `accumulation_fn`, the reduce is one
    `torch.cuda.nccl.reduce` onto the reduce device (when it holds one of the values) and
    the broadcast one `torch.cuda.nccl.broadcast`, as `torch.nn.parallel.comm.reduce_add`
    does; NCCL then adds in its own order rather than in replica order.

    Args:
        reduce_to_device: the device to reduce on; None means the first destination
            device of each call.
        accumulation_fn: adds a list of arrays on that device; None means an in-order
            sum (`tf.math.add_n`). It must return a new array or one of its inputs (which
            is then copied); it must not modify its inputs.

    Raises:
        ValueError: `reduce_to_device` is not a device string.
        TypeError: `accumulation_fn` is not callable.

    Example:
        >>> import numpy as np
        >>> from crossdevice._values.values import PerReplica
        >>> ops = ReductionToOneDevice(reduce_to_device="CPU:1")
        >>> ops.reduce("mean", PerReplica([np.array(1.0), np.array(3.0)]), "CPU:0").tolist()
        2.0
    """

    def __init__(
        self, reduce_to_device: str | None = None, accumulation_fn: AccumulationFn | None = None
    ) -> None:
        if reduce_to_device is not None and not isinstance(reduce_to_device, str):
            raise ValueError(
                "reduce_to_device must be None or a device string such as 'CPU:0', got "
                f"{type(reduce_to_device).__name__}: {reduce_to_device!r}"
            )
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise TypeError(
                "accumulation_fn must be None or a function adding a list of arrays, got "
                f"{type(accumulation_fn).__name__}: {accumulation_fn!r}"
            )
        if reduce_to_device is not None and not reduce_to_device.strip():
            raise ValueError(
                "reduce_to_device must be a device string such as 'CPU:0', or None for the "
                f"first destination's device; got the empty string {reduce_to_device!r}"
            )
        self.reduce_to_device = canonicalize(reduce_to_device) if reduce_to_device else None
        self.accumulation_fn = accumulation_fn

    def __repr__(self) -> str:
        return (
            f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r}, "
            f"accumulation_fn={self.accumulation_fn!r})"
        )

    def _device_for(self, destination_devices: tuple[str, ...]) -> str:
        device = self.reduce_to_device or destination_devices[0]
        check_devices_exist((device,))
        return device

    def reduce_implementation(
        self,
        reduce_op: ReduceOp,
        per_replica_value: DistributedValues,
        destinations: Any,
        options: CommunicationOptions,
    ) -> Any:
        """Reduce on one device, then broadcast to the destination devices."""
        del options  # one device does all the work: there is nothing to pack or time out
        arrays = inputs.component_arrays(per_replica_value)
        devices = get_devices_from(destinations)
        device = self._device_for(devices)
        _LOG.debug("Reduce to %s then broadcast to %r.", device, devices)
        accumulate = self.accumulation_fn
        if accumulate is not None:
            accumulate = _checked(accumulate)
        reduced = algorithms.reduce_to_one(arrays, device, reduce_op, accumulate)
        like_numpy = isinstance(arrays[0], np.ndarray)
        return results.simple_broadcast(reduced, devices, inputs=arrays, like_numpy=like_numpy)

    def batch_reduce_implementation(
        self,
        reduce_op: ReduceOp,
        value_destination_pairs: list[tuple[DistributedValues, Any]],
        options: CommunicationOptions,
    ) -> list[Any]:
        """Reduce each pair in turn (this op does not batch).

        TF loops `reduce_implementation` here but `reduce` in the all-reduce classes, so
        only the latter take the single-replica shortcut per pair; we take it in both.
        """
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
        """Concatenate on one device, then broadcast."""
        del options
        arrays = inputs.component_arrays(per_replica_value, gather_axis=axis)
        devices = get_devices_from(destinations)
        gathered = algorithms.gather_to_one(arrays, self._device_for(devices), axis)
        like_numpy = isinstance(arrays[0], np.ndarray)
        return results.simple_broadcast(gathered, devices, inputs=arrays, like_numpy=like_numpy)


def _checked(accumulation_fn: AccumulationFn) -> AccumulationFn:
    """`accumulation_fn`, raising TypeError when it returns something that is not an array."""

    def accumulate(values: list[Any]) -> Any:
        reduced = accumulation_fn(values)
        if not (isinstance(reduced, np.ndarray | np.generic) or is_torch(reduced)):
            raise TypeError(
                f"accumulation_fn {accumulation_fn!r} must return an array (the sum of its "
                f"inputs), but it returned {type(reduced).__name__}: {reduced!r}"
            )
        expected = tuple(np.shape(values[0])) if values else None
        got = tuple(reduced.shape)
        if expected is not None and got != expected:
            raise ValueError(
                f"accumulation_fn {accumulation_fn!r} must return the element-wise sum of its "
                f"inputs, of their shape {expected}, but it returned shape {got}; reduce "
                "over the list (e.g. `lambda xs: sum(xs)`), not over an axis"
            )
        return reduced

    return accumulate
