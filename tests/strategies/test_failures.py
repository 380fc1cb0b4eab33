"""Failures in replicas and merge_fn reach the caller as themselves; nothing hangs.

Every test here runs against MirroredStrategy on several device counts; each would hang
forever if a peer were not released, so each also proves that it returns (pytest's
faulthandler_timeout turns a hang into a failure with stacks).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._core.errors import ReplicaAbortedError
from tests.strategies.conftest import replica_execution


class BoomError(Exception):
    """A distinctive error type."""


@pytest.fixture(
    params=[(n, mode) for mode in ("threads", "cooperative") for n in (2, 3, 4, 8)],
    ids=lambda p: f"mirrored{p[0]}" + ("_coop" if p[1] == "cooperative" else ""),
)
def strategy(request: pytest.FixtureRequest) -> Iterator[Any]:
    n, mode = request.param
    with replica_execution(mode):
        yield cd.MirroredStrategy([f"CPU:{i}" for i in range(n)])


def _works(strategy: Any) -> None:
    """The strategy still runs a collective step correctly."""
    n = strategy.num_replicas_in_sync
    result = strategy.run(lambda: cd.get_replica_context().all_reduce("sum", np.float32(1)))
    assert [float(x) for x in strategy.experimental_local_results(result)] == [n] * n


def _timed_raises(exc_type: type[BaseException], strategy: Any, fn: Any, **kw: Any) -> Any:
    start = time.monotonic()
    with pytest.raises(exc_type) as info:
        strategy.run(fn, **kw)
    assert time.monotonic() - start < 5.0
    return info


def test_exception_in_every_replica(strategy: Any) -> None:
    def fn() -> None:
        raise BoomError("in fn")

    _timed_raises(BoomError, strategy, fn)
    _works(strategy)


def test_exception_in_one_replica_while_others_wait_in_merge_call(strategy: Any) -> None:
    def fn() -> Any:
        ctx = cd.get_replica_context()
        if ctx.replica_id_in_sync_group == strategy.num_replicas_in_sync - 1:
            raise BoomError("only the last replica")
        return ctx.all_reduce("sum", np.float32(1))

    info = _timed_raises(BoomError, strategy, fn)
    assert "only the last replica" in str(info.value)
    _works(strategy)


def test_exception_in_replica_zero_only(strategy: Any) -> None:
    def fn() -> Any:
        ctx = cd.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            raise BoomError("replica 0")
        return ctx.merge_call(lambda s: None)

    _timed_raises(BoomError, strategy, fn)
    _works(strategy)


def test_exception_in_merge_fn(strategy: Any) -> None:
    calls = []

    def merge_fn(s: Any) -> None:
        calls.append(1)
        raise BoomError("in merge_fn")

    def fn() -> None:
        try:
            cd.get_replica_context().merge_call(merge_fn)
        except Exception:  # a replica cannot swallow the failure of its peers
            pytest.fail("the merge_fn failure must not be catchable as Exception in a replica")

    _timed_raises(BoomError, strategy, fn)
    assert calls == [1]
    _works(strategy)


def test_exception_after_a_merge_call(strategy: Any) -> None:
    def fn() -> None:
        ctx = cd.get_replica_context()
        ctx.all_reduce("sum", np.float32(1))
        if ctx.replica_id_in_sync_group == 1:
            raise BoomError("after")
        ctx.all_reduce("sum", np.float32(1))

    _timed_raises(BoomError, strategy, fn)
    _works(strategy)


def test_mismatched_merge_call_counts(strategy: Any) -> None:
    def fn() -> None:
        ctx = cd.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            ctx.merge_call(lambda s: None)

    info = _timed_raises(RuntimeError, strategy, fn)
    assert "different number of replica_context().merge_call() calls" in str(info.value)
    _works(strategy)


def test_extra_merge_call_in_one_replica(strategy: Any) -> None:
    def fn() -> None:
        ctx = cd.get_replica_context()
        ctx.merge_call(lambda s: None)
        if ctx.replica_id_in_sync_group == 1:
            ctx.merge_call(lambda s: None)

    _timed_raises(RuntimeError, strategy, fn)
    _works(strategy)


def test_keyboard_interrupt_like_base_exceptions_propagate(strategy: Any) -> None:
    class Stop(BaseException):
        pass

    def fn() -> None:
        if cd.get_replica_context().replica_id_in_sync_group == 1:
            raise Stop()
        cd.get_replica_context().merge_call(lambda s: None)

    _timed_raises(Stop, strategy, fn)
    _works(strategy)


def test_failed_run_leaves_variables_unchanged(strategy: Any) -> None:
    with strategy.scope():
        v = cd.Variable(np.zeros(2, np.float32), aggregation="sum")

    def fn() -> None:
        if cd.get_replica_context().replica_id_in_sync_group == 0:
            raise BoomError("before the update")
        v.assign_add(np.ones(2, np.float32))

    _timed_raises(BoomError, strategy, fn)
    for component in v.values:
        np.testing.assert_array_equal(component.numpy(), [0, 0])


def test_replicas_run_concurrently_on_threads(strategy: Any) -> None:
    """Threads: every replica is inside fn at once. Cooperative: one at a time, in order.

    (TF runs replicas one after another too: a step must not make replicas wait for each
    other outside the library's collectives.)
    """
    n = strategy.num_replicas_in_sync
    if cd.config.get_replica_execution() == "threads":
        barrier = threading.Barrier(n, timeout=10)
        strategy.run(barrier.wait)
        return
    events: list[tuple[str, int]] = []

    def fn() -> None:
        replica = cd.get_replica_context().replica_id_in_sync_group
        events.append(("enter", replica))
        events.append(("exit", replica))

    strategy.run(fn)
    assert events == [(e, r) for r in range(n) for e in ("enter", "exit")]


def test_concurrent_callers_are_serialised(strategy: Any) -> None:
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            for _ in range(20):
                _works(strategy)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors


@pytest.mark.usefixtures("ctrl_c")
def test_interrupting_the_caller_while_replicas_run_leaves_the_strategy_usable() -> None:
    """Ctrl-C while `run` waits for replica threads: the next run waits for them first.

    Replica 0 (the caller's thread) returns at once, so the KeyboardInterrupt lands in
    the caller's wait for the other replicas, not in a replica: the run is abandoned with
    replicas 1-3 still inside `fn`. Their collective afterwards is aborted, and the next
    run must neither mix their results into its own nor report this run's failure.
    """
    with replica_execution("threads"):
        strategy = cd.MirroredStrategy([f"CPU:{i}" for i in range(4)])
        release = threading.Event()
        aborted: list[int] = []

        def fn() -> int:
            replica = cd.get_replica_context().replica_id_in_sync_group
            if replica == 1:
                time.sleep(0.05)  # replica 0 has returned: the caller is waiting
                main = threading.main_thread().ident
                assert main is not None
                signal.pthread_kill(main, signal.SIGINT)
            if replica != 0:
                release.wait(timeout=10)
                try:
                    cd.get_replica_context().all_reduce("sum", np.float32(1))
                except ReplicaAbortedError:
                    aborted.append(replica)
                    raise
            return replica

        with pytest.raises(KeyboardInterrupt):
            strategy.run(fn)
        release.set()
        _works(strategy)
        assert sorted(aborted) == [1, 2, 3]
        _works(strategy)


def test_a_scheduler_failing_twice_leaves_the_strategy_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cooperative: a second interrupt while the scheduler drains the first one."""
    with replica_execution("cooperative"):
        strategy = cd.MirroredStrategy([f"CPU:{i}" for i in range(4)])
        _works(strategy)  # makes the scheduler
        scheduler = strategy.extended._runner._scheduler

        def interrupted(*args: Any) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(scheduler, "_step", interrupted)
        with pytest.raises(KeyboardInterrupt):
            strategy.run(lambda: cd.get_replica_context().all_reduce("sum", np.float32(1)))
        monkeypatch.undo()
        _works(strategy)
        _works(strategy)
