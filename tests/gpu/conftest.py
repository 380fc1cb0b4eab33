"""The `gpus` fixture: one GPU suite, bound to fake CUDA (CI) and to real CUDA (a GPU host).

* `fake`: `tests.fake_cuda` with 4 CUDA devices: placement, copies, host synchronisations
  and stream ordering are observable (`gpus.counts`), on a CPU-only machine.
* `fake-logical`: one fake CUDA device split into 4 logical GPUs
  (`set_logical_gpu_devices(4)`), so several replicas share a card and its memory.
* `cuda`: real CUDA; with fewer than 4 GPUs, logical GPUs make up 4. Skipped without CUDA.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

from crossdevice._core import devices

NUM_GPUS = 4


def _real_cuda_devices() -> int:
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


REAL_CUDA_DEVICES = _real_cuda_devices()


class Gpus:
    """What a GPU test runs on.

    Attributes:
        kind: "fake", "fake-logical" or "cuda".
        names: the TF names of the GPUs (`GPU:0` …).
        fake: the `FakeCuda` state (counts) or None on real CUDA.
        logical: several GPUs share one CUDA device.
    """

    def __init__(self, kind: str, fake: Any, logical: bool) -> None:
        self.kind = kind
        self.names = [f"GPU:{i}" for i in range(NUM_GPUS)]
        self.fake = fake
        self.logical = logical

    def torch_device(self, i: int) -> Any:
        """The torch device of `GPU:i`."""
        from crossdevice._arrays import get_torch_backend

        return get_torch_backend().torch_device(self.names[i])

    def synchronize(self) -> None:
        """Wait for the GPUs (a no-op count on fake CUDA)."""
        import torch

        torch.cuda.synchronize()

    def __repr__(self) -> str:
        return self.kind


@contextlib.contextmanager
def on_gpus(kind: str, n: int = NUM_GPUS, *, torch_values: bool = False) -> Iterator[Gpus]:
    """`n` GPUs of `kind` for the enclosed block: "fake" (n fake cards), "fake-logical"
    (n logical GPUs on one fake card) or "cuda" (real CUDA, logical GPUs making up n;
    skipped without CUDA). `torch_values`: the shared `backend` fixture makes CUDA tensors.
    """
    import tests.conftest as shared

    if kind == "cuda" and REAL_CUDA_DEVICES == 0:
        pytest.skip("needs a CUDA GPU (torch sees none); the fake-CUDA runs cover CI")
    logical = kind == "fake-logical" or (kind == "cuda" and n > REAL_CUDA_DEVICES)
    with contextlib.ExitStack() as stack:
        fake = None
        if kind != "cuda":
            from tests.fake_cuda import fake_cuda

            fake = stack.enter_context(fake_cuda(1 if logical else n))
        if logical:
            devices.set_logical_gpu_devices(n)
            stack.callback(devices.set_logical_gpu_devices, None)
        if torch_values:
            shared.TORCH_DEVICE = "cuda"
            stack.callback(setattr, shared, "TORCH_DEVICE", "cpu")
        yield Gpus(kind, fake, logical)


@pytest.fixture(params=["fake", "fake-logical", "cuda"])
def gpus(request: pytest.FixtureRequest) -> Iterator[Gpus]:
    """Each GPU test once on fake CUDA, once on fake logical GPUs, once on real CUDA."""
    from tests.conftest import require_torch

    require_torch(request)
    with on_gpus(request.param) as gpus:
        yield gpus
