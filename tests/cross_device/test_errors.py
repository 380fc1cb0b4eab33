"""Bad input: TF's exception types, messages that say what was expected and received.

Every check runs against every CrossDeviceOps configuration, and a failed call must
have done nothing: no arithmetic ran and the inputs are unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from crossdevice._comm.devices import algorithms
from crossdevice._core.devices import num_gpus
from crossdevice._core.options import CommunicationOptions
from crossdevice._core.reduce_op import VariableAggregation
from crossdevice._cross_device import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from crossdevice._values.values import Mirrored, PerReplica
from crossdevice._values.variables import Variable
from tests.conftest import Backend
from tests.cross_device.cases import assert_unchanged, make, per_replica, snapshot

BAD_DESTINATIONS: list[tuple[Any, type[Exception], str]] = [
    (["CPU:0", "CPU:1"], ValueError, r"destinations must be one of a DistributedValues .*got list"),
    (("CPU:0",), ValueError, r"destinations must be one of .*got tuple"),
    (None, ValueError, r"destinations must be one of .*got NoneType"),
    (5, ValueError, r"destinations must be one of .*got int: 5"),
    ({"device": "CPU:0"}, ValueError, r"destinations must be one of .*got dict"),
    ("", ValueError, r"destinations can not be empty; got ''"),
    ("   ", ValueError, r"destinations can not be empty"),
    ("CPU:99", ValueError, r"device '.*CPU:99' does not exist; the devices of this host are"),
    # One past the GPUs this host has (GPU:7 exists on an 8-GPU host).
    (f"GPU:{num_gpus()}", ValueError, rf"device '.*GPU:{num_gpus()}' does not exist"),
    ("not a device", ValueError, r"could not parse device string 'not a device'"),
]


@pytest.fixture
def no_arithmetic(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts additions; a validation failure must leave the count at zero."""
    calls: list[int] = []
    real = algorithms.sum_n

    def counting(values: Any) -> Any:
        calls.append(len(values))
        return real(values)

    monkeypatch.setattr(algorithms, "sum_n", counting)
    return calls


