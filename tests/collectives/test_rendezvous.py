"""The rendezvous and the thread communicator: one contract, every mode and replica count.

Every test is written once and runs for N in {1, 2, 3, 4, 8} replicas, each replica on
its own thread and as cooperative replicas (greenlets taking turns on one thread), and
checks that both modes end the same way: the same results, the same exception types and
messages in the same replicas. A replica that returns reports it (`finish`), as a
strategy's runner does; a failing replica aborts the rendezvous, as the runner does.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from crossdevice._comm.local.thread import ThreadCommunicator
from crossdevice._core.errors import CollectiveTimeoutError, ReplicaAbortedError
from crossdevice._replica.cooperative import CooperativeScheduler, ReplicaState
from crossdevice._sync.call import CallSignature
from crossdevice._sync.rendezvous import Rendezvous, is_rendezvous_error
from tests.collectives.replicas import run_replicas

COUNTS = (1, 2, 3, 4, 8)
#: Bound on every wait of a test for another replica (the waits themselves take ms).
PROMPT_S = 10.0
MODES = ("threads", "cooperative")

Outcome = list[tuple[str, Any]]


def _run(
    mode: str, rendezvous: Rendezvous, fn: Callable[[int], Any], finish: bool = True
) -> Outcome:
    """`fn(replica)` on every replica in `mode`; per replica ("ok", result) or (type, message)."""
    n = rendezvous.num_replicas

    def replica(r: int) -> Any:
        try:
            return fn(r)
        except ReplicaAbortedError:
            raise
        except BaseException as exc:
            # Disagreements and timeouts reach every replica by themselves.
            if not is_rendezvous_error(exc) and not isinstance(exc, CollectiveTimeoutError):
                rendezvous.abort(exc)
            raise
        finally:
            if finish:
                rendezvous.finish(r)

    if mode == "threads":
        results, errors = run_replicas(n, replica)
    else:
        results = [None] * n
        errors: list[BaseException | None] = [None] * n

        def run_replica(i: int, f: Any, args: Any, kwargs: Any) -> None:
            try:
                results[i] = f(*args, **kwargs)
            except BaseException as exc:
                errors[i] = exc

        scheduler = CooperativeScheduler(n, run_replica, rendezvous.abort)
        jobs = [(i, replica, (i,), {}) for i in range(n)]
        scheduler.run(jobs, [ReplicaState([], [], None) for _ in range(n)])
    rendezvous.reset()
    return [
        ("ok", results[r]) if errors[r] is None else (type(errors[r]).__name__, str(errors[r]))
        for r in range(n)
    ]


def _both(n: int, fn: Callable[[Rendezvous, ThreadCommunicator], Callable[[int], Any]]) -> Outcome:
    """Run in both modes on fresh objects; assert they end the same way; return the outcome."""
    outcomes = []
    for mode in MODES:
        rendezvous = Rendezvous(n, "test")
        comm = ThreadCommunicator(n, "test", rendezvous)
        outcomes.append(_run(mode, rendezvous, fn(rendezvous, comm)))
        # The same objects still work afterwards.
        after = _run(mode, rendezvous, lambda r, c=comm: c.all_reduce(r, [np.float32(r)], "sum")[0])
        assert after == [("ok", sum(range(n)))] * n
    threads, cooperative = outcomes
    assert _comparable(threads) == _comparable(cooperative)
    return threads


def _comparable(outcome: Outcome) -> list[tuple[str, Any]]:
    return [
        (kind, value.tolist() if hasattr(value, "tolist") else _without_report(value))
        for kind, value in outcome
    ]


def _without_report(value: Any) -> Any:
    """A message without its flight-recorder note (each mode's report has its own file)."""
    return (
        re.sub(r" Flight recorder.*\Z", "", value, flags=re.S) if isinstance(value, str) else value
    )


@pytest.mark.parametrize("n", COUNTS)
def test_merge_call_runs_merge_once_with_every_input_in_replica_order(n: int) -> None:
    calls: list[list[Any]] = []

    def make(rv: Rendezvous, comm: ThreadCommunicator) -> Callable[[int], Any]:
        def merge(inputs: list[Any]) -> list[Any]:
            calls.append(inputs)
            return [f"out{r}" for r in range(n)]

        return lambda r: rv.merge_call(r, merge, r * 10)

    outcome = _both(n, make)
    assert outcome == [("ok", f"out{r}") for r in range(n)]
    assert calls == [[r * 10 for r in range(n)]] * 2  # once per mode


@pytest.mark.parametrize("n", COUNTS)
def test_merge_calls_and_collectives_interleave_in_one_order(n: int) -> None:
    def make(rv: Rendezvous, comm: ThreadCommunicator) -> Callable[[int], Any]:
        def replica(r: int) -> Any:
            a = comm.all_reduce(r, [np.full(3, r, np.float32)], "sum")[0]
            m = rv.merge_call(r, lambda inputs: [sum(inputs)] * n, r)
            g = comm.all_gather(r, np.array([r]), axis=0)
            return float(a[0]), m, g.tolist()

        return replica

    total = float(sum(range(n)))
    assert _both(n, make) == [("ok", (total, total, list(range(n))))] * n


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_different_calls_fail_in_every_replica_naming_each_call(n: int) -> None:
    def make(rv: Rendezvous, comm: ThreadCommunicator) -> Callable[[int], Any]:
        def replica(r: int) -> Any:
            if r == n - 1:
                return rv.merge_call(r, lambda inputs: inputs, r)
            return comm.all_reduce(r, [np.ones(3, np.float32)], "sum")

        return replica

    outcome = _both(n, make)
    calls = "; ".join(
        [f"replica {r}: all_reduce(SUM, float32[3]) #0" for r in range(n - 1)]
        + [f"replica {n - 1}: merge_call #0"]
    )
    assert all(kind == "RuntimeError" and calls in message for kind, message in outcome)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_merge_calls_that_disagree_fail_in_every_replica(n: int) -> None:
    def make(rv: Rendezvous, comm: ThreadCommunicator) -> Callable[[int], Any]:
        def replica(r: int) -> Any:
            op = "MEAN" if r == n - 1 else "SUM"
            call = CallSignature("all_reduce", op, leaves=(((3,), "float32"),))
            return rv.merge_call(r, lambda inputs: inputs, r, call)

        return replica

    outcome = _both(n, make)
    assert all(kind == "ValueError" for kind, _ in outcome)
    assert f"replica {n - 1}: all_reduce(MEAN, float32[3]) #0" in outcome[0][1]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_a_replica_that_returns_while_others_wait_fails_them_at_once(n: int) -> None:
    def make(rv: Rendezvous, comm: ThreadCommunicator) -> Callable[[int], Any]:
        def replica(r: int) -> Any:
            if r == 0:
                return "returned"
            return comm.all_reduce(r, [np.ones(2)], "sum")

        return replica

    outcome = _both(n, make)
    assert outcome[0] == ("ok", "returned")
    for kind, message in outcome[1:]:
        assert kind == "RuntimeError"
        assert f"replicas [0] returned while replicas {list(range(1, n))} wait" in message


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_a_failing_replica_releases_every_waiter(n: int) -> None:
    def make(rv: Rendezvous, comm: ThreadCommunicator) -> Callable[[int], Any]:
        def replica(r: int) -> Any:
            if r == n - 1:
                raise KeyError("boom")
            return rv.merge_call(r, lambda inputs: inputs, r)

        return replica

    outcome = _both(n, make)
    assert outcome[n - 1] == ("KeyError", "'boom'")
    assert all(kind == "ReplicaAbortedError" for kind, _ in outcome[:-1])


@pytest.mark.parametrize("n", [2, 3])
def test_a_peer_that_never_comes_times_out_naming_it(n: int) -> None:
    """Without `finish` (a communicator used on its own), a timeout bounds the wait."""
    outcomes = []
    for mode in MODES:
        rendezvous = Rendezvous(n, "test")

        def replica(r: int, rv: Rendezvous = rendezvous) -> Any:
            if r == n - 1:
                return None  # never arrives, never says so
            return rv.merge_call(r, lambda inputs: inputs, r, timeout=0.2)

        outcomes.append(_run(mode, rendezvous, replica, finish=False))
    assert outcomes[0] == outcomes[1]
    kind, message = outcomes[0][0]
    assert kind == "CollectiveTimeoutError", message
    assert f"merge_call #0 timed out after 0.2 s: replicas [{n - 1}] did not arrive" in message


@pytest.mark.parametrize("n", COUNTS)
def test_many_rounds_back_to_back_complete_with_replica_zero_woken_last(n: int) -> None:
    """Replica 0 is woken after its peers left each round; rounds follow at once."""

    def make(rv: Rendezvous, comm: ThreadCommunicator) -> Callable[[int], Any]:
        def replica(r: int) -> Any:
            totals = []
            for step in range(50):
                x = comm.all_reduce(r, [np.float32(r + step)], "sum")[0]
                y = rv.merge_call(r, lambda inputs: [sum(inputs)] * n, r)
                totals.append((float(x), y))
            return totals

        return replica

    expected = [(float(sum(range(n)) + n * step), sum(range(n))) for step in range(50)]
    assert _both(n, make) == [("ok", expected)] * n


@pytest.mark.parametrize("n", [3, 4, 8])
def test_cooperative_replica_zero_resumes_after_its_peers_left_the_round(n: int) -> None:
    """The caller's replica goes last after a round: it would otherwise wait again at the end."""
    order: list[int] = []
    rendezvous = Rendezvous(n, "test")
    comm = ThreadCommunicator(n, "test", rendezvous)

    def replica(r: int) -> Any:
        out = comm.all_reduce(r, [np.float32(1.0)], "sum")[0]
        order.append(r)
        return float(out)

    assert _run("cooperative", rendezvous, replica) == [("ok", float(n))] * n
    # The last arriver (n - 1) goes on at once, the others in turn, replica 0 last.
    assert order == [n - 1, *range(1, n - 1), 0]


@pytest.mark.parametrize("n", [3, 4, 8])
def test_an_abort_after_a_round_releases_replica_zero_held_back(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica 0, held back until its peers leave a round, is woken by an abort too.

    Replica 1 is kept from leaving the round (its `_leave` waits to be let go), so only
    the abort that the last arriver makes can wake replica 0 before replica 1 leaves.
    Replica threads only: a cooperative replica kept waiting would stop every replica.
    """
    rendezvous = Rendezvous(n, "test")
    comm = ThreadCommunicator(n, "test", rendezvous)
    let_go, zero_out = threading.Event(), threading.Event()
    leave = rendezvous._leave

    def held_leave(rnd: Any) -> None:
        if threading.current_thread().name == "test-replica-1":
            let_go.wait(PROMPT_S)
        leave(rnd)

    monkeypatch.setattr(rendezvous, "_leave", held_leave)

    def replica(r: int) -> Any:
        if r == n - 1:  # the last to arrive: every other replica, 0 included, sleeps
            _wait_for(lambda: rendezvous._round.count == n - 1)
        out = float(comm.all_reduce(r, [np.float32(r)], "sum")[0])
        if r == 0:
            zero_out.set()
        if r == n - 1:
            rendezvous.abort(RuntimeError("stop"))
            woken = zero_out.wait(PROMPT_S)  # while replica 1 still has not left
            let_go.set()
            return out, woken
        return out

    outcome = _run("threads", rendezvous, replica)
    total = float(sum(range(n)))
    # Every replica had its result when the abort came: it changes nothing for them.
    assert outcome == [("ok", total)] * (n - 1) + [("ok", (total, True))]


def _wait_for(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + PROMPT_S
    while not predicate():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.001)


@pytest.mark.parametrize("mode", MODES)
def test_rounds_with_a_timeout_complete_with_replica_zero_held_back(mode: str) -> None:
    """Replica 0 held back sleeps with its deadline (a timed wait) and still gets its result."""
    n = 3
    rendezvous = Rendezvous(n, "test")
    comm = ThreadCommunicator(n, "test", rendezvous)

    def replica(r: int) -> Any:
        return float(comm.all_reduce(r, [np.float32(r)], "sum", timeout=5)[0])

    assert _run(mode, rendezvous, replica) == [("ok", 3.0)] * n
