"""`DistributedValues`, `PerReplica` and `Mirrored` (TF `values.py`).

A distributed value holds one component per local replica, and the canonical device of
each. Host arrays carry no device of their own, so a value built by hand without
`devices` is taken to live on `CPU:0`, `CPU:1`, ... in order (torch CUDA tensors on
their own GPU); values made by a strategy carry the strategy's devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from crossdevice._arrays import backend_for
from crossdevice._core import context, validate
from crossdevice._core.devices import canonicalize
from crossdevice._values.operators import ArrayOperators

__all__ = ["DistributedValues", "Mirrored", "PerReplica", "default_devices"]


def default_devices(values: Sequence[Any]) -> tuple[str, ...]:
    """The device of each component: its own for device tensors, else `CPU:i`."""
    from crossdevice._arrays import is_array

    devices = []
    for i, value in enumerate(values):
        if is_array(value):
            own = backend_for(value).device_of(value)  # a CUDA tensor names its GPU
        else:
            device = getattr(value, "device", None)  # a variable names its device
            own = canonicalize(device) if isinstance(device, str) and device else None
        devices.append(own or canonicalize(f"CPU:{i}"))
    return tuple(devices)


class DistributedValues:
    """Base class for values with one component per replica (`tf.distribute.DistributedValues`).

    Args:
        values: the components, one per local replica, in replica order.
        devices: the device of each component; see the module docstring for the default.

    Example:
        >>> import numpy as np
        >>> pr = PerReplica([np.float32(1.0), np.float32(2.0)])
        >>> pr.values
        (np.float32(1.0), np.float32(2.0))
    """

    __slots__ = ("__weakref__", "_devices", "_values")

    def __init__(self, values: Sequence[Any], devices: Sequence[str] | None = None) -> None:
        if isinstance(values, DistributedValues) or not isinstance(values, Sequence | tuple):
            raise ValueError(
                f"{type(self).__name__} expects a sequence of per-replica components, "
                f"got {type(values).__name__}: {values!r}"
            )
        values = tuple(values)
        if not values:
            raise ValueError(f"{type(self).__name__} needs at least one component, got none")
        if devices is None:
            devices = default_devices(values)
        else:
            devices = tuple(canonicalize(d) for d in devices)
            if len(devices) != len(values):
                raise ValueError(
                    f"{type(self).__name__} got {len(values)} components but {len(devices)} "
                    f"devices ({list(devices)}); pass one device per component"
                )
        self._values: tuple[Any, ...] = values
        self._devices: tuple[str, ...] = tuple(devices)

    @classmethod
    def _from_parts(cls, values: tuple[Any, ...], devices: tuple[str, ...]) -> Any:
        """Build from already-validated parts: canonical devices, one per component.

        The per-step path (`run` results, `merge_call` arguments) uses it with the
        strategy's device tuple, which was canonicalised once at construction.
        """
        obj = cls.__new__(cls)
        obj._values = values
        obj._devices = devices
        return obj

    @property
    def values(self) -> tuple[Any, ...]:
        """The components, one per local replica."""
        return self._values

    @property
    def _primary(self) -> Any:
        return self._values[0]

    def _local_id(self) -> int | None:
        frame = context.current_frame()
        if frame is None:
            return 0  # the default replica context is replica 0
        if frame.replica_context is not None:
            return frame.local_replica_id
        return frame.update_replica_id

    def _get(self) -> Any:
        """The component of the current replica, or the cross-replica value."""
        replica = self._local_id()
        if replica is None:
            return self._get_cross_replica()
        if replica >= len(self._values):
            raise ValueError(
                f"{type(self).__name__} has {len(self._values)} components but the current "
                f"replica is {replica}; was it made by another strategy?"
            )
        return self._values[replica]

    def _get_cross_replica(self) -> Any:
        raise NotImplementedError(
            "This method should be overridden by sub-classes which support cross-replica accesses."
        )

    def _get_on_device_or_primary(self) -> Any:
        """The component of the current replica (or update), else the primary."""
        replica = self._local_id()
        if replica is None or replica >= len(self._values):
            return self._primary
        return self._values[replica]

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"

    def __str__(self) -> str:
        return self.__repr__()


class PerReplica(DistributedValues):
    """One possibly different value per replica (what `strategy.run` returns).

    Reading it outside a replica context is an error, as in TF: reduce it with
    `strategy.reduce` or look at `strategy.experimental_local_results(value)`.
    """

    __slots__ = ()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """This replica's component as a NumPy array; outside a replica, TF's ValueError.

        TF converts a PerReplica to a tensor only inside a replica context; without this
        NumPy would fail with an unclear TypeError (or build an object array). Unlike
        `_get()`, outside any strategy this does not pick replica 0's component: a value
        of several replicas has no single array there.
        """
        frame = context.current_frame()
        if frame is None or (frame.replica_context is None and frame.update_replica_id is None):
            self._get_cross_replica()
        value = self._get()
        return np.asarray(backend_for(value).to_numpy(value), dtype=dtype)

    def _get_cross_replica(self) -> Any:
        raise ValueError(
            "It looks like you are using a PerReplica object while not inside a replica "
            "context, which is not supported. Try running your op or function inside a "
            "replica context by using `strategy.run`, or reduce it first with "
            "`strategy.reduce`."
        )


class Mirrored(ArrayOperators, DistributedValues):
    """The same value on every replica (what a reduction to all devices returns).

    It behaves as its local component: attributes, operators and `numpy.asarray`
    are forwarded to the component of the current replica, or the primary one in
    cross-replica context.
    """

    __slots__ = ()

    def _get_cross_replica(self) -> Any:
        return self._get_on_device_or_primary()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in DistributedValues.__slots__:
            raise AttributeError(name)
        return getattr(self._get(), name)

    def _operand(self) -> Any:
        return self._get()


validate.register_distributed_values(DistributedValues, default_devices)
