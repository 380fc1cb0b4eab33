"""With NCCL, each worker process binds to its local GPU (no GPU needed: monkeypatched)."""

from __future__ import annotations

from typing import Any

import pytest

from crossdevice._core.cluster import Cluster

torch = pytest.importorskip("torch")


def test_nccl_binds_each_process_to_its_local_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from crossdevice._comm.workers import communicator as torch_dist
    from crossdevice._comm.workers import start as process_group_start

    calls: dict[str, Any] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(process_group_start.dist, "is_nccl_available", lambda: True)

    def fake_start(cluster: Cluster, backend: str, timeout: float, **kwargs: Any) -> None:
        calls["start"] = (backend, kwargs)

    monkeypatch.setattr(process_group_start, "start_default_group", fake_start)
    cluster = Cluster(
        "worker", 3, 3, 4, "127.0.0.1", 29500, local_rank=1, local_world_size=2, source="torchrun"
    )
    comm = object.__new__(torch_dist.ProcessGroupCommunicator)
    comm._start_default_group(cluster, 10.0)
    assert calls["set_device"] == torch.device("cuda", 1)  # LOCAL_RANK 1 -> cuda:1
    backend, kwargs = calls["start"]
    assert backend == "cpu:gloo,cuda:nccl"
    assert kwargs["device_id"] == torch.device("cuda", 1)
