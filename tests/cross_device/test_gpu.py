"""CUDA paths: NCCL between GPUs, reductions through a GPU. Skipped cleanly without CUDA."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import numpy as np
import pytest

from crossdevice._core.devices import canonicalize
from crossdevice._cross_device import (
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
    select_cross_device_ops,
)
from crossdevice._cross_device import nccl as nccl_module
from crossdevice._values.values import Mirrored, PerReplica
from tests.cross_device.cases import assert_unchanged, snapshot
from tests.helpers import to_numpy


def _cuda_devices() -> int:
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


CUDA_DEVICES = _cuda_devices()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(CUDA_DEVICES < 1, reason="needs a CUDA GPU (torch sees none)"),
]
needs_two = pytest.mark.skipif(CUDA_DEVICES < 2, reason="NCCL all-reduce needs 2 CUDA GPUs")


def gpu(i: int) -> str:
    return canonicalize(f"GPU:{i}")


@needs_two
@pytest.mark.parametrize("num_packs", [0, 1, 3])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_nccl_all_reduce_between_gpus(
    num_packs: int, op: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    n = min(CUDA_DEVICES, 4)
    calls: list[int] = []
    real = nccl_module._nccl_all_reduce
    monkeypatch.setattr(nccl_module, "_nccl_all_reduce", lambda *a: calls.append(1) or real(*a))
    values = [
        PerReplica(
            [torch.full(shape, float(i + k), device=f"cuda:{i}") for i in range(n)],
            devices=[f"GPU:{i}" for i in range(n)],
        )
        for k, shape in enumerate([(3, 2), (5,), ()])
    ]
    before = snapshot(*values)
    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        results = NcclAllReduce(num_packs).batch_reduce(op, [(v, v) for v in values])
    assert "cannot run" not in caplog.text
    assert calls, "the NCCL path ran"
    for k, (value, result) in enumerate(zip(values, results, strict=True)):
        assert isinstance(result, Mirrored)
        total = sum(i + k for i in range(n))
        expected = total / n if op == "MEAN" else total
        for i, component in enumerate(result.values):
            assert component.device == torch.device("cuda", i)
            np.testing.assert_allclose(
                to_numpy(component), np.full(value.values[0].shape, expected)
            )
    assert_unchanged(before, *values)


def test_nccl_kernel_on_one_gpu() -> None:
    import torch

    ok, reason = nccl_module.nccl_status((gpu(0),))
    if not ok:
        pytest.skip(f"NCCL cannot run here: {reason}")
    tensor = torch.arange(4.0, device="cuda:0")
    (out,) = nccl_module._nccl_all_reduce([tensor], (gpu(0),), True)
    assert out.data_ptr() != tensor.data_ptr()
    np.testing.assert_array_equal(to_numpy(out), [0.0, 1.0, 2.0, 3.0])
    assert type(select_cross_device_ops(["GPU:0"])) is NcclAllReduce


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_reduce_through_a_gpu_keeps_host_results_host(library: str) -> None:
    import torch

    parts: list[Any] = [np.full(3, float(i), np.float32) for i in range(3)]
    if library == "torch":
        parts = [torch.as_tensor(p) for p in parts]
    value = PerReplica(parts, devices=["CPU:0", "CPU:1", "CPU:2"])
    before = snapshot(value)
    result = ReductionToOneDevice(reduce_to_device="GPU:0").reduce("sum", value, value)
    for component in result.values:
        if library == "numpy":
            assert isinstance(component, np.ndarray)
            assert not component.flags.writeable
        else:
            assert component.device.type == "cpu"
        np.testing.assert_array_equal(to_numpy(component), [3.0, 3.0, 3.0])
    assert_unchanged(before, value)


def test_hierarchical_copy_across_gpu_and_cpu() -> None:
    import torch

    value = PerReplica(
        [torch.ones(2, device="cuda:0"), torch.full((2,), 2.0), torch.full((2,), 4.0)],
        devices=["GPU:0", "CPU:1", "CPU:2"],
    )
    result = HierarchicalCopyAllReduce().reduce("sum", value, value)
    assert result.values[0].device.type == "cuda"
    assert result.values[1].device.type == "cpu"
    for component in result.values:
        np.testing.assert_array_equal(to_numpy(component), [7.0, 7.0])
