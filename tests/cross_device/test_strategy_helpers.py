"""The helpers the strategy layer calls: non-distributed values, default ops, NCCL fallback."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from crossdevice._core.devices import LogicalDevice, canonicalize
from crossdevice._cross_device import (
    HostAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
    devices_match,
    get_devices_from,
    reduce_non_distributed_value,
    select_cross_device_ops,
    validate_destinations,
)
from crossdevice._cross_device import nccl as nccl_module
from crossdevice._values.values import Mirrored, PerReplica
from crossdevice._values.variables import Variable
from tests.conftest import Backend
from tests.cross_device.cases import assert_unchanged, cpu, make, per_replica, snapshot
from tests.helpers import to_numpy


def test_non_distributed_rules(backend: Backend) -> None:
    value = make(backend, [5.0], "float32")
    before = snapshot(value)
    # 1. a DistributedValues is not allowed
    with pytest.raises(ValueError, match=r"passing a `DistributedValues` .* not allowed"):
        reduce_non_distributed_value("sum", per_replica(backend, 2), "CPU:0", 2)
    # 2. a Python number equal to 0 gives 0
    assert reduce_non_distributed_value("sum", 0, "CPU:0", 4) == 0
    assert reduce_non_distributed_value("sum", 0.0, "CPU:0", 4) == 0
    # 3. MEAN returns the value itself
    assert reduce_non_distributed_value("Mean", value, "CPU:0", 3) is value
    # 4. SUM over several replicas never multiplies by N
    with pytest.raises(ValueError, match=r"A non-DistributedValues value 5.0 cannot be reduced"):
        reduce_non_distributed_value("sum", 5.0, "CPU:0", 2)
    with pytest.raises(ValueError, match=r"given reduce op ReduceOp.SUM"):
        reduce_non_distributed_value("SUM", value, "CPU:0", 2)
    # 5. SUM with one replica copies to the destinations
    mirrored = Mirrored([value, value], devices=["CPU:2", "CPU:3"])
    result = reduce_non_distributed_value("sum", value, mirrored, 1)
    assert isinstance(result, Mirrored)
    assert result._devices == (cpu(2), cpu(3))
    assert all(c is not value for c in result.values)
    np.testing.assert_array_equal(to_numpy(result.values[1]), [5.0])
    single = reduce_non_distributed_value("sum", 2.5, "CPU:1", 1)
    np.testing.assert_array_equal(single, np.float32(2.5))
    with pytest.raises(ValueError, match="destinations can not be empty"):
        reduce_non_distributed_value("sum", value, "", 1)
    with pytest.raises(ValueError, match="num_replicas must be an int >= 1, got 0"):
        reduce_non_distributed_value("sum", value, "CPU:0", 0)
    assert_unchanged(before, value)


def test_destination_helpers(backend: Backend) -> None:
    value = per_replica(backend, 3)
    assert get_devices_from("/cpu:2") == (cpu(2),)
    assert get_devices_from(value) == (cpu(0), cpu(1), cpu(2))
    assert get_devices_from(Variable(make(backend, [1.0], "float32"), device="CPU:6")) == (cpu(6),)
    assert get_devices_from(np.zeros(1)) == (cpu(0),)
    from crossdevice._core.devices import device_scope

    with device_scope("CPU:4"):
        assert get_devices_from(make(backend, [1.0], "float32")) == (cpu(4),)
    validate_destinations("CPU:1")
    reversed_value = PerReplica(value.values[::-1], devices=value._devices[::-1])
    assert devices_match(value, reversed_value)
    assert devices_match(value, value)
    assert not devices_match(value, "CPU:0")


def test_select_cross_device_ops(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert type(select_cross_device_ops(["CPU:0", "CPU:1"])) is HostAllReduce
    assert type(select_cross_device_ops([LogicalDevice(canonicalize("CPU:0"), "CPU")])) is (
        HostAllReduce
    )
    # A CPU among GPUs never gets NCCL, even where NCCL could run.
    monkeypatch.setattr(nccl_module, "nccl_mode", lambda devices: ("nccl", ""))
    assert type(select_cross_device_ops(["GPU:0", "CPU:0"])) is ReductionToOneDevice
    chosen = select_cross_device_ops(["GPU:0", "/gpu:1"])
    assert type(chosen) is NcclAllReduce
    assert chosen.num_packs == 1
    # Logical GPUs sharing a card: NcclAllReduce sums them packed on the card.
    monkeypatch.setattr(nccl_module, "nccl_mode", lambda devices: ("shared_card", "shared"))
    assert type(select_cross_device_ops(["GPU:0", "GPU:1"])) is NcclAllReduce
    monkeypatch.undo()
    # Where NCCL cannot run (here: no CUDA), never choose it.
    monkeypatch.setattr(nccl_module, "nccl_mode", lambda devices: ("fallback", "no CUDA here"))
    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        assert type(select_cross_device_ops(["GPU:0", "GPU:1"])) is ReductionToOneDevice
    assert "no CUDA here" in caplog.text
    for bad in [[], "CPU:0", None]:
        with pytest.raises(ValueError, match="expects a non-empty list of device strings"):
            select_cross_device_ops(bad)  # type: ignore[arg-type]


def test_nccl_status_reasons() -> None:
    status = nccl_module.nccl_status
    assert status((cpu(0), cpu(1))) == (False, "not every device is a GPU")
    gpus = (canonicalize("GPU:0"), canonicalize("GPU:0"))
    assert status(gpus)[1] == "a GPU appears twice (NCCL needs one tensor per GPU)"
    remote = (canonicalize("/job:worker/task:1/device:GPU:0"), canonicalize("GPU:1"))
    assert status(remote) == (False, "some devices belong to other workers")


def test_nccl_falls_back_with_one_warning_per_instance(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    value = per_replica(backend, 3)
    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        ops = NcclAllReduce()
        for _ in range(3):
            result = ops.reduce("sum", value, value)
            ops.batch_reduce("mean", [(value, value), (value, value)])
        np.testing.assert_array_equal(
            to_numpy(result.values[2]), to_numpy(ops.reduce("sum", value, "CPU:0"))
        )
        warnings = [r for r in caplog.records if "NcclAllReduce cannot run" in r.message]
        assert len(warnings) == 1
        assert warnings[0].name == "crossdevice"
        assert "not every device is a GPU" in warnings[0].getMessage()
        NcclAllReduce().reduce("sum", value, value)
        warnings = [r for r in caplog.records if "NcclAllReduce cannot run" in r.message]
        assert len(warnings) == 2


def test_all_reduce_gather_warns_once(backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    from crossdevice._cross_device import HierarchicalCopyAllReduce

    value = per_replica(backend, 2)
    ops: Any = HierarchicalCopyAllReduce()
    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        for _ in range(2):
            gathered = ops._gather(value, value, axis=0)
    assert to_numpy(gathered.values[1]).shape == (4, 3)
    assert caplog.text.count("gather/all_gather with HierarchicalCopyAllReduce") == 1
