"""A cross-worker collective from a thread beside the run in flight: refused, never mispaired.

The bug hunt: each of two workers ran a step on its main thread while a monitoring thread
reduced a metric through the same helper the step's merge_fn used (one call site, so
every fingerprint matched). Timing put the monitor's collective inside the run on one
worker and after it on the other: each worker's sum paired the other's wrong call, 101
where 200 and 2 were due, silently, on both. Inside a run, a collective from a thread
that is not the run's (its caller, its replicas, the communicator's queue) is now
refused at once and the group ended; just before a run on one worker and just after it
on another, the fingerprints differ (inside a run or not): a mismatch on every worker.
Between runs, in an order the program fixes, a second thread's collectives still work.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import crossdevice as cd
from crossdevice._comm.workers.calls import Standing
from crossdevice._comm.workers.sequence import IN_RUN, Sequencer
from crossdevice._core import purpose
from crossdevice._core.purpose import purpose as described
from crossdevice._strategies.worker_runs import one_thread_runs
from tests.helpers import within
from tests.multi_worker.beside_runs_workers import beside, between
from tests.multi_worker.harness import run_workers

#: Every public entry point found to make a cross-worker collective outside `run`, and
#: the collective each makes first. (`experimental_local_results` makes none.)
ENTRIES = {
    "reduce": "all_reduce",
    "gather": "all_gather",
    "sync_on_read": "all_reduce (reading SyncOnReadVariable",
    "batch_reduce_to": "all_reduce",
    "reduce_to": "all_reduce",
    "variable": "broadcast",
    "checkpoint": "all_reduce (reading SyncOnReadVariable",
    "dataset": "has_data (next(iterator) of a distributed dataset",
    "prepare": "all_reduce",
}
#: What the monitor's call gives between runs (first element; two workers' values of 100).
BETWEEN = {
    "helper": 200.0,
    "reduce": 200.0,
    "gather": 100.0,
    "sync_on_read": 200.0,
    "batch_reduce_to": 200.0,
    "reduce_to": 200.0,
    "variable": 100.0,  # the chief's value, on every worker
    "checkpoint": 1.0,  # saved
    "dataset": 100.0,
    "prepare": 1.0,  # the chief's weight, on every worker
}
_REFUSED = "while a run of strategy.run from thread 'MainThread' is in flight on this worker"


def _error(value: Any, kind: str, *parts: str) -> str:
    assert isinstance(value, tuple), f"a value where {kind} was due: {value!r}"
    assert value[0] == kind, value
    for part in parts:
        assert part in value[1], (part, value[1])
    return str(value[1])


#: A few entries per pair of processes: an ended group's connections stay open (its
#: peers may still be reading), and a process that had ended 7 stalled 5 s, or failed,
#: connecting its next strategy's health store.
_CHUNKS = [list(ENTRIES)[i : i + 3] for i in range(0, len(ENTRIES), 3)]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("entries", _CHUNKS, ids=["-".join(c) for c in _CHUNKS])
def test_a_collective_beside_the_run_in_flight_is_refused_at_once_on_every_worker(
    entries: list[str],
) -> None:
    cases = [(entry, "during") for entry in entries]
    begin = time.monotonic()
    outs = [r.unwrap() for r in run_workers(beside, 2, args=(cases,), timeout=60)]
    for out in outs:
        for entry in entries:
            collective = ENTRIES[entry]
            case = out[f"{entry}/during"]
            _error(
                case["monitor"],
                "RuntimeError",
                f"thread 'monitor' issued a cross-worker collective, {collective}",
                _REFUSED,
                "Issue it between runs",
                "ReplicaContext.all_reduce, merge_call",
            )
            assert case["monitor_seconds"] < 1.0, case  # at once, not a timeout
            # The run pairs with nothing by timing: the group is ended, it says why.
            _error(case["run"], "RuntimeError", "collectives are broken", _REFUSED)
            _error(case["after"], "RuntimeError", "collectives are broken")
    assert time.monotonic() - begin < 45


@pytest.mark.multiprocess
@pytest.mark.slow
def test_timing_that_puts_it_on_either_side_of_a_run_is_an_error_not_a_wrong_sum() -> None:
    # The monitor reduces through the step's own helper: every fingerprint field but the
    # run's mark matches (before the fix: 101 on both workers, both times).
    cases = [("helper", "crossed"), ("reduce", "crossed"), ("helper", "before")]
    cases.append(("helper", "held"))
    rank0, rank1 = (r.unwrap() for r in run_workers(beside, 2, args=(cases,), timeout=120))
    for entry in ("helper", "reduce"):
        # Inside the run on rank 0: refused there; rank 1, whose run waited for rank 0's
        # all-reduce, is told why rather than left to pair it with its monitor's.
        _error(rank0[f"{entry}/crossed"]["monitor"], "RuntimeError", _REFUSED)
        told = rank1[f"{entry}/crossed"]
        _error(told["run"], "WorkerFailedError", "rank 0", _REFUSED)
        _error(told["monitor"], "RuntimeError", "collectives are broken")
    # Before the run on rank 0, after it on rank 1: neither is inside a run when issued,
    # and the fingerprints tell them from the runs' all-reduces.
    mismatch = ("CollectiveMismatchError", "fields that differ: state")
    for out in (rank0, rank1):
        case = out["helper/before"]
        _error(case["monitor"], *mismatch, "issued outside any strategy.run")
        _error(case["run"], *mismatch, "issued inside strategy.run")
    # Still waiting for its peers when rank 0's run makes its all-reduce: that is
    # refused, naming the monitor; rank 1 pairs nothing with it.
    held = rank0["helper/held"]
    _error(held["run"], "RuntimeError", "thread 'MainThread'", "thread 'monitor' is in one")
    _error(held["monitor"], *mismatch)
    assert not isinstance(rank1["helper/held"]["run"], float), rank1["helper/held"]
    assert not isinstance(rank1["helper/held"]["monitor"], float), rank1["helper/held"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_second_threads_collectives_between_runs_still_work() -> None:
    # One strategy for all: a monitor's collectives between runs, step after step.
    outs = [r.unwrap() for r in run_workers(between, 2, args=(list(BETWEEN),), timeout=60)]
    for out in outs:
        for entry, due in BETWEEN.items():
            case = out[entry]
            assert case["run"] == 2.0, (entry, case)
            assert case["monitor"] == due, (entry, case)
            assert case["after"] == 2.0, (entry, case)


# --- the sequencer's part, in one process --------------------------------------------------


class _Board:
    reached = 0


def _sequencer(runs: Any) -> tuple[Sequencer, list[BaseException]]:
    aborted: list[BaseException] = []
    sequencer = Sequencer(Standing(0, 2), _Board(), None, aborted.append, "FakeCommunicator")  # type: ignore[arg-type]
    sequencer.runs = runs
    return sequencer, aborted


class _Ready:
    """What a queued call returns: something to `wait()` for (here, already there)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def wait(self) -> Any:
        return self.value


