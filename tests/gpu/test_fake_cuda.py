"""The fake CUDA of `tests.fake_cuda` catches what real CUDA would: the GPU suite relies on it."""

from __future__ import annotations

import numpy as np
import pytest

from tests.fake_cuda import FakeCudaRaceError, fake_cuda

torch = pytest.importorskip("torch")


def test_tensors_say_where_they_live_and_refuse_to_mix() -> None:
    with fake_cuda(2) as fake:
        a = torch.ones(3, device="cuda:1")
        b = torch.zeros(3).to("cuda:0")
        assert a.device == torch.device("cuda", 1)
        assert b.device == torch.device("cuda", 0)
        assert (a * 2).device == a.device
        with pytest.raises(RuntimeError, match="same device"):
            _ = a + b
        with pytest.raises(RuntimeError, match="same device"):
            _ = a + torch.ones(3)  # a non-scalar host tensor
        with pytest.raises(TypeError, match="cpu"):
            np.asarray(a)
        assert a.cpu().device.type == "cpu"
        assert fake.counts["H2D"] == 1
        assert fake.counts["D2H"] == 1
    assert not torch.cuda.is_available()


def test_device_less_cuda_tensors_follow_the_current_device() -> None:
    with fake_cuda(3):
        with torch.cuda.device(2):
            assert torch.zeros(1, device="cuda").device.index == 2
        assert torch.zeros(1, device="cuda").device.index == 0


def test_pageable_uploads_sync_pinned_non_blocking_ones_do_not() -> None:
    with fake_cuda(1) as fake:
        torch.ones(4).to("cuda:0")
        assert fake.counts["sync"] == 1
        torch.ones(4).pin_memory().to("cuda:0", non_blocking=True)
        assert fake.counts["sync"] == 1
        assert fake.counts["H2D"] == 2


def test_reading_another_streams_tensor_without_waiting_is_a_race() -> None:
    with fake_cuda(1):
        side = torch.cuda.Stream(0)
        with torch.cuda.stream(side):
            x = torch.ones(3, device="cuda:0") * 2
        with pytest.raises(FakeCudaRaceError):
            _ = x + 1
        torch.cuda.current_stream(0).wait_event(side.record_event())
        assert (x + 1).cpu().tolist() == [3.0, 3.0, 3.0]


def test_nccl_refuses_two_ranks_on_one_device_and_sums_bools_as_bytes() -> None:
    with fake_cuda(2) as fake:
        same = [torch.ones(2, device="cuda:0"), torch.ones(2, device="cuda:0")]
        with pytest.raises(RuntimeError, match="duplicate GPU"):
            torch.cuda.nccl.all_reduce(same)
        flags = [torch.ones(2, dtype=torch.uint8, device=f"cuda:{i}") * 255 for i in range(2)]
        torch.cuda.nccl.all_reduce(flags)
        assert flags[0].cpu().tolist() == [254, 254]  # uint8 wraps, as NCCL's does
        with pytest.raises(TypeError, match="Unconvertible"):
            torch.cuda.nccl.all_reduce(
                [torch.ones(2, dtype=torch.complex64, device=f"cuda:{i}") for i in range(2)]
            )
        assert fake.counts["nccl_all_reduce"] == 1


def test_autograd_and_modules_work_on_fake_devices() -> None:
    with fake_cuda(2):
        w = torch.zeros(3, device="cuda:1", requires_grad=True)
        (w * 2).sum().backward()
        assert w.is_leaf
        assert w.grad is not None
        assert w.grad.device.index == 1
