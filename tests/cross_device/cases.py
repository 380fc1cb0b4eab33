"""What the cross-device contract suite is bound to, and how it makes its data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from crossdevice._core.devices import canonicalize
from crossdevice._cross_device import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    HostAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from crossdevice._values.values import DistributedValues, PerReplica
from tests.conftest import Backend
from tests.helpers import to_numpy


def in_order_sum(values: list[Any]) -> Any:
    """A user-style accumulation_fn: returns its only input as is for one value."""
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total


#: Every CrossDeviceOps configuration the contract suite runs against, by readable id.
IMPLEMENTATIONS: dict[str, Callable[[], CrossDeviceOps]] = {
    "ReductionToOneDevice()": ReductionToOneDevice,
    "ReductionToOneDevice(reduce_to_device='CPU:1')": lambda: ReductionToOneDevice(
        reduce_to_device="CPU:1"
    ),
    "ReductionToOneDevice(accumulation_fn=in_order_sum)": lambda: ReductionToOneDevice(
        accumulation_fn=in_order_sum
    ),
    "HierarchicalCopyAllReduce(num_packs=0)": lambda: HierarchicalCopyAllReduce(num_packs=0),
    "HierarchicalCopyAllReduce(num_packs=1)": lambda: HierarchicalCopyAllReduce(num_packs=1),
    "HierarchicalCopyAllReduce(num_packs=2)": lambda: HierarchicalCopyAllReduce(num_packs=2),
    "HierarchicalCopyAllReduce(num_packs=5)": lambda: HierarchicalCopyAllReduce(num_packs=5),
    "NcclAllReduce()": NcclAllReduce,
    "HostAllReduce()": HostAllReduce,
}

#: dtypes per array library (NumPy has no bfloat16).
DTYPES = {
    "numpy": ["float16", "float32", "float64", "int32", "int64"],
    "torch": ["float16", "float32", "float64", "int32", "int64", "bfloat16"],
}

#: (rtol, atol) per dtype for MEAN (sums of small integers are exact in every dtype).
MEAN_TOLERANCE = {
    "float16": (2e-3, 1e-2),
    "bfloat16": (1e-2, 5e-2),
    "float32": (1e-6, 1e-6),
    "float64": (1e-12, 1e-12),
    "int32": (1e-6, 1e-6),
    "int64": (1e-6, 1e-6),
}


#: The device type the suite runs on: "CPU", or "GPU" while it is bound to GPUs
#: (`test_contract_on_gpus.py`), where device `i` is `GPU:i` and torch values live there.
DEVICE_TYPE = "CPU"


def dev(i: int) -> str:
    """The short name of device `i` of the bound type: `CPU:i` (or `GPU:i`)."""
    return f"{DEVICE_TYPE}:{i}"


def cpu(i: int) -> str:
    """The canonical name of device `i` of the bound type (logical CPU `i` by default)."""
    return canonicalize(dev(i))


def make(backend: Backend, data: Any, dtype: str) -> Any:
    """`data` as an array of `backend` with `dtype` (on device 0 when bound to GPUs)."""
    if backend.name == "numpy":
        return np.asarray(data).astype(dtype)
    import torch

    return backend.make(np.asarray(data)).to(getattr(torch, dtype))


def on_device(x: Any, i: int) -> Any:
    """`x` on device `i` when the suite is bound to GPUs (host arrays otherwise)."""
    if DEVICE_TYPE == "CPU":
        return x
    from crossdevice._arrays import backend_for

    return backend_for(x).to_device(x, dev(i))


def dtype_name(x: Any) -> str:
    """`"float32"`, `"bfloat16"`, ... of a NumPy array or torch tensor."""
    return str(x.dtype).removeprefix("torch.")


def per_replica(
    backend: Backend, n: int, dtype: str = "float32", shape: tuple[int, ...] = (2, 3), seed: int = 0
) -> PerReplica:
    """`n` integer-valued components on devices 0..n-1 (sums are exact in every dtype)."""
    rng = np.random.default_rng(seed)
    return PerReplica(
        [on_device(make(backend, rng.integers(-4, 5, size=shape) + i, dtype), i) for i in range(n)],
        devices=[dev(i) for i in range(n)],
    )


def reference(value: PerReplica, op: str) -> np.ndarray:
    """The float64 NumPy SUM or MEAN of the components."""
    total = np.sum([to_numpy(c).astype(np.float64) for c in value.values], axis=0)
    return total / len(value.values) if op == "MEAN" else total


def _components(value: Any) -> tuple[Any, ...]:
    return value.values if isinstance(value, DistributedValues) else (value,)


def snapshot(*values: Any) -> list[np.ndarray]:
    """Copies of the components of `values`, to check later that nothing changed."""
    out = []
    for value in values:
        for c in _components(value):
            out.append(np.array(to_numpy(c), copy=True))
    return out


def assert_unchanged(before: list[np.ndarray], *values: Any) -> None:
    """The components of `values` equal `before` and NumPy ones are still writable."""
    after = []
    for value in values:
        for c in _components(value):
            if isinstance(c, np.ndarray):
                assert c.flags.writeable, "an input array was frozen"
            after.append(to_numpy(c))
    assert len(before) == len(after)
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
