"""A strategy's replicas: their threads' lifetime, Ctrl-C, nested runs, the caller's state.

Each test runs on replica threads and as cooperative replicas where both apply.
"""

from __future__ import annotations

import gc
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._core import tuning
from tests.helpers import within
from tests.strategies.conftest import replica_execution

MODES = ("threads", "cooperative")


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each execution mode, set for the test."""
    with replica_execution(request.param):
        yield request.param


def _replica_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "-replica-" in t.name]


def _wait_until(predicate: Any, seconds: float) -> float:
    """Seconds until `predicate()` held (polling), or fail after `seconds`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > seconds:
            pytest.fail(f"not within {seconds} s")
        time.sleep(0.002)
    return time.monotonic() - start


def test_close_ends_the_replica_threads_within_100_ms() -> None:
    before = set(_replica_threads())
    with replica_execution("threads"), cd.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"]) as s:
        s.run(lambda: cd.get_replica_context().all_reduce("sum", np.float32(1)))
        mine = [t for t in _replica_threads() if t not in before]
        assert len(mine) == 2
    assert _wait_until(lambda: not any(t.is_alive() for t in mine), 1.0) < 0.1
    with pytest.raises(RuntimeError, match="the strategy is closed"):
        s.run(lambda: 1)
    s.close()  # idempotent


def test_dropping_200_strategies_returns_the_thread_count_to_baseline() -> None:
    gc.collect()
    before = set(threading.enumerate())
    with replica_execution("threads"):
        strategies = [cd.MirroredStrategy([f"CPU:{i}" for i in range(4)]) for _ in range(200)]
        for s in strategies:
            s.run(lambda: 1)
    mine = [t for t in threading.enumerate() if t not in before]
    assert len(mine) == 600  # 3 replica threads each (replica 0 is the caller)
    del strategies, s
    gc.collect()  # strategies and their replica contexts refer to each other
    # Threads of earlier tests' strategies may end meanwhile: count only these ones.
    _wait_until(lambda: not any(t.is_alive() for t in mine), 1.0)


#: Strategies a nested run is checked on: MirroredStrategy with 1 to 4 replicas (one
#: replica used to hang: its merge_fn ran outside the runner, whose run lock the nested
#: run then waited for), OneDeviceStrategy and the default strategy.
NESTED = {
    **{
        f"mirrored{n}": (lambda n=n: cd.MirroredStrategy([f"CPU:{i}" for i in range(n)]))
        for n in (1, 2, 3, 4)
    },
    "one_device": lambda: cd.OneDeviceStrategy("CPU:0"),
    "default": cd.get_strategy,
}


@pytest.mark.parametrize("make", list(NESTED.values()), ids=list(NESTED))
def test_run_inside_merge_fn_runs_like_tf(mode: str, make: Any) -> None:
    """TF's merge_fn runs on the caller's thread, where `strategy.run` starts a fresh set of
    replica threads: the nested run's results come back to merge_fn, then each outer
    replica gets its own component (checked against TF 2.21, MirroredStrategy on 1 to 4
    logical CPUs)."""
    del mode
    strategy = make()
    n = strategy.num_replicas_in_sync

    def inner() -> Any:
        ctx = cd.get_replica_context()
        return ctx.replica_id_in_sync_group, ctx.all_reduce("sum", np.float32(2))

    def step() -> Any:
        ctx = cd.get_replica_context()
        nested = ctx.merge_call(lambda s: s.run(lambda: 1))
        replica, reduced = ctx.merge_call(lambda s: s.run(inner))
        return nested, replica, float(reduced)

    def runs() -> Any:
        results = strategy.experimental_local_results(strategy.run(step))
        strategy.run(lambda: cd.get_replica_context().merge_call(lambda st: st.run(lambda: 1)))
        after = strategy.experimental_local_results(strategy.run(inner))
        return results, after

    results, after = within(10.0, runs)
    assert results == tuple((1, r, 2.0 * n) for r in range(n))
    assert [(r, float(x)) for r, x in after] == [(r, 2.0 * n) for r in range(n)]


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("state", ["no_grad", "inference_mode", "autocast"])
def test_replicas_run_under_the_callers_torch_state(
    mode: str, state: str, replicas: int, torch_module: Any
) -> None:
    del mode
    torch = torch_module
    strategy = cd.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])

    def fn() -> tuple[bool, bool, bool]:
        cd.get_replica_context().all_reduce("sum", torch.ones(2))  # peers run meanwhile
        return (
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cpu"),
        )

    context = {
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
        "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    }[state]
    with context():
        results = strategy.experimental_local_results(strategy.run(fn))
        caller = (
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cpu"),
        )
    assert (
        caller
        == {
            "no_grad": (False, False, False),
            "inference_mode": (False, True, False),
            "autocast": (True, False, True),
        }[state]
    )
    assert results == (caller,) * replicas
    # Outside: a fresh thread's state again, in every replica.
    fresh = ((True, False, False),) * replicas
    assert strategy.experimental_local_results(strategy.run(fn)) == fresh


def _interrupt_main_after(seconds: float) -> None:
    def send() -> None:
        time.sleep(seconds)
        main = threading.main_thread().ident
        assert main is not None
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=send, daemon=True).start()


@pytest.mark.usefixtures("ctrl_c")
def test_the_first_ctrl_c_ends_a_run_whose_replica_is_stuck_in_user_code(mode: str) -> None:
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    unstuck = threading.Event()

    def fn() -> Any:
        ctx = cd.get_replica_context()
        if ctx.replica_id_in_sync_group == 2:
            unstuck.wait(timeout=30)  # stuck in user code
        return ctx.all_reduce("sum", np.float32(1))

    _interrupt_main_after(0.2)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        strategy.run(fn)
    # 0.2 s before the interrupt, then the grace for the stuck replica and one poll; the
    # 2 s of slack for a loaded machine still tell this from the 30 s hang.
    bound = 0.2 + tuning.TUNING.interrupt_grace_seconds + tuning.TUNING.done_poll_seconds + 2.0
    assert time.monotonic() - start < bound
    if mode == "threads":
        # The stuck replica's thread is abandoned: the next run says so, without hanging.
        with pytest.raises(RuntimeError, match=r"replicas \[2\] are still inside the function"):
            strategy.run(lambda: 1)
    unstuck.set()
    result = strategy.run(lambda: cd.get_replica_context().all_reduce("sum", np.float32(1)))
    assert [float(x) for x in strategy.experimental_local_results(result)] == [3.0] * 3
