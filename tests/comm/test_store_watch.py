"""`watched`: a start-up step ends in an error when the store host freezes, never waits on."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from crossdevice._comm.workers.store_watch import StoreProbe, watched  # noqa: E402
from crossdevice._core import tuning  # noqa: E402
from crossdevice._core.errors import CollectiveTimeoutError, WorkerFailedError  # noqa: E402
from tests.multi_worker.harness import free_port  # noqa: E402


def _serve(port: int, ready: Any) -> None:
    from torch._C._distributed_c10d import TCPStore

    store = TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    ready.set()
    time.sleep(120)
    del store


@pytest.fixture
def store_server() -> Iterator[tuple[int, int]]:
    """A c10d store server in a process of its own: (its port, its pid)."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    port = free_port()
    server = context.Process(target=_serve, args=(port, ready), daemon=True)
    server.start()
    try:
        assert ready.wait(60), "the store server did not start"
        yield port, server.pid or 0
    finally:
        server.kill()
        server.join(10)


def test_the_step_runs_on_a_helper_and_returns_or_raises_as_itself() -> None:
    threads: list[str] = []

    def step() -> int:
        threads.append(threading.current_thread().name)
        return 7

    assert watched(step, store=None, store_host=0, backstop=5.0, what="x") == 7
    assert threads == ["crossdevice-start"]

    def fails() -> None:
        raise KeyError("torch's own error")

    with pytest.raises(KeyError, match="torch's own error"):
        watched(fails, store=None, store_host=0, backstop=5.0, what="x")


def test_the_backstop_ends_any_wait() -> None:
    release = threading.Event()
    start = time.monotonic()
    with (
        tuning.overridden(startup_probe_seconds=0.05),
        pytest.raises(CollectiveTimeoutError, match=r"the test step did not finish within 0.3 s"),
    ):
        watched(
            lambda: release.wait(30), store=None, store_host=0, backstop=0.3, what="the test step"
        )
    assert time.monotonic() - start < 5.0
    release.set()


def test_a_store_that_answers_is_no_failure(store_server: tuple[int, int]) -> None:
    port, _ = store_server
    release = threading.Event()
    threading.Timer(1.5, release.set).start()
    with tuning.overridden(startup_probe_seconds=0.05, dead_after_seconds=0.5):
        got = watched(
            lambda: release.wait(30),
            store=("127.0.0.1", port),
            store_host=0,
            backstop=30.0,
            what="the test step",
        )
    assert got is True


def test_a_store_not_listening_yet_is_no_failure() -> None:
    release = threading.Event()
    threading.Timer(1.5, release.set).start()
    with tuning.overridden(startup_probe_seconds=0.05, dead_after_seconds=0.5):
        got = watched(
            lambda: release.wait(30),
            store=("127.0.0.1", free_port()),
            store_host=0,
            backstop=30.0,
            what="the test step",
        )
    assert got is True


@pytest.mark.parametrize("host", [0, None])
def test_a_frozen_store_host_is_named(store_server: tuple[int, int], host: int | None) -> None:
    port, pid = store_server
    os.kill(pid, signal.SIGSTOP)
    release = threading.Event()
    start = time.monotonic()
    try:
        with (
            tuning.overridden(startup_probe_seconds=0.05, dead_after_seconds=1.0),
            pytest.raises(WorkerFailedError) as caught,
        ):
            watched(
                lambda: release.wait(60),
                store=("127.0.0.1", port),
                store_host=host,
                backstop=60.0,
                what="the test step",
            )
    finally:
        os.kill(pid, signal.SIGCONT)
        release.set()
    assert 1.0 <= time.monotonic() - start < 10.0
    who = "rank 0" if host == 0 else "torchrun's agent"
    assert f"the test step cannot finish: {who} serves the c10d store at 127.0.0.1:{port}" in (
        str(caught.value)
    )
    assert "stopped or frozen" in str(caught.value)


def test_the_probe_counts_the_silence_of_its_question(store_server: tuple[int, int]) -> None:
    port, pid = store_server
    probe = StoreProbe("127.0.0.1", port)
    try:
        assert probe.silence() == 0.0  # asked
        time.sleep(0.5)
        assert probe.silence() == 0.0  # answered, asked again
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.3)
        probe.silence()  # the question in flight may have been answered before the stop
        time.sleep(0.5)
        assert probe.silence() >= 0.4
    finally:
        os.kill(pid, signal.SIGCONT)
        probe.close()
