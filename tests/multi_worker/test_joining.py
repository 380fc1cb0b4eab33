"""A worker that never joins, or a chief whose store is gone, ends in a clear, timely error.

torch alone waited its timeout (5 minutes) and raised a bare `DistStoreError: wait
timeout after 300000ms, keys: /0//cpu//0/1` (a worker never started) or
`DistNetworkError: The client socket has timed out ... trying to connect to (127.0.0.1,
port)` (the chief never started, or already gone after giving up), naming nothing of
ours. Now the join is bounded by `CROSSDEVICE_INIT_TIMEOUT_SECONDS` and every worker
raises our error naming the workers expected, those that joined and those that did
not, the store's address, the wait, and the variable that grants more time.

The in-process tests call `start_default_group` directly (1 s timeouts); the others
start 2 or 3 workers on 127.0.0.1 with some of them absent, late or dying.
"""

from __future__ import annotations

import datetime
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from crossdevice._core import tuning
from crossdevice._core.cluster import Cluster
from crossdevice._core.errors import CollectiveTimeoutError, WorkerFailedError
from tests.multi_worker.harness import free_port, run_workers
from tests.multi_worker.joining_workers import join

torch = pytest.importorskip("torch")

#: The join's bound in the worker tests (seconds): short, yet longer than one worker's
#: start-up lag behind another on a loaded 2-core host.
_TIMEOUT = 5.0
#: What a worker may take beyond it: a poll to read a peer's account (0.25 s), the
#: chief's stay for its readers, a loaded host.
_MARGIN = 5.0
_ENV = {"CROSSDEVICE_INIT_TIMEOUT_SECONDS": f"{_TIMEOUT:g}"}
_ADDRESS = r"127\.0\.0\.1:\d+"


def _cluster(rank: int, world_size: int, port: int, *, tf_config: bool = True) -> Cluster:
    """A cluster on 127.0.0.1: TF_CONFIG-like (a chief and workers), or torchrun's."""
    addresses = tuple(f"127.0.0.1:{port + i}" for i in range(world_size))
    jobs = (("chief", addresses[:1]), ("worker", addresses[1:])) if tf_config else ()
    task = ("chief", 0) if rank == 0 else ("worker", rank - 1)
    return Cluster(*task, rank, world_size, "127.0.0.1", port, jobs=jobs)


def _start(cluster: Cluster, timeout: float) -> None:
    """`start_default_group` for `cluster`; these tests expect it to raise."""
    from crossdevice._comm.workers.start import start_default_group

    start_default_group(cluster, "gloo", timeout)
    raise AssertionError("the start returned")  # pragma: no cover


