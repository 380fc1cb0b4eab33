"""The arrival marks a `HealthBoard` publishes: only a mark that stood still an interval."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from crossdevice._comm.workers.health import HealthBoard  # noqa: E402
from crossdevice._core import tuning  # noqa: E402
from tests.multi_worker.harness import free_port  # noqa: E402


@pytest.fixture
def board() -> Iterator[tuple[HealthBoard, Any]]:
    from torch.distributed import PrefixStore, TCPStore

    port = free_port()
    timeout = datetime.timedelta(seconds=10)
    server = TCPStore("127.0.0.1", port, 1, True, timeout=timeout, wait_for_workers=False)

    def connect() -> Any:
        return PrefixStore("health/", TCPStore("127.0.0.1", port, 1, False, timeout=timeout))

    with tuning.overridden(publish_seconds=0.02):
        board = HealthBoard(connect, rank=0, world_size=1, store_host=0)
        try:
            yield board, PrefixStore("health/", server)
        finally:
            board.stop()


def _mark(store: Any) -> int | None:
    return int(store.get("r0")) if store.check(["r0"]) else None


def test_a_mark_that_moves_every_interval_is_not_published(board: Any) -> None:
    health, store = board
    for seq in range(1, 60):  # a collective every half interval: a training loop
        health.reached = seq
        time.sleep(0.01)
    assert _mark(store) is None


def test_a_mark_that_stands_still_is_published_within_two_intervals(board: Any) -> None:
    health, store = board
    health.reached = 7  # a worker stuck inside collective 7
    deadline = time.monotonic() + 2.0
    while _mark(store) != 7 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert _mark(store) == 7
    health.reached = 9  # it moved on, and stopped again
    deadline = time.monotonic() + 2.0
    while _mark(store) != 9 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert _mark(store) == 9