@pytest.mark.parametrize(("destinations", "error", "message"), BAD_DESTINATIONS)
def test_bad_destinations(
    ops: CrossDeviceOps,
    backend: Backend,
    destinations: Any,
    error: type[Exception],
    message: str,
    no_arithmetic: list[int],
) -> None:
    value = per_replica(backend, 3)
    tensor = make(backend, [1.0], "float32")
    before = snapshot(value, tensor)
    with pytest.raises(error, match=message):
        ops.reduce("sum", value, destinations)
    with pytest.raises(error, match=message):
        ops.batch_reduce("sum", [(value, value), (value, destinations)])
    with pytest.raises(error, match=message):
        ops.broadcast(tensor, destinations)
    with pytest.raises(error, match=message):
        ops._gather(value, destinations, axis=0)
    assert no_arithmetic == []
    assert_unchanged(before, value, tensor)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([np.ones(2), np.ones(2)], r"got list: .*expected an object that is not a tuple or list"),
        ((np.ones(2),), r"got tuple: .*expected an object that is not a tuple or list"),
        ("CPU:0", r"doesn't have a device set: expected a DistributedValues.*got str"),
        (object(), r"doesn't have a device set: expected a DistributedValues.*got object"),
        (None, r"doesn't have a device set.*got NoneType"),
    ],
)
def test_bad_values(ops: CrossDeviceOps, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ops.reduce("sum", value, "CPU:0")
    with pytest.raises(ValueError, match=message):
        ops.batch_reduce("sum", [(value, "CPU:0")])
    with pytest.raises(ValueError, match=message):
        ops._gather(value, "CPU:0", axis=0)


def test_components_must_agree(ops: CrossDeviceOps, backend: Backend) -> None:
    shapes = PerReplica(
        [make(backend, np.ones(2), "float32"), make(backend, np.ones(3), "float32")]
    )
    with pytest.raises(ValueError, match=r"same dtype and shape; component 0 .* is float32\[2\] "):
        ops.reduce("sum", shapes, shapes)
    dtypes = PerReplica([make(backend, np.ones(2), "float32"), make(backend, np.ones(2), "int32")])
    with pytest.raises(ValueError, match=r"component 1 on .*CPU:1 is int32\[2\]"):
        ops.reduce("mean", dtypes, "CPU:0")
    gather = PerReplica(
        [make(backend, np.ones((2, 2)), "float32")] * 2
        + [make(backend, np.ones((2, 3)), "float32")]
    )
    with pytest.raises(ValueError, match=r"shape except along axis 0; .*component 2"):
        ops._gather(gather, gather, axis=0)


def test_mixed_array_libraries(ops: CrossDeviceOps, torch_module: Any) -> None:
    mixed = PerReplica([np.ones(2, np.float32), torch_module.ones(2)])
    with pytest.raises(ValueError, match="one array library; component 0 is a numpy array"):
        ops.reduce("sum", mixed, mixed)


def test_bad_reduce_ops_and_options(ops: CrossDeviceOps, backend: Backend) -> None:
    value = per_replica(backend, 2)
    with pytest.raises(ValueError, match=r"unknown reduce op 'max'; expected ReduceOp.SUM"):
        ops.reduce("max", value, value)
    with pytest.raises(TypeError, match=r"Expected reduce_op to be .* not: 1"):
        ops.batch_reduce(1, [(value, value)])
    with pytest.raises(TypeError, match=r"not: <VariableAggregation\.SUM: 1>"):
        ops.reduce(VariableAggregation.SUM, value, value)
    with pytest.raises(
        TypeError, match=r"options must be a .*CommunicationOptions or None; got str"
    ):
        ops.reduce("sum", value, value, options="fast")
    result = ops.reduce("sum", value, value, options=CommunicationOptions(bytes_per_pack=8))
    assert isinstance(result, Mirrored)


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        (None, r"should be a list or tuple of \(value, destinations\) tuples; got NoneType"),
        ("CPU:0", r"should be a list or tuple .*got str"),
        ([["v", "CPU:0"]], r"should be a tuple; element 0 is list"),
        ([("v", "CPU:0", "x")], r"should be a tuple of size 2; element 0 has 3 items"),
    ],
)
def test_bad_pairs(ops: CrossDeviceOps, pairs: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ops.batch_reduce("sum", pairs)


def test_batch_reduce_validates_every_pair_first(
    ops: CrossDeviceOps, backend: Backend, no_arithmetic: list[int]
) -> None:
    good = per_replica(backend, 3)
    variable = Variable(make(backend, [1.0], "float32"), device="CPU:2")
    bad = PerReplica([make(backend, np.ones(2), "float32"), make(backend, np.ones(5), "float32")])
    before = snapshot(good, variable, bad)
    with pytest.raises(ValueError, match="same dtype and shape"):
        ops.batch_reduce("sum", [(good, good), (good, variable), (bad, bad)])
    with pytest.raises(ValueError, match="should be a tuple"):
        ops.batch_reduce("sum", [(good, good), [good, good]])
    assert no_arithmetic == []
    assert_unchanged(before, good, variable, bad)


def test_gather_axis(ops: CrossDeviceOps, backend: Backend) -> None:
    value = per_replica(backend, 2)
    with pytest.raises(ValueError, match=r"axis = 2 out of range for value with rank 2"):
        ops._gather(value, value, axis=2)
    with pytest.raises(ValueError, match=r"axis = -3 out of range"):
        ops._gather(value, value, axis=-3)
    with pytest.raises(TypeError, match="axis must be an int, got str"):
        ops._gather(value, value, axis="0")
    scalars = per_replica(backend, 2, shape=())
    with pytest.raises(ValueError, match="rank 0: scalars cannot be gathered"):
        ops._gather(scalars, scalars, axis=0)


def test_broadcast_needs_one_value(ops: CrossDeviceOps, backend: Backend) -> None:
    value = per_replica(backend, 2)
    with pytest.raises(ValueError, match="got a PerReplica with 2 different components"):
        ops.broadcast(value, "CPU:0")
    with pytest.raises(ValueError, match="expects one array, got a list"):
        ops.broadcast([1.0, 2.0], "CPU:0")
    with pytest.raises(ValueError, match=r"expected an array .* got object"):
        ops.broadcast(object(), "CPU:0")


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (
            HierarchicalCopyAllReduce,
            "HierarchicalCopy requires num_packs >= 0, but -1 is specified",
        ),
        (NcclAllReduce, "NCCL all-reduce requires num_packs >= 0, but -1 is specified"),
    ],
)
def test_negative_num_packs(cls: type[CrossDeviceOps], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(num_packs=-1)  # type: ignore[call-arg]
    for bad in ["1", 1.5, True, None]:
        with pytest.raises(TypeError, match="num_packs must be a non-negative int, got"):
            cls(num_packs=bad)  # type: ignore[call-arg]


def test_reduction_to_one_device_arguments(backend: Backend) -> None:
    with pytest.raises(ValueError, match="reduce_to_device must be None or a device string"):
        ReductionToOneDevice(reduce_to_device=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="could not parse device string 'somewhere'"):
        ReductionToOneDevice(reduce_to_device="somewhere")
    with pytest.raises(TypeError, match="accumulation_fn must be None or a function"):
        ReductionToOneDevice(accumulation_fn=3)  # type: ignore[arg-type]
    value = per_replica(backend, 2)
    before = snapshot(value)
    with pytest.raises(ValueError, match=r"CPU:40' does not exist; the devices of this host"):
        ReductionToOneDevice(reduce_to_device="CPU:40").reduce("sum", value, "CPU:0")
    bad_fn = ReductionToOneDevice(accumulation_fn=lambda xs: [len(xs)])
    with pytest.raises(TypeError, match=r"must return an array .* it returned list"):
        bad_fn.reduce("mean", value, "CPU:0")
    assert_unchanged(before, value)


def test_base_class_is_abstract_and_gather_optional(backend: Backend) -> None:
    with pytest.raises(TypeError, match="abstract"):
        CrossDeviceOps()  # type: ignore[abstract]

    class SumOnly(CrossDeviceOps):
        def reduce_implementation(self, *args: Any) -> Any:
            return "reduced"

        def batch_reduce_implementation(self, *args: Any) -> Any:
            return ["batched"]

    ops = SumOnly()
    value = per_replica(backend, 2)
    assert ops.reduce("sum", value, "CPU:3") == "reduced"
    assert ops.batch_reduce("sum", [(value, "CPU:3")]) == ["batched"]
    with pytest.raises(NotImplementedError, match="SumOnly does not implement _gather"):
        ops._gather(value, "CPU:3", axis=0)
    np.testing.assert_array_equal(np.asarray(ops.broadcast(np.ones(2), value).values[1]), 1.0)
