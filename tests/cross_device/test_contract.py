"""The CrossDeviceOps contract, written once and run against every implementation.

Seed behaviours: reduce to a device string, to a DistributedValues, to a variable-like
object; all-reduce when value and destinations are the same; batch_reduce of several
pairs; broadcast; gather. Over NumPy and torch CPU values, every dtype, 1 to 9 devices,
SUM and MEAN, and every kind of destination.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from crossdevice._core.devices import device_scope
from crossdevice._cross_device import CrossDeviceOps
from crossdevice._values.values import Mirrored, PerReplica
from crossdevice._values.variables import Variable
from tests.conftest import Backend
from tests.cross_device.cases import (
    DTYPES,
    MEAN_TOLERANCE,
    assert_unchanged,
    cpu,
    dev,
    dtype_name,
    make,
    on_device,
    per_replica,
    reference,
    snapshot,
)
from tests.helpers import to_numpy

Destination = Callable[[Backend, PerReplica], tuple[Any, tuple[str, ...]]]


def _same(backend: Backend, value: PerReplica) -> tuple[Any, tuple[str, ...]]:
    return value, value._devices


def _permuted(backend: Backend, value: PerReplica) -> tuple[Any, tuple[str, ...]]:
    devices = tuple(reversed(value._devices))
    return PerReplica([make(backend, np.zeros(1), "float32")] * len(devices), devices), devices


def _string_outside(backend: Backend, value: PerReplica) -> tuple[Any, tuple[str, ...]]:
    n = len(value.values)
    return f"/{dev(n).lower()}", (cpu(n),)


def _string_first(backend: Backend, value: PerReplica) -> tuple[Any, tuple[str, ...]]:
    return dev(0), (cpu(0),)


def _mirrored(backend: Backend, value: PerReplica) -> tuple[Any, tuple[str, ...]]:
    devices = (cpu(12), cpu(10), cpu(11))
    zeros = [make(backend, np.zeros(1), "float32") for _ in devices]
    return Mirrored(zeros, devices=devices), devices


def _variable(backend: Backend, value: PerReplica) -> tuple[Any, tuple[str, ...]]:
    return Variable(make(backend, np.zeros(3), "float32"), device=dev(5)), (cpu(5),)


def _array(backend: Backend, value: PerReplica) -> tuple[Any, tuple[str, ...]]:
    return make(backend, np.zeros(2), "float32"), (cpu(0),)


DESTINATIONS: dict[str, Destination] = {
    "same-as-value": _same,
    "permuted-per-replica": _permuted,
    "device-string-elsewhere": _string_outside,
    "device-string-CPU:0": _string_first,
    "mirrored": _mirrored,
    "variable": _variable,
    "array": _array,
}


def check_result(
    result: Any,
    devices: tuple[str, ...],
    expected: np.ndarray,
    dtype: str,
    op: str,
    where: str,
    *,
    shortcut: bool = False,
) -> None:
    """Placement, values, dtype, and isolation of a reduction result.

    `shortcut`: TF's single-replica shortcut applies (MEAN of one replica is the value
    itself, so integers stay integers; otherwise MEAN divides and integers become floats).
    """
    if len(devices) == 1:
        assert not isinstance(result, Mirrored), where
        components = [result]
    else:
        assert isinstance(result, Mirrored), where
        assert result._devices == devices, where
        components = list(result.values)
    rtol, atol = MEAN_TOLERANCE[dtype] if op == "MEAN" else (0, 0)
    for c in components:
        np.testing.assert_allclose(
            to_numpy(c).astype(np.float64), expected, rtol=rtol, atol=atol, err_msg=where
        )
        if op == "SUM" or shortcut or dtype.startswith(("float", "bfloat")):
            assert dtype_name(c) == dtype, where
        else:
            assert dtype_name(c).startswith("float"), where
        if isinstance(c, np.ndarray):
            assert not c.flags.writeable, f"host results are read-only: {where}"
    torch_components = [c for c in components if not isinstance(c, np.ndarray)]
    pointers = {c.data_ptr() for c in torch_components if c.numel()}
    assert len(pointers) == len([c for c in torch_components if c.numel()]), (
        f"every torch destination gets its own tensor: {where}"
    )


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("n", range(1, 10))
def test_reduce(ops: CrossDeviceOps, backend: Backend, op: str, n: int) -> None:
    for dtype in DTYPES[backend.name]:
        value = per_replica(backend, n, dtype, seed=n)
        expected = reference(value, op)
        for kind, make_destination in DESTINATIONS.items():
            destinations, devices = make_destination(backend, value)
            before = snapshot(value, destinations)
            result = ops.reduce(op.lower() if n % 2 else op, value, destinations)
            shortcut = n == 1 and set(devices) == set(value._devices)
            where = f"{dtype} to {kind}"
            check_result(result, devices, expected, dtype, op, where, shortcut=shortcut)
            assert_unchanged(before, value, destinations)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 9])
def test_batch_reduce(ops: CrossDeviceOps, backend: Backend, n: int) -> None:
    a = per_replica(backend, n, "float32", (3,), seed=1)
    b = per_replica(backend, n, "int64", (2, 2), seed=2)
    c = per_replica(backend, n, "float64", (), seed=3)
    variable = Variable(make(backend, np.zeros(2), "float32"), device=dev(4))
    all_reduce = [(a, a), (b, b), (c, c)]
    mixed = [(a, a), (b, dev(0)), (c, variable)]
    for op in ["SUM", "MEAN"]:
        for pairs in (all_reduce, mixed):
            before = snapshot(a, b, c, variable)
            results = ops.batch_reduce(op, pairs)
            assert len(results) == len(pairs)
            for (value, destinations), result in zip(pairs, results, strict=True):
                devices = (
                    value._devices
                    if destinations is value
                    else ((cpu(0),) if destinations == dev(0) else (cpu(4),))
                )
                dtype = dtype_name(value.values[0])
                shortcut = n == 1 and set(devices) == set(value._devices)
                where = f"{op} {dtype} to {destinations!r}"
                expected = reference(value, op)
                check_result(result, devices, expected, dtype, op, where, shortcut=shortcut)
            assert_unchanged(before, a, b, c, variable)


def test_batch_reduce_empty_and_tuple(ops: CrossDeviceOps, backend: Backend) -> None:
    assert ops.batch_reduce("sum", []) == []
    value = per_replica(backend, 3)
    (result,) = ops.batch_reduce("sum", ((value, value),))
    check_result(result, value._devices, reference(value, "SUM"), "float32", "SUM", "tuple")


def test_reduce_plain_values(ops: CrossDeviceOps, backend: Backend) -> None:
    array = make(backend, [1.0, 2.0], "float32")
    before = snapshot(array)
    result = ops.reduce("sum", array, "CPU:0")  # the single-replica shortcut: a copy
    np.testing.assert_array_equal(to_numpy(result), [1.0, 2.0])
    assert result is not array
    with device_scope("CPU:3"):
        moved = ops.reduce("mean", array, "CPU:2")  # a host array lives on CPU:3 here
    np.testing.assert_array_equal(to_numpy(moved), [1.0, 2.0])
    variable = Variable(make(backend, [3.0], "float32"), device="CPU:1")
    mirrored = ops.reduce("sum", variable, PerReplica([array, array], ["CPU:1", "CPU:2"]))
    assert isinstance(mirrored, Mirrored)
    assert mirrored._devices == (cpu(1), cpu(2))
    np.testing.assert_array_equal(to_numpy(mirrored.values[1]), [3.0])
    np.testing.assert_array_equal(variable.numpy(), [3.0])
    assert_unchanged(before, array)


def test_results_do_not_leak_between_replicas(ops: CrossDeviceOps, backend: Backend) -> None:
    value = per_replica(backend, 4)
    result = ops.reduce("sum", value, value)
    first, second = result.values[0], result.values[1]
    if backend.name == "numpy":
        with pytest.raises(ValueError, match="read-only"):
            first += 1
    else:
        first.add_(100)
        np.testing.assert_array_equal(to_numpy(second), reference(value, "SUM"))


@pytest.mark.parametrize("n", [1, 2, 5])
def test_broadcast(ops: CrossDeviceOps, backend: Backend, n: int) -> None:
    tensor = make(backend, np.arange(6).reshape(2, 3), "float32")
    value = per_replica(backend, n)
    for kind, make_destination in DESTINATIONS.items():
        destinations, devices = make_destination(backend, value)
        before = snapshot(tensor, destinations)
        result = ops.broadcast(tensor, destinations)
        expected = np.arange(6).reshape(2, 3)
        check_result(result, devices, expected, "float32", "SUM", f"broadcast to {kind}")
        components = result.values if isinstance(result, Mirrored) else (result,)
        assert all(c is not tensor for c in components)
        assert_unchanged(before, tensor, destinations)
    mirrored = ops.broadcast(Mirrored([tensor, tensor]), dev(7))
    np.testing.assert_array_equal(to_numpy(mirrored), np.arange(6).reshape(2, 3))


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_gather(ops: CrossDeviceOps, backend: Backend, axis: int, n: int) -> None:
    parts = []
    for i in range(n):
        shape = [2, 3]
        shape[axis] = i + 1  # sizes may differ along the gather axis only
        parts.append(on_device(make(backend, np.full(shape, i), "int32"), i))
    value = PerReplica(parts, devices=[dev(i) for i in range(n)])
    expected = np.concatenate([to_numpy(p) for p in parts], axis=axis)
    before = snapshot(value)
    for destinations, devices in [(value, value._devices), (dev(9), (cpu(9),))]:
        result = ops._gather(value, destinations, axis)
        check_result(result, devices, expected, "int32", "SUM", f"gather to {destinations!r}")
    assert_unchanged(before, value)
