"""With NCCL, each worker process binds to its local GPU, and workers that share one get
no NCCL (no GPU needed: monkeypatched)."""

from __future__ import annotations

from typing import Any

import pytest

from crossdevice._core.cluster import Cluster

torch = pytest.importorskip("torch")


def _start_on_two_gpus(
    monkeypatch: pytest.MonkeyPatch, local_rank: int, local_world_size: int
) -> dict[str, Any]:
    """Start the default group on a faked 2-GPU host; what was set and started."""
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
        "worker",
        3,
        3,
        4,
        "127.0.0.1",
        29500,
        local_rank=local_rank,
        local_world_size=local_world_size,
        source="torchrun",
    )
    comm = object.__new__(torch_dist.ProcessGroupCommunicator)
    comm._start_default_group(cluster, 10.0)
    return calls


def test_nccl_binds_each_process_to_its_local_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _start_on_two_gpus(monkeypatch, local_rank=1, local_world_size=2)
    assert calls["set_device"] == torch.device("cuda", 1)  # LOCAL_RANK 1 -> cuda:1
    backend, kwargs = calls["start"]
    assert backend == "cpu:gloo,cuda:nccl"
    assert kwargs["device_id"] == torch.device("cuda", 1)


def test_workers_that_outnumber_the_gpus_start_without_nccl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3 workers on a 2-GPU host: NCCL would refuse two ranks on one card at the start."""
    calls = _start_on_two_gpus(monkeypatch, local_rank=2, local_world_size=3)
    assert calls["set_device"] == torch.device("cuda", 0)  # LOCAL_RANK 2 -> cuda:0
    assert calls["start"] == ("gloo", {"device_id": None})


@pytest.mark.parametrize(
    ("identities", "shared"),
    [
        ([("a", "u0"), ("a", "u1")], []),
        ([("a", "u0"), ("a", "u0")], [[0, 1]]),
        ([("a", "u0"), ("b", "u0")], []),  # the same index on two hosts is two cards
        ([("a", "u0"), ("a", "u1"), ("a", "u0"), ("a", "u1"), ("a", "u2")], [[0, 2], [1, 3]]),
    ],
)
def test_shared_devices_lists_the_ranks_on_one_card(
    identities: list[tuple[str, str]], shared: list[list[int]]
) -> None:
    from crossdevice._comm.workers.groups import shared_devices

    assert shared_devices(identities) == shared


@pytest.mark.parametrize("shared", [[], [[0, 1]]])
def test_groups_make_nccl_only_when_no_two_workers_share_a_card(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, shared: list[list[int]]
) -> None:
    """The decision each worker takes from the gathered devices (one Gloo world here)."""
    import torch.distributed as dist

    from crossdevice._comm.workers import groups
    from crossdevice._core.options import CommunicationImplementation

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        made: list[str] = []
        real_new_group = dist.new_group

        def new_group(backend: str, timeout: Any) -> Any:
            made.append(backend)
            return real_new_group(backend="gloo", timeout=timeout)

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(groups.dist, "is_nccl_available", lambda: True)
        monkeypatch.setattr(groups.dist, "new_group", new_group)
        monkeypatch.setattr(groups, "_device_identity", lambda: ("host", "card"))
        monkeypatch.setattr(groups, "shared_devices", lambda identities: shared)
        monkeypatch.setattr(groups, "_WARNED", [])
        made_groups = groups.Groups(10.0, CommunicationImplementation.AUTO)
        assert made == (["gloo", "nccl"] if not shared else ["gloo"])
        assert (made_groups.cuda is None) == bool(shared)
        warned = groups._WARNED
        assert warned == ([True] if shared else [])
        made_groups.destroy()
    finally:
        dist.destroy_process_group()
