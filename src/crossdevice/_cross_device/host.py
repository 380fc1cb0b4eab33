"""`HostAllReduce`: the default `CrossDeviceOps` for host (CPU) devices.

An all-reduce between logical CPU devices is a reduction in one address space, bounded by
memory bandwidth (docs/design.md §4). This op hands it to the blocked, multi-threaded host
all-reduce (`crossdevice._comm.local.thread`): arrays grouped by dtype, small ones
packed, large ones summed in cache-sized blocks by a pool of threads, every input byte
read once, adds in replica order (bitwise equal to `x0 + x1 + ...`), one read-only result
buffer shared by every replica. Inside `strategy.run`, `ReplicaContext.all_reduce` goes
further: the replicas' own threads each reduce a slice, without a `merge_call`.

Reductions that are not host all-reduces (to another device, to a GPU, gathers) go to
`ReductionToOneDevice`, whose semantics are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

from crossdevice._arrays import is_torch
from crossdevice._arrays.buffer_pool import BufferPool
from crossdevice._arrays.handout import hand_out_each
from crossdevice._core.devices import device_type
from crossdevice._core.options import CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._cross_device import inputs
from crossdevice._cross_device.base import CrossDeviceOps
from crossdevice._cross_device.destinations import devices_match, get_devices_from
from crossdevice._cross_device.reduce_to_one import ReductionToOneDevice
from crossdevice._sync.rendezvous import Rendezvous
from crossdevice._values.values import DistributedValues, Mirrored

__all__ = ["HostAllReduce"]


def _is_host_array(x: Any) -> bool:
    return not is_torch(x) or x.device.type == "cpu"


@final
class HostAllReduce(CrossDeviceOps):
    """All-reduce for host devices, at memory bandwidth (ours; the default on CPUs).

    `MirroredStrategy` on logical CPU devices uses it unless told otherwise. Results are
    the exact in-order sums `ReductionToOneDevice` computes, bitwise.

    Example:
        >>> import numpy as np
        >>> from crossdevice._values.values import PerReplica
        >>> value = PerReplica([np.ones(3, np.float32), np.full(3, 2.0, np.float32)])
        >>> HostAllReduce().reduce("sum", value, value).values[1]
        array([3., 3., 3.], dtype=float32)
    """

    def __init__(self) -> None:
        self._fallback = ReductionToOneDevice()
        self._pool = BufferPool()

    def __repr__(self) -> str:
        return "HostAllReduce()"

    def _replica_communicator(self, devices: Sequence[str], rendezvous: Rendezvous) -> Any:
        """Replica-context all-reduces on the replicas' own threads, without a merge_call."""
        if len(devices) < 2 or not all(device_type(d) == "CPU" for d in devices):
            return None
        from crossdevice._comm.local.thread import ThreadCommunicator

        return ThreadCommunicator(len(devices), name=rendezvous.name, rendezvous=rendezvous)

    def _is_host_all_reduce(self, value: DistributedValues, destinations: Any) -> bool:
        # One replica takes ReductionToOneDevice's per-pair identity shortcut (TF's).
        return (
            len(value.values) > 1
            and devices_match(value, destinations)
            and all(device_type(d) == "CPU" for d in value._devices)
            and all(_is_host_array(inputs.as_array(c)) for c in value.values)
        )

    def reduce_implementation(
        self,
        reduce_op: ReduceOp,
        per_replica_value: DistributedValues,
        destinations: Any,
        options: CommunicationOptions,
    ) -> Any:
        """All-reduce on the host, or ReductionToOneDevice for any other reduction."""
        return self.batch_reduce_implementation(
            reduce_op, [(per_replica_value, destinations)], options
        )[0]

    def batch_reduce_implementation(
        self,
        reduce_op: ReduceOp,
        value_destination_pairs: list[tuple[DistributedValues, Any]],
        options: CommunicationOptions,
    ) -> list[Any]:
        """One packed host all-reduce for every pair that is one; the rest as TF does."""
        from crossdevice._comm.local.host_all_reduce import all_reduce_host

        hosted = [
            i
            for i, (value, destinations) in enumerate(value_destination_pairs)
            if self._is_host_all_reduce(value, destinations)
        ]
        out: list[Any] = [None] * len(value_destination_pairs)
        groups: dict[tuple[str, ...], list[int]] = {}
        for i in hosted:
            groups.setdefault(value_destination_pairs[i][0]._devices, []).append(i)
        for devices, members in groups.items():
            # Validated like every other op (naming the components), converted once.
            arrays = [inputs.component_arrays(value_destination_pairs[i][0]) for i in members]
            per_replica = [[a[r] for a in arrays] for r in range(len(devices))]
            reduced = all_reduce_host(per_replica, reduce_op, self._pool)
            for k, i in enumerate(members):
                out[i] = _mirrored(
                    [reduced[r][k] for r in range(len(devices))],
                    devices,
                    get_devices_from(value_destination_pairs[i][1]),
                )
        rest = sorted(set(range(len(value_destination_pairs))) - set(hosted))
        if rest:
            others = self._fallback.batch_reduce_implementation(
                reduce_op, [value_destination_pairs[i] for i in rest], options
            )
            for i, result in zip(rest, others, strict=True):
                out[i] = result
        return out

    def _gather_implementation(
        self,
        per_replica_value: DistributedValues,
        destinations: Any,
        axis: int,
        options: CommunicationOptions,
    ) -> Any:
        """Gathers are ReductionToOneDevice's."""
        return self._fallback._gather_implementation(per_replica_value, destinations, axis, options)


def _mirrored(results: Sequence[Any], devices: Sequence[str], destinations: Sequence[str]) -> Any:
    """Results in the destinations' device order (devices match as sets).

    NumPy results are one read-only buffer shared by every replica. torch has no
    read-only tensors, so each destination after the first gets its own copy: an in-place
    edit on one replica must not change another's value.
    """
    by_device = dict(zip(devices, results, strict=True))
    ordered = hand_out_each([by_device[d] for d in destinations])
    if len(ordered) == 1:
        return ordered[0]
    return Mirrored(ordered, devices=destinations)
