"""`CrossDeviceOps`: the template methods every cross-device implementation shares.

The public methods (`reduce`, `batch_reduce`, `broadcast`, `_gather`) validate
everything first, take TF's single-replica shortcut, and only then call the hooks
(`reduce_implementation`, ...) that concrete classes override. A call that fails
validation has done nothing.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from crossdevice._arrays import backend_for
from crossdevice._core import validate
from crossdevice._core.options import CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op
from crossdevice._cross_device import inputs, results
from crossdevice._cross_device.destinations import (
    all_devices_match,
    devices_match,
    get_devices_from,
)
from crossdevice._sync.rendezvous import Rendezvous
from crossdevice._values.values import DistributedValues, PerReplica

__all__ = ["CrossDeviceOps"]


class CrossDeviceOps(abc.ABC):
    """Base class for cross-device reduction and broadcasting (`tf.distribute.CrossDeviceOps`).

    Pass an instance to `MirroredStrategy(cross_device_ops=...)` to choose how replicas'
    values are combined. Prefer the strategy's methods to calling these directly.

    Subclasses override the hooks only: `reduce_implementation`,
    `batch_reduce_implementation`, and optionally `broadcast_implementation` and
    `_gather_implementation`. The hooks receive a `ReduceOp` (never a string), a
    `DistributedValues` (never a plain array), validated destinations and
    `CommunicationOptions` (never None).

    Example:
        >>> import numpy as np
        >>> from crossdevice._cross_device import ReductionToOneDevice
        >>> from crossdevice._values.values import PerReplica
        >>> ops = ReductionToOneDevice()
        >>> ops.reduce("sum", PerReplica([np.array(1.0), np.array(2.0)]), "CPU:0").tolist()
        3.0
    """

    @property
    def _num_between_graph_workers(self) -> int:
        """Workers that each run this op on their own devices (1 in one process)."""
        return 1

    def _replica_communicator(self, devices: Sequence[str], rendezvous: Rendezvous) -> Any:
        """The communicator that runs replica-context collectives on the replicas themselves.

        A strategy asks its ops once: a communicator (its `all_reduce`, `all_gather` met
        in `rendezvous`, where the strategy's merge_calls meet too) makes
        `ReplicaContext.all_reduce` skip the merge_call; None (TF's way, the default)
        sends it through a merge_call to `batch_reduce`.
        """
        del devices, rendezvous
        return None

    # --- public template methods ------------------------------------------------------
    def reduce(
        self,
        reduce_op: ReduceOp | str,
        per_replica_value: Any,
        destinations: Any,
        options: CommunicationOptions | None = None,
    ) -> Any:
        """Reduce `per_replica_value` to `destinations`.

        Args:
            reduce_op: `ReduceOp.SUM`, `ReduceOp.MEAN`, or `"sum"`/`"mean"` in any case
                (TF's `CrossDeviceOps` does not convert strings: ReductionToOneDevice
                raises and NcclAllReduce silently sums; we accept them everywhere).
            per_replica_value: a `DistributedValues`, or an array (or `Variable`), taken
                as one replica's value on its device.
            destinations: a device string, a `DistributedValues`, a `Variable` or an
                array: the devices to reduce to. Pass the value itself for an all-reduce.
                A variable is never updated.
            options: `CommunicationOptions`, or None for the defaults. These in-process
                ops never wait on other threads, so `timeout_seconds` has nothing to bound;
                `bytes_per_pack` is ignored as in TF (only collective ops use it).

        Returns:
            The reduced array for one destination device, else a `Mirrored` over the
            destination devices.

        Raises:
            ValueError: the value cannot be converted to a distributed value, its
                components disagree, or the destinations are invalid.
            TypeError: `reduce_op` or `options` is of the wrong type.
        """
        op = as_reduce_op(reduce_op)
        options = inputs.check_options(options)
        value = inputs.make_per_replica(per_replica_value)
        inputs.component_arrays(value)
        validate.reducible(value, "CrossDeviceOps.reduce")
        get_devices_from(destinations)
        return self._reduce_checked(op, value, destinations, options)

    def batch_reduce(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Any,
        options: CommunicationOptions | None = None,
    ) -> list[Any]:
        """Reduce several values, each to its destinations, in one call.

        Args:
            reduce_op: `ReduceOp.SUM`, `ReduceOp.MEAN`, or their names in any case.
            value_destination_pairs: a list or tuple of `(value, destinations)` tuples; see
                `reduce` for each element.
            options: `CommunicationOptions`, or None for the defaults.

        Returns:
            One result per pair, as `reduce` returns it. An empty list gives `[]` (TF raises
            IndexError there).

        Raises:
            ValueError: the pairs are not a sequence of 2-tuples, or a value or
                destination is invalid (checked for every pair before any work).
        """
        op = as_reduce_op(reduce_op)
        options = inputs.check_options(options)
        pairs = inputs.check_pairs(value_destination_pairs)
        for value, destinations in pairs:
            inputs.component_arrays(value)
            get_devices_from(destinations)
        validate.reducible([value for value, _ in pairs], "CrossDeviceOps.batch_reduce")
        if not pairs:
            return []
        if (
            self._num_between_graph_workers == 1
            and all(len(value.values) == 1 for value, _ in pairs)
            and all_devices_match(pairs)
        ):
            # TF's shortcut returns the raw components; we return copies so a result never
            # aliases an input.
            return [self._copy_single(value, destinations) for value, destinations in pairs]
        return self.batch_reduce_implementation(op, pairs, options)

    def broadcast(self, tensor: Any, destinations: Any) -> Any:
        """Copy `tensor` to the devices of `destinations` (a variable there is not updated).

        Args:
            tensor: an array, a `Variable` (its value) or a `Mirrored` (its primary).
            destinations: see `reduce`.

        Returns:
            The array for one destination device, else a `Mirrored`.
        """
        get_devices_from(destinations)
        _broadcast_source(tensor)
        return self.broadcast_implementation(tensor, destinations)

    def _gather(
        self,
        per_replica_value: Any,
        destinations: Any,
        axis: int,
        options: CommunicationOptions | None = None,
    ) -> Any:
        """Concatenate the components of `per_replica_value` along `axis` on `destinations`.

        Args:
            per_replica_value: a `DistributedValues` or one array; components may differ
                in size along `axis` only.
            destinations: see `reduce`.
            axis: the axis to concatenate along (negative counts from the end).
            options: `CommunicationOptions`, or None for the defaults.

        Returns:
            The gathered array for one destination device, else a `Mirrored`.

        Raises:
            TypeError: `axis` is not an int.
            ValueError: `axis` out of range, or components that disagree off `axis`.
        """
        options = inputs.check_options(options)
        value = inputs.make_per_replica(per_replica_value)
        first = inputs.as_array(value.values[0])
        (axis,) = validate.axes(
            axis, len(backend_for(first).shape(first)), "CrossDeviceOps._gather", several=False
        )
        inputs.component_arrays(value, gather_axis=axis)
        get_devices_from(destinations)
        if (
            self._num_between_graph_workers == 1
            and len(value.values) == 1
            and devices_match(value, destinations)
        ):
            return self._copy_single(value, destinations)
        return self._gather_implementation(value, destinations, axis, options)

    # --- hooks ------------------------------------------------------------------------
    @abc.abstractmethod
    def reduce_implementation(
        self,
        reduce_op: ReduceOp,
        per_replica_value: DistributedValues,
        destinations: Any,
        options: CommunicationOptions,
    ) -> Any:
        """Reduce a validated value to validated destinations (override this)."""

    @abc.abstractmethod
    def batch_reduce_implementation(
        self,
        reduce_op: ReduceOp,
        value_destination_pairs: list[tuple[DistributedValues, Any]],
        options: CommunicationOptions,
    ) -> list[Any]:
        """Reduce validated `(value, destinations)` pairs (override this)."""

    def broadcast_implementation(self, tensor: Any, destinations: Any) -> Any:
        """Copy `tensor` to each destination device (TF's `simple_broadcast`)."""
        source = _broadcast_source(tensor)
        return results.simple_broadcast(
            source, get_devices_from(destinations), inputs=_user_arrays(tensor, source)
        )

    def _gather_implementation(
        self,
        per_replica_value: DistributedValues,
        destinations: Any,
        axis: int,
        options: CommunicationOptions,
    ) -> Any:
        """Gather a validated value along a validated axis (override to support gather)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement _gather_implementation; use "
            "ReductionToOneDevice, HierarchicalCopyAllReduce or NcclAllReduce, which do"
        )

    # --- shared helpers ---------------------------------------------------------------
    def _reduce_checked(
        self,
        reduce_op: ReduceOp,
        value: DistributedValues,
        destinations: Any,
        options: CommunicationOptions,
    ) -> Any:
        """`reduce` after validation: the single-replica shortcut, else the hook."""
        if (
            self._num_between_graph_workers == 1
            and len(value.values) == 1
            and devices_match(value, destinations)
        ):
            # SUM or MEAN of one replica is the value itself (TF: an identity, no arithmetic).
            return self._copy_single(value, destinations)
        return self.reduce_implementation(reduce_op, value, destinations, options)

    @staticmethod
    def _copy_single(value: DistributedValues, destinations: Any) -> Any:
        array = inputs.as_array(value.values[0])
        return results.simple_broadcast(array, get_devices_from(destinations), inputs=[array])


def _broadcast_source(tensor: Any) -> Any:
    """The array to broadcast; ValueError for a PerReplica, a list or a non-array."""
    if isinstance(tensor, PerReplica):
        raise ValueError(
            "broadcast expects one value to copy to every destination, got a PerReplica "
            f"with {len(tensor.values)} different components; reduce it first"
        )
    if isinstance(tensor, DistributedValues):
        return inputs.as_array(tensor._get_on_device_or_primary())
    if isinstance(tensor, list | tuple):
        raise ValueError(
            f"broadcast expects one array, got a {type(tensor).__name__}: {tensor!r}; "
            "convert it to an array first"
        )
    return inputs.as_array(tensor)


def _user_arrays(tensor: Any, source: Any) -> list[Any]:
    """The user's arrays that a broadcast result must not alias."""
    if isinstance(tensor, DistributedValues):
        return [inputs.as_array(c) for c in tensor.values]
    return [source]