def _state(sequencer: Sequencer) -> tuple[int, str]:
    with sequencer.collective("all_reduce", 5.0) as call:
        assert call.state_text is not None
        return call.state, call.state_text()


def test_the_runs_collectives_carry_the_mark_and_others_do_not() -> None:
    asked: list[str] = []

    def runs(collective: str) -> bool:
        asked.append(collective)
        return inside

    sequencer, aborted = _sequencer(runs)
    inside = True
    assert _state(sequencer) == (
        IN_RUN,
        "issued inside strategy.run",
    )
    with purpose.agreeing(12345, lambda: "the optimizer's state"):
        state, text = _state(sequencer)
    assert state == 12345 ^ IN_RUN
    assert text == "the optimizer's state; issued inside strategy.run", text
    inside = False
    state, text = _state(sequencer)
    assert state == 0
    assert text.startswith("issued outside any strategy.run"), text
    _state(sequencer)
    assert asked == ["all_reduce"] * 4
    assert sequencer.seq == 4
    assert aborted == []


def test_a_refused_collective_tells_the_peers_and_takes_no_number() -> None:
    sequencer, aborted = _sequencer(lambda collective: f"refused: {collective}")
    with pytest.raises(RuntimeError, match=r"^refused: all_reduce$") as info:
        _state(sequencer)
    assert aborted == [info.value]
    assert sequencer.seq == 0
    assert not sequencer.lock.locked()
    with pytest.raises(RuntimeError, match="refused: a queued all_reduce"):
        sequencer.submit(lambda: None, 5.0)
    assert len(aborted) == 2


def test_a_queued_call_carries_its_submitters_mark() -> None:
    # The queue's thread is the communicator's own: never asked, never refused; its call
    # carries the mark of the thread that queued it, whenever it runs.
    mine: dict[int, bool] = {}

    def runs(collective: str) -> bool | str:
        ident = threading.get_ident()
        return mine.get(ident, f"asked on a foreign thread for {collective}")

    sequencer, aborted = _sequencer(runs)
    mine[threading.get_ident()] = True
    inside = sequencer.submit(lambda: _Ready(_state(sequencer)), 5.0)
    mine[threading.get_ident()] = False
    outside = sequencer.submit(lambda: _Ready(_state(sequencer)), 5.0)
    assert within(10, inside.wait)[0] == IN_RUN
    assert within(10, outside.wait)[0] == 0
    assert aborted == []
    sequencer.close()


class _Communicator:
    """What `one_thread_runs` needs of a communicator: its sequencer."""

    def __init__(self) -> None:
        self._sequencer = type("S", (), {"runs": None})()


def test_the_run_in_flight_owns_its_caller_its_replicas_and_a_nested_run() -> None:
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    communicator = _Communicator()
    one_thread_runs(strategy.extended._get_runner(), communicator)  # type: ignore[attr-defined]
    member = communicator._sequencer.runs
    assert member("all_reduce") is False  # no run in flight: any thread
    seen: dict[str, Any] = {}
    started, tried = threading.Event(), threading.Event()

    def other() -> None:
        started.wait(10)
        with described("a metric"):
            seen["other"] = member("all_reduce")
        tried.set()

    def step() -> None:
        context = cd.get_replica_context()
        seen[f"replica{context.replica_id_in_sync_group}"] = member("all_reduce")
        if context.replica_id_in_sync_group == 0:
            started.set()
            tried.wait(10)

        def merge_fn(s: Any) -> None:
            seen["merge"] = member("all_reduce")
            s.run(lambda: seen.setdefault("nested", member("all_reduce")))

        context.merge_call(merge_fn)

    thread = threading.Thread(target=other, name="monitor")
    thread.start()
    strategy.run(step)  # (bounded: the waits inside are)
    thread.join(10)
    assert seen["replica0"] is True  # the caller's thread
    assert seen["replica1"] is True  # a replica thread
    assert seen["merge"] is True
    assert seen["nested"] is True
    assert isinstance(seen["other"], str)
    assert (
        "thread 'monitor' issued a cross-worker collective, all_reduce (a metric)" in seen["other"]
    )
    assert "from thread 'MainThread' is in flight" in seen["other"]
    assert member("all_reduce") is False  # the run ended
    strategy.close()
