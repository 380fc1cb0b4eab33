"""The CrossDeviceOps contract suite again, on GPUs, with torch CUDA tensors.

Every case of `test_contract.py` except the host-array one (`test_reduce_plain_values`,
which is about where a host array is taken to live) runs with device `i` being `GPU:i`:
on 16 fake CUDA devices, on 16 logical GPUs of one fake card, and on real CUDA (logical
GPUs making up 16; skipped without CUDA).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

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
from tests.gpu.conftest import on_gpus

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
    with on_gpus(request.param, NUM_GPUS, torch_values=True):
        cases.DEVICE_TYPE = "GPU"
        try:
            yield
        finally:
            cases.DEVICE_TYPE = "CPU"


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Backend:
    """torch CUDA tensors (made on GPU:0; `cases.per_replica` puts component i on GPU:i)."""
    torch = require_torch(request)
    return Backend("torch", lambda x: torch.as_tensor(np.asarray(x), device="cuda:0"))
