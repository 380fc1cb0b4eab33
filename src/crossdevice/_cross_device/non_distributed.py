"""`reduce_non_distributed_value`: reducing a plain value that every replica shares."""

from __future__ import annotations

from typing import Any

from crossdevice._core.reduce_op import ReduceOp, as_reduce_op
from crossdevice._cross_device import inputs, results
from crossdevice._cross_device.destinations import get_devices_from
from crossdevice._values.values import DistributedValues

__all__ = ["reduce_non_distributed_value"]


def reduce_non_distributed_value(
    reduce_op: ReduceOp | str, value: Any, destinations: Any, num_replicas: int
) -> Any:
    """Reduce a value that is not distributed (the same on every replica) to `destinations`.

    TF's rules (`cross_device_ops.reduce_non_distributed_value`), in order:

    1. a `DistributedValues` is a ValueError (use a `CrossDeviceOps` instead);
    2. a Python number equal to 0 gives `0` (TF applies this to any non-tensor; we apply it
       to Python numbers only, since `array == 0` has no single truth value);
    3. MEAN gives `value` itself, unchanged and not copied;
    4. SUM with `num_replicas != 1` is a ValueError: summing identical values is not
       defined here (TF never multiplies by N, and neither do we);
    5. SUM with one replica copies `value` to the destination devices.

    Args:
        reduce_op: `ReduceOp.SUM`, `ReduceOp.MEAN`, or their names in any case.
        value: a plain value (array, number, Variable).
        destinations: see `CrossDeviceOps.reduce`.
        num_replicas: the number of replicas in sync.

    Returns:
        As above.

    Raises:
        ValueError: rules 1 and 4, invalid destinations, or `num_replicas` < 1.

    Example:
        >>> reduce_non_distributed_value("mean", 5.0, "CPU:0", 2)
        5.0
    """
    op = as_reduce_op(reduce_op)
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if isinstance(value, DistributedValues):
        raise ValueError(
            "You are passing a `DistributedValues` to `reduce_non_distributed_value`, which "
            f"is not allowed; got {type(value).__name__}. Reduce it with a CrossDeviceOps"
        )
    if isinstance(value, int | float) and not isinstance(value, bool) and value == 0:
        return 0
    if op is ReduceOp.MEAN:
        return value
    if num_replicas != 1:
        raise ValueError(
            f"A non-DistributedValues value {value} cannot be reduced with the given reduce "
            f"op {op}: summing the same value over {num_replicas} replicas is not defined. "
            "Return a per-replica value from the replica function, or use MEAN"
        )
    devices = get_devices_from(destinations)
    array = inputs.as_array(value)
    return results.simple_broadcast(array, devices, inputs=[array])