@pytest.fixture(autouse=True)
def _loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """`start_default_group` sets GLOO_SOCKET_IFNAME when unset: keep it off this process."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


def test_the_join_timeout_is_the_environments_or_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from crossdevice._comm.workers.start import INIT_TIMEOUT_ENV, join_timeout

    monkeypatch.delenv(INIT_TIMEOUT_ENV, raising=False)
    assert join_timeout(None) == tuning.TUNING.default_init_timeout_seconds
    assert tuning.TUNING.default_init_timeout_seconds >= 300  # workers start minutes apart
    monkeypatch.setenv(INIT_TIMEOUT_ENV, " 900 ")
    assert join_timeout(None) == 900.0
    assert join_timeout(2.5) == 2.5  # a communicator's own init_timeout_seconds
    for bad in ("soon", "0.5", "nan", "-5"):
        monkeypatch.setenv(INIT_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=rf"{INIT_TIMEOUT_ENV} must be .* got {bad!r}"):
            join_timeout(None)


def test_the_chief_names_the_workers_that_never_joined() -> None:
    port = free_port()
    cluster = _cluster(0, 3, port)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        _start(cluster, 1.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert 1.0 <= elapsed < 1.0 + 10.0, elapsed  # (a loaded 2-core host)
    assert f"expected 3 at the c10d store at {cluster.master} (served by rank 0" in message
    assert f"rank(s) [0] (chief 0 at 127.0.0.1:{port}) joined" in message, message
    workers = f"worker 0 at 127.0.0.1:{port + 1}, worker 1 at 127.0.0.1:{port + 2}"
    assert f"rank(s) [1, 2] ({workers}) did not" in message, message
    assert "this worker (rank 0) gave up after waiting 1.0 s (its init timeout: 1 s)." in message
    assert "raise CROSSDEVICE_INIT_TIMEOUT_SECONDS (now 1 s here)" in message, message


def test_a_worker_whose_chief_never_listens_names_its_address() -> None:
    cluster = _cluster(1, 2, free_port(), tf_config=False)  # torchrun's: ranks alone
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        _start(cluster, 1.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert 1.0 <= elapsed < 1.0 + 10.0, elapsed  # (a loaded 2-core host)
    assert f"rank 1 of 2 could not reach the c10d store at {cluster.master}" in message
    assert "for 1.0 s (connection refused: nothing listens there)" in message, message
    assert "it never accepted a connection" in message, message
    # Both truths: not started yet, or gone after giving up.
    assert "it has not started yet" in message, message
    assert "already gave up waiting for the workers" in message, message
    assert "MASTER_ADDR/MASTER_PORT" in message, message


def test_a_store_lost_while_joining_is_named() -> None:
    """The chief's store answers, then goes away (its process ended) while rank 1 waits."""
    from torch._C._distributed_c10d import TCPStore

    server = [
        TCPStore(
            "127.0.0.1",
            0,
            2,
            is_master=True,
            timeout=datetime.timedelta(seconds=5),
            wait_for_workers=False,
        )
    ]
    cluster = _cluster(1, 2, server[0].port)
    threading.Timer(1.0, server.clear).start()  # the store dies with its last reference
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        _start(cluster, 10.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < 1.0 + 10.0, elapsed  # (a loaded 2-core host)
    assert f"rank 1 of 2 reached the c10d store at {cluster.master}" in message, message
    assert "but it stopped answering while the workers joined" in message, message
    assert "the chief (rank 0) has crashed or exited" in message, message


def test_torchs_rendezvous_failing_after_the_join_is_explained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every worker joined, then torch's rendezvous failed: a worker crashed meanwhile."""
    import torch.distributed as dist

    def broken(**kwargs: Any) -> None:
        raise dist.DistStoreError("wait timeout after 1000ms, keys: /0//cpu//0/1")

    monkeypatch.setattr(dist, "init_process_group", broken)
    with pytest.raises(WorkerFailedError) as info:
        _start(_cluster(0, 1, free_port()), 1.0)
    message = str(info.value)
    assert "all 1 workers joined at the c10d store at 127.0.0.1:" in message, message
    assert "torch's rendezvous of the process group then failed on rank 0" in message
    assert "DistStoreError: wait timeout after 1000ms" in message, message
    assert "a worker probably crashed or exited right after joining" in message, message


# -- workers on 127.0.0.1 --------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_worker_that_never_starts_is_named_by_every_other(tmp_path: Path) -> None:
    """Rank 1 comes late, so the chief gives up first: it stays until rank 1 read why."""
    plan = {1: "late:2.5", 2: "absent"}
    results = run_workers(
        join, 3, args=(plan, None, str(tmp_path)), launcher="tf_config", chief=True,
        env=_ENV, timeout=60,
    )  # fmt: skip
    for rank in (0, 1):
        got = results[rank].unwrap()
        assert got["type"] == "CollectiveTimeoutError", (rank, got)
        message = got["message"]
        assert re.search(rf"expected 3 at the c10d store at {_ADDRESS}", message), message
        assert re.search(
            rf"rank\(s\) \[0, 1\] \(chief 0 at {_ADDRESS}, worker 0 at {_ADDRESS}\) joined, "
            rf"rank\(s\) \[2\] \(worker 1 at {_ADDRESS}\) did not",
            message,
        ), message
        who = "this worker (rank 0)" if rank == 0 else "rank 0"
        assert f"{who} gave up after waiting" in message, message
        assert ("this worker (rank 1) waited" in message) == (rank == 1), message
        assert f"(its init timeout: {_TIMEOUT:g} s)" in message, message
        assert f"raise CROSSDEVICE_INIT_TIMEOUT_SECONDS (now {_TIMEOUT:g} s here)" in message
        assert got["elapsed"] < _TIMEOUT + _MARGIN, (rank, got)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("chief", ["never-started", "gave-up-and-left"])
def test_a_worker_without_its_chief_names_the_address(chief: str, tmp_path: Path) -> None:
    """No chief listening: not started yet, or already gone after its own timeout."""
    plan = {0: "absent"} if chief == "never-started" else {1: "after:0"}
    results = run_workers(
        join, 2, args=(plan, None, str(tmp_path)), launcher="tf_config", chief=True,
        env=_ENV, timeout=60,
    )  # fmt: skip
    got = results[1].unwrap()
    message = got["message"]
    if chief == "gave-up-and-left":
        left = results[0].unwrap()
        assert left["type"] == "CollectiveTimeoutError", left
        assert re.search(rf"rank\(s\) \[1\] \(worker 0 at {_ADDRESS}\) did not", left["message"])
    assert got["type"] == "CollectiveTimeoutError", got
    assert re.search(rf"rank 1 of 2 could not reach the c10d store at {_ADDRESS}", message)
    assert f"for {_TIMEOUT:.1f} s (connection refused" in message, message
    assert re.search(rf"the chief \(rank 0, chief 0 at {_ADDRESS}\)", message), message
    assert "has not started yet" in message, message
    assert "already gave up waiting for the workers" in message, message
    assert f"CROSSDEVICE_INIT_TIMEOUT_SECONDS (now {_TIMEOUT:g} s)" in message, message
    assert _TIMEOUT <= got["elapsed"] < _TIMEOUT + _MARGIN, got


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_chief_that_dies_while_workers_join_is_named(tmp_path: Path) -> None:
    plan = {0: "exit-when-joined:2", 2: "absent"}
    results = run_workers(
        join, 3, args=(plan, 30.0, str(tmp_path)), required=[1], env=_ENV, timeout=60
    )
    assert results[0].exitcode == 3, results[0].describe()
    got = results[1].unwrap()
    assert got["type"] == "WorkerFailedError", got
    message = got["message"]
    assert re.search(rf"rank 1 of 3 reached the c10d store at {_ADDRESS}", message), message
    assert "stopped answering while the workers joined" in message, message
    assert "the chief (rank 0) has crashed or exited" in message, message
    assert got["elapsed"] < _MARGIN, got  # at once, not at the 30 s timeout
