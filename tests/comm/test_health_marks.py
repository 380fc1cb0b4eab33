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


@pytest.fixture(params=[0.02], ids=["publishing"])
def board(request: Any) -> Iterator[tuple[HealthBoard, Any]]:
    """A board on a store of its own; `request.param`: the publisher's interval (s)."""
    from torch.distributed import PrefixStore, TCPStore

    port = free_port()
    timeout = datetime.timedelta(seconds=10)
    server = TCPStore("127.0.0.1", port, 1, True, timeout=timeout, wait_for_workers=False)

    def connect() -> Any:
        return PrefixStore("health/", TCPStore("127.0.0.1", port, 1, False, timeout=timeout))

    with tuning.overridden(publish_seconds=request.param):
        board = HealthBoard(connect, rank=0, world_size=1, store_host=0)
        try:
            yield board, PrefixStore("health/", server)
        finally:
            board.stop()


def _mark(store: Any) -> int | None:
    return int(store.get("r0")) if store.check(["r0"]) else None


@pytest.mark.parametrize("board", [3600.0], ids=["looks-by-hand"], indirect=True)
def test_a_mark_that_moved_since_the_last_look_is_not_published(board: Any) -> None:
    health, _ = board  # its thread sleeps an hour: the test makes every look
    # A TCPStore `set` is not acknowledged: another connection (the server's own) may
    # read before the server applied it (seen: 21 of 20,000 reads, and once in CI).
    # The publisher's own connection reads after its writes.
    store = health._pub_store
    for seq in range(1, 20):  # a collective between any two looks: a training loop
        health.reached = seq
        health._publish()
    assert _mark(store) is None
    health._publish()  # the mark stood still from one look to the next: a stuck worker
    assert _mark(store) == 19
    health.reached = 20
    health._publish()
    assert _mark(store) == 19
    health._publish()
    assert _mark(store) == 20


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
