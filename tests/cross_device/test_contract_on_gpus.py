"""The CrossDeviceOps contract suite again, on GPUs, with torch CUDA tensors.

Every case of `test_contract.py` except the host-array one (`test_reduce_plain_values`,
which is about where a host array is taken to live) runs with device `i` being `GPU:i`:
on 16 fake CUDA devices, on 16 logical GPUs of one fake card, and on real CUDA (logical
GPUs making up 16; skipped without CUDA).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import tests.conftest as shared
from crossdevice._core import devices
from tests.conftest import Backend, require_torch
from tests.cross_device import cases
from tests.cross_device.test_contract import (
    test_batch_reduce,
    test_batch_reduce_empty_and_tuple,
    test_broadcast,
    test_gather,
    test_reduce,
    test_results_do_not_leak_between_replicas,
)
from tests.gpu.conftest import REAL_CUDA_DEVICES

__all__ = [
    "test_batch_reduce",
    "test_batch_reduce_empty_and_tuple",
    "test_broadcast",
    "test_gather",
    "test_reduce",
    "test_results_do_not_leak_between_replicas",
]

pytestmark = pytest.mark.gpu

#: Devices the suite names (up to GPU:12 for its mirrored destination).
NUM_GPUS = 16


@pytest.fixture(autouse=True, params=["fake", "fake-logical", "cuda"])
def _on_gpus(request: pytest.FixtureRequest) -> Iterator[None]:
    require_torch(request)
    kind = request.param
    if kind == "cuda" and REAL_CUDA_DEVICES == 0:
        pytest.skip("needs a CUDA GPU (torch sees none); the fake-CUDA runs cover CI")
    logical = kind == "fake-logical" or (kind == "cuda" and REAL_CUDA_DEVICES < NUM_GPUS)
    context: Any = None
    if kind != "cuda":
        from tests.fake_cuda import fake_cuda

        context = fake_cuda(1 if logical else NUM_GPUS)
        context.__enter__()
    if logical:
        devices.set_logical_gpu_devices(NUM_GPUS)
    cases.DEVICE_TYPE, shared.TORCH_DEVICE = "GPU", "cuda"
    try:
        yield
    finally:
        cases.DEVICE_TYPE, shared.TORCH_DEVICE = "CPU", "cpu"
        devices.set_logical_gpu_devices(None)
        if context is not None:
            context.__exit__(None, None, None)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Backend:
    """torch CUDA tensors (made on GPU:0; `cases.per_replica` puts component i on GPU:i)."""
    torch = require_torch(request)
    return Backend("torch", lambda x: torch.as_tensor(np.asarray(x), device="cuda:0"))
