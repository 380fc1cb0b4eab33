"""Devices, config, reduce ops, options, values: the foundation layer."""

from __future__ import annotations

import numpy as np
import pytest

from crossdevice._core import devices
from crossdevice._core.options import CommunicationImplementation, CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp, VariableAggregation, as_reduce_op
from crossdevice._values.regroup import regroup, select_replica
from crossdevice._values.values import Mirrored, PerReplica


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("CPU:1", "/job:localhost/replica:0/task:0/device:CPU:1"),
        ("/cpu:1", "/job:localhost/replica:0/task:0/device:CPU:1"),
        ("/device:GPU:0", "/job:localhost/replica:0/task:0/device:GPU:0"),
        ("/gpu:0", "/job:localhost/replica:0/task:0/device:GPU:0"),
        ("/job:worker/replica:0/task:1/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"),
        ("/job:worker/task:1/device:GPU:0", "/job:worker/replica:0/task:1/device:GPU:0"),
        (
            "/job:localhost/replica:0/task:0/device:CPU:3",
            "/job:localhost/replica:0/task:0/device:CPU:3",
        ),
    ],
)
def test_canonicalize(spec: str, expected: str) -> None:
    assert devices.canonicalize(spec) == expected


@pytest.mark.parametrize("bad", ["", "cpu", "CPU:x", "/job:", "GPU:0:1", "/device:"])
def test_canonicalize_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError, match="could not parse device string"):
        devices.canonicalize(bad)


def test_logical_cpu_devices_configurable() -> None:
    devices.set_logical_cpu_devices(3)
    names = [d.name for d in devices.list_logical_devices("CPU")]
    assert names == [devices.canonicalize(f"CPU:{i}") for i in range(3)]
    with pytest.raises(ValueError, match=r"does not exist; the devices of this host are .*CPU:2"):
        devices.check_device_exists(devices.canonicalize("CPU:3"))
    with pytest.raises(ValueError, match="int >= 1"):
        devices.set_logical_cpu_devices(0)


def test_logical_cpu_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices._CONFIG, "logical_cpus", None)
    monkeypatch.setenv("CROSSDEVICE_LOGICAL_CPUS", "5")
    assert devices.get_logical_cpu_devices() == 5
    monkeypatch.setenv("CROSSDEVICE_LOGICAL_CPUS", "five")
    with pytest.raises(
        ValueError, match="CROSSDEVICE_LOGICAL_CPUS must be an integer >= 1, got 'five'"
    ):
        devices.get_logical_cpu_devices()
    monkeypatch.delenv("CROSSDEVICE_LOGICAL_CPUS")
    assert devices.get_logical_cpu_devices() == devices.DEFAULT_LOGICAL_CPUS


@pytest.mark.parametrize("text", ["sum", "SUM", "Sum", ReduceOp.SUM])
def test_reduce_op_strings(text: object) -> None:
    assert as_reduce_op(text) is ReduceOp.SUM


def test_reduce_op_errors() -> None:
    with pytest.raises(ValueError, match="unknown reduce op 'max'"):
        as_reduce_op("max")
    with pytest.raises(TypeError, match="Expected reduce_op"):
        as_reduce_op(VariableAggregation.SUM)
    assert ReduceOp.from_variable_aggregation(VariableAggregation.MEAN) is ReduceOp.MEAN
    with pytest.raises(ValueError, match="Could not convert"):
        ReduceOp.from_variable_aggregation(VariableAggregation.ONLY_FIRST_REPLICA)


def test_communication_options() -> None:
    with pytest.raises(ValueError, match="bytes_per_pack must be >=0, Received -1"):
        CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError, match="implementation must be one of"):
        CommunicationOptions(implementation="mpi")
    a = CommunicationOptions(bytes_per_pack=10, implementation="nccl")
    assert a.implementation is CommunicationImplementation.NCCL
    b = a.merge(CommunicationOptions(timeout_seconds=5))
    assert (b.bytes_per_pack, b.timeout_seconds, b.implementation) == (
        10,
        5,
        CommunicationImplementation.NCCL,
    )
    c = a.merge(CommunicationOptions(bytes_per_pack=20, implementation="ring"))
    assert (c.bytes_per_pack, c.implementation) == (20, CommunicationImplementation.RING)
    assert CommunicationOptions(timeout_seconds=0).timeout_seconds is None
    # Merging nothing gives the same options; merging never changes the options merged.
    assert a.merge(None) == a
    assert (a.bytes_per_pack, a.timeout_seconds, a.implementation) == (
        10,
        None,
        CommunicationImplementation.NCCL,
    )


def test_per_replica_repr_and_devices() -> None:
    pr = PerReplica([np.float32(1), np.float32(2)])
    assert repr(pr) == "PerReplica:{\n  0: np.float32(1.0),\n  1: np.float32(2.0)\n}"
    assert pr._devices == (devices.canonicalize("CPU:0"), devices.canonicalize("CPU:1"))
    with pytest.raises(ValueError, match="2 components but 1 devices"):
        PerReplica([1, 2], devices=["CPU:0"])
    with pytest.raises(ValueError, match="at least one component"):
        PerReplica([])
    with pytest.raises(ValueError, match="not inside a replica context"):
        pr._get_cross_replica()


def test_mirrored_forwards_to_primary() -> None:
    m = Mirrored([np.array([1.0, 2.0]), np.array([1.0, 2.0])])
    np.testing.assert_array_equal(m + 1, [2.0, 3.0])
    np.testing.assert_array_equal(np.asarray(m), [1.0, 2.0])
    assert m.shape == (2,)


def test_regroup_and_select_replica() -> None:
    shared = object()
    grouped = regroup([{"a": shared, "b": [1.0, "x"]}, {"a": shared, "b": [2.0, "x"]}])
    assert grouped["a"] is shared
    assert isinstance(grouped["b"][0], PerReplica)
    assert grouped["b"][1] == "x"
    assert select_replica(1, grouped) == {"a": shared, "b": [2.0, "x"]}
    with pytest.raises(ValueError, match="different structures"):
        regroup([[1, 2], [1]])
    assert regroup([5]) == 5
    assert isinstance(regroup([5], always_wrap=True), PerReplica)
