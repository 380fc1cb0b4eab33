"""`strategy.close()` while a run is in flight, inside it, or before any run.

The bug hunt: close() inside the step (replica 0) hung for ever on replica threads and
returned normally as cooperative replicas; close() from another thread during a loop of
runs hung 5 runs in 7 (close dropped a replica's job posted but not yet taken, and
replica 0 waited for that replica for ever); close() before any run let a later run
succeed. Each scenario runs on a helper thread with a deadline (`tests.helpers.within`),
so a regression fails instead of hanging the suite, in both execution modes.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from tests.helpers import within
from tests.strategies.conftest import replica_execution

MODES = ("threads", "cooperative")

#: What close() inside a run says (what, why and what to do).
_INSIDE = r"close\(\) was called inside a run of this strategy.*Call close\(\) after strategy.run"

_CLOSED = "the strategy is closed"


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each execution mode, set for the test."""
    with replica_execution(request.param):
        yield request.param


def _mirrored(n: int = 2) -> Any:
    return cd.MirroredStrategy([f"CPU:{i}" for i in range(n)])


def _sum_of_ones() -> Any:
    return cd.get_replica_context().all_reduce("sum", np.ones(3, np.float32))


def _values(strategy: Any, result: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in strategy.experimental_local_results(result)]


#: Strategies close() inside the step is checked on: MirroredStrategy ends its replica
#: threads in close(); a one-worker MultiWorkerMirroredStrategy's close() does not reach
#: them (the strategy refuses it from its replica context).
STRATEGIES = {
    "mirrored": _mirrored,
    "multi_worker_1": lambda: cd.MultiWorkerMirroredStrategy(devices=["CPU:0", "CPU:1"]),
}


@pytest.mark.parametrize("make", STRATEGIES.values(), ids=STRATEGIES.keys())
def test_close_inside_the_step_raises_and_the_strategy_still_runs(mode: str, make: Any) -> None:
    strategy = make()

    def step() -> Any:
        if cd.get_replica_context().replica_id_in_sync_group == 0:
            strategy.close()
        return _sum_of_ones()

    _refused_then_runs(strategy, step, 2.0)


def _refused_then_runs(strategy: Any, step: Any, total: float) -> None:
    """`run(step)` is refused (close inside the run); not closed, the next run works."""

    def scenario() -> list[np.ndarray]:
        with pytest.raises(RuntimeError, match=_INSIDE):
            strategy.run(step)
        values = _values(strategy, strategy.run(_sum_of_ones))
        strategy.close()
        return values

    for value in within(10, scenario):
        np.testing.assert_array_equal(value, np.full(3, total))


def test_close_inside_a_merge_fn_raises(mode: str) -> None:
    # merge_fn runs in cross-replica context: the runner, not the replica context, knows.
    strategy = _mirrored(3)

    def merge_fn(s: Any) -> None:
        s.close()

    def step() -> Any:
        cd.get_replica_context().merge_call(merge_fn)
        return _sum_of_ones()

    _refused_then_runs(strategy, step, 3.0)


@pytest.mark.parametrize("first_run", [False, True])
@pytest.mark.parametrize("make", STRATEGIES.values(), ids=STRATEGIES.keys())
def test_close_before_or_after_a_run_makes_run_raise(mode: str, make: Any, first_run: bool) -> None:
    """A one-worker MultiWorkerMirroredStrategy ran on after close() (its close closed
    the worker communicator only)."""
    strategy = make()

    def scenario() -> None:
        if first_run:
            strategy.run(_sum_of_ones)
        strategy.close()
        for _ in range(2):
            with pytest.raises(RuntimeError, match=_CLOSED):
                strategy.run(_sum_of_ones)
        strategy.close()  # idempotent

    within(10, scenario)


def test_close_from_another_thread_waits_for_the_run_in_flight(mode: str) -> None:
    strategy = _mirrored()
    release = threading.Event()
    order: list[str] = []

    def step() -> Any:
        release.wait(5)
        return _sum_of_ones()

    def closer(started: threading.Event) -> None:
        started.set()
        strategy.close()
        order.append("closed")

    def scenario() -> list[np.ndarray]:
        started = threading.Event()
        timer = threading.Timer(0.2, release.set)
        timer.start()
        thread = threading.Timer(0.05, closer, args=(started,))
        thread.start()
        result = strategy.run(step)  # the closer calls close() while this waits
        order.append("run")
        thread.join(5)
        assert started.is_set()
        with pytest.raises(RuntimeError, match=_CLOSED):
            strategy.run(_sum_of_ones)
        return _values(strategy, result)

    for value in within(10, scenario):
        np.testing.assert_array_equal(value, np.full(3, 2.0))
    # The run finished on every replica before close() returned.
    assert order == ["run", "closed"]


@pytest.mark.parametrize("replicas", [2, 4])
def test_close_from_another_thread_during_a_loop_of_runs(mode: str, replicas: int) -> None:
    rng = random.Random(0)

    def one_loop(delay: float) -> int:
        before = set(threading.enumerate())
        strategy = _mirrored(replicas)
        strategy.run(_sum_of_ones)  # the replica threads exist
        mine = [t for t in threading.enumerate() if t not in before and "-replica-" in t.name]
        assert len(mine) == replicas - 1
        closer = threading.Timer(delay, strategy.close)
        closer.start()
        runs = 0

        def step_until_closed() -> None:
            nonlocal runs
            while True:  # every run finishes on every replica, correctly
                for value in _values(strategy, strategy.run(_sum_of_ones)):
                    np.testing.assert_array_equal(value, np.full(3, float(replicas)))
                runs += 1

        with pytest.raises(RuntimeError, match=_CLOSED):
            step_until_closed()
        closer.join(5)
        assert not closer.is_alive(), "close() did not return"
        for thread in mine:  # idle ones (cooperative runs) too
            thread.join(5)
            assert not thread.is_alive(), f"{thread.name} outlived close()"
        return runs

    def scenario() -> int:
        return sum(one_loop(rng.uniform(0.0, 0.01)) for _ in range(30))

    start = time.monotonic()
    assert within(60, scenario) > 0
    assert time.monotonic() - start < 60
