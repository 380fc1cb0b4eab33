"""Cooperative replica execution: what differs from threads, and how "auto" chooses.

The contract and failure suites already run every multi-replica strategy in both modes;
these tests cover what only the cooperative mode has: the caller's thread, per-replica
thread-local state, fast failure of a rendezvous nobody can complete, and the tuner.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._core.devices import current_device
from crossdevice._core.errors import CollectiveTimeoutError
from crossdevice._replica.execution import Tuner
from tests.strategies.conftest import replica_execution


@pytest.fixture(params=[2, 4])
def coop(request: pytest.FixtureRequest) -> Iterator[Any]:
    """MirroredStrategy with 2 or 4 CPU replicas, run cooperatively."""
    with replica_execution("cooperative"):
        yield cd.MirroredStrategy([f"CPU:{i}" for i in range(request.param)])


def test_set_replica_execution_rejects_unknown_modes() -> None:
    with pytest.raises(ValueError, match=r"one of \['threads', 'cooperative', 'auto'\].*'fast'"):
        cd.config.set_replica_execution("fast")  # type: ignore[arg-type]
    assert cd.config.get_replica_execution() == "threads"


@pytest.mark.parametrize("mode", ["threads", "cooperative"])
def test_which_thread_runs_the_replicas(mode: str) -> None:
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    with replica_execution(mode):
        idents = strategy.experimental_local_results(strategy.run(threading.get_ident))
    caller = threading.get_ident()
    assert idents[0] == caller
    if mode == "cooperative":
        assert set(idents) == {caller}
    else:
        assert len(set(idents)) == 3


def test_replicas_keep_their_context_and_device_across_waits(coop: Any) -> None:
    def fn() -> tuple[int, str, int, str]:
        ctx = cd.get_replica_context()
        before = (ctx.replica_id_in_sync_group, current_device())
        ctx.all_reduce("sum", np.float32(1))
        ctx.merge_call(lambda strategy: None)
        after = cd.get_replica_context()
        return (*before, after.replica_id_in_sync_group, current_device())

    with coop.scope():
        results = coop.experimental_local_results(coop.run(fn))
        assert cd.get_replica_context() is None  # the caller is back in cross-replica mode
    for i, (r0, d0, r1, d1) in enumerate(results):
        assert r0 == r1 == i
        assert d0 == d1 == coop.extended.worker_devices[i]


def test_a_rendezvous_nobody_can_complete_fails_at_once(coop: Any) -> None:
    """Replicas in different calls meet in one rendezvous: an error, not a stall."""

    def fn() -> Any:
        ctx = cd.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            return ctx.merge_call(lambda strategy: 1)
        return ctx.all_reduce("sum", np.float32(1))

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="replica 0: merge_call #0; replica 1: all_reduce"):
        coop.run(fn)
    assert time.monotonic() - start < 5
    assert float(coop.experimental_local_results(coop.run(lambda: np.float32(2)))[0]) == 2


def test_a_collective_timeout_fires_while_a_peer_is_busy_in_user_code() -> None:
    """Threads: a peer that has not arrived yet is waited for, up to the timeout."""
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    options = cd.experimental.CommunicationOptions(timeout_seconds=0.3)

    def fn() -> Any:
        ctx = cd.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            time.sleep(1.0)
        return ctx.all_reduce("sum", np.float32(1), options=options)

    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"timed out after 0\.3 s: replicas \[1\]"):
        strategy.run(fn)
    assert 0.25 <= time.monotonic() - start < 5


def test_grad_mode_is_per_replica(coop: Any, torch_module: Any) -> None:
    torch = torch_module

    def fn() -> tuple[bool, bool]:
        ctx = cd.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            with torch.no_grad():
                ctx.all_reduce("sum", torch.ones(2))  # the others run while 0 waits here
                inside = torch.is_grad_enabled()
            return inside, torch.is_grad_enabled()
        before = torch.is_grad_enabled()
        ctx.all_reduce("sum", torch.ones(2))
        return before, torch.is_grad_enabled()

    results = coop.experimental_local_results(coop.run(fn))
    assert results[0] == (False, True)
    assert all(r == (True, True) for r in results[1:])
    assert torch.is_grad_enabled()


def test_tuner_tries_both_modes_for_small_steps_then_keeps_the_faster_for_good() -> None:
    tuner = Tuner("test")
    key = object()
    assert tuner.choose(key) is False  # unknown: threads
    tuner.record(key, False, 200e-6)
    for _ in range(Tuner.SAMPLES):
        assert tuner.choose(key) is True
        tuner.record(key, True, 50e-6)
    for _ in range(Tuner.SAMPLES - 1):
        assert tuner.choose(key) is False
        tuner.record(key, False, 200e-6)
    assert tuner.choose(key) is True
    assert tuner.choices() == {repr(key): "cooperative"}
    # Decided: later timings never move it (a mode must not flip with the machine's load).
    for _ in range(100):
        coop = tuner.choose(key)
        tuner.record(key, coop, 900e-6 if coop else 30e-6)
        assert coop


def test_tuner_leaves_large_steps_on_threads() -> None:
    tuner = Tuner("test")
    key = object()
    tuner.record(key, False, 5e-3)
    assert not any(tuner.choose(key) for _ in range(100))
    assert tuner.choices() == {repr(key): "threads"}


def test_tuner_ignores_one_stalled_run() -> None:
    tuner = Tuner("test")
    key = object()
    tuner.record(key, False, 200e-6)
    for seconds in (50e-6, 50e-6, 10e-3):  # the last one: the machine stalled
        assert tuner.choose(key) is True
        tuner.record(key, True, seconds)
    for _ in range(Tuner.SAMPLES - 1):
        assert tuner.choose(key) is False
        tuner.record(key, False, 200e-6)
    assert tuner.choose(key) is True


_AUTO_SCRIPT = textwrap.dedent(
    """
    import logging, sys, threading
    import numpy as np
    import crossdevice as cd
    if sys.argv[1] == "torch":
        import torch
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    cd.config.set_logical_cpu_devices(4)
    cd.config.set_replica_execution("auto")
    strategy = cd.MirroredStrategy([f"CPU:{i}" for i in range(4)])
    assert strategy.extended.replica_execution == "auto"
    def step():
        cd.get_replica_context().all_reduce("sum", np.ones(256, np.float32))
        return threading.get_ident()
    modes = []
    for _ in range(40):
        idents = strategy.experimental_local_results(strategy.run(step))
        modes.append("cooperative" if set(idents) == {threading.get_ident()} else "threads")
    choice = strategy.extended.replica_execution_choices()["step"]
    assert set(modes[-30:]) == {choice}, (modes, choice)
    print("CHOICE", choice)
    """
)


@pytest.mark.parametrize("imports", ["numpy", "torch"])
def test_auto_chooses_once_per_step_function_and_says_so(
    imports: str, request: pytest.FixtureRequest
) -> None:
    if imports == "torch":
        from tests.conftest import require_torch

        require_torch(request)
    out = subprocess.run(
        [sys.executable, "-c", _AUTO_SCRIPT, imports],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = out.stdout.strip().splitlines()
    logged = [line for line in lines if "replica execution 'auto' chose" in line]
    assert len(logged) == 1, out.stdout
    choice = lines[-1].removeprefix("CHOICE ")
    assert choice in ("threads", "cooperative")
    assert f"chose {choice} for step function step " in logged[0]
