"""`CallQueue` and the sequencer's use of it: order, errors, context, and other threads.

The queue runs a communicator's queued all-reduces (gradient buckets) on a thread of its
own. What keeps workers in step is that every collective still comes in the caller's
program order: another thread's collective waits for the queue (`Sequencer.hold`).
"""

from __future__ import annotations

import contextvars
import threading
import time
from typing import Any

import pytest

from crossdevice._comm.protocol import Done as _Done  # what a queued call returns
from crossdevice._comm.workers.callqueue import CallQueue
from crossdevice._comm.workers.calls import Standing
from crossdevice._comm.workers.sequence import Sequencer


def _sequencer() -> Sequencer:
    return Sequencer(Standing(0, 1), None, None, lambda err: None, "Test")  # type: ignore[arg-type]


def test_calls_run_in_the_order_they_were_submitted_and_give_their_results() -> None:
    queue = CallQueue()
    order: list[int] = []

    def call(k: int) -> _Done:
        time.sleep(0.01 * (3 - k))  # the first takes longest
        order.append(k)
        return _Done(k)

    queued = [queue.submit(lambda k=k: call(k), 5.0) for k in range(3)]
    assert [q.wait() for q in queued] == [0, 1, 2]
    assert order == [0, 1, 2]
    assert queue.idle
    assert all(q.done() for q in queued)
    queue.stop()


def test_an_error_reaches_the_waiter_as_itself_and_later_calls_still_run() -> None:
    queue = CallQueue()
    error = ValueError("bad bucket")

    def fail() -> Any:
        raise error

    failed = queue.submit(fail, 5.0)
    after = queue.submit(lambda: _Done("after"), 5.0)
    with pytest.raises(ValueError, match="bad bucket") as raised:
        failed.wait()
    assert raised.value is error
    assert after.wait() == "after"
    queue.stop()


def test_a_call_sees_the_context_variables_of_its_submission() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    queue = CallQueue()
    release = threading.Event()
    var.set("at submit")
    queued = queue.submit(lambda: (release.wait(5), _Done(var.get()))[1], 5.0)
    var.set("later")
    release.set()
    assert queued.wait() == "at submit"
    queue.stop()


def test_another_threads_collective_waits_for_the_queued_ones_first() -> None:
    """The caller's program order: what it queued comes before its own next collective."""
    sequencer = _sequencer()
    order: list[str] = []
    release = threading.Event()

    def bucket(name: str) -> _Done:
        release.wait(5)
        sequencer.hold(name)  # as a queued all-reduce holds the communicator
        try:
            order.append(name)
        finally:
            sequencer.lock.release()
        return _Done(name)

    first = sequencer.submit(lambda: bucket("bucket 1"), 5.0)
    second = sequencer.submit(lambda: bucket("bucket 2"), 5.0)
    assert not first.done()
    assert sequencer.hold("abort", blocking=False) is False  # busy: not waited for
    threading.Timer(0.2, release.set).start()
    sequencer.hold("barrier")  # waits for both, then takes the lock
    try:
        order.append("barrier")
    finally:
        sequencer.lock.release()
    assert order == ["bucket 1", "bucket 2", "barrier"]
    assert (first.wait(), second.wait()) == ("bucket 1", "bucket 2")
    assert sequencer.close()
    assert not sequencer.close()  # closed once
    with pytest.raises(RuntimeError, match="closed"):
        sequencer.submit(lambda: _Done(None), 5.0)


def test_a_queued_call_that_outlives_its_bound_is_an_error_not_a_hang() -> None:
    queue = CallQueue()
    release = threading.Event()
    queued = queue.submit(lambda: (release.wait(5), _Done(None))[1], 0.2)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish within 0\.2 s"):
        queued.wait()
    assert time.monotonic() - start < 2.0
    release.set()
    queue.stop()
