"""`CallQueue`: a communicator's all-reduces issued, in order, on a thread of its own.

A gradient bucket's all-reduce is issued from a backward hook. The communicator keeps
one all-reduce in flight (`sequence.py`), so issuing bucket k+1 first completes bucket
k: on the caller's thread, that stalls the rest of backward for bucket k's round trip,
and packing and sending a large bucket holds it up too. DDP queues its buckets on
Gloo's threads instead. Queued here, each bucket's issue (its packing, its sends, and
the completion of the bucket before it) runs on the queue's one thread, in the order the
caller submitted them, while the caller's backward goes on. Nothing about the protocol
changes: the same collectives, in the same order, one in flight.

The order of collectives must be the caller's program order on every worker, never a
matter of timing. So any collective from another thread first waits for the queue to
empty (`drain`, from `Sequencer.hold`): a collective the caller issues after submitting
buckets comes after them on every worker. Errors of a queued call are its own: they
reach whoever waits for its result (`Queued.wait`), as themselves.

A queued call may wait for data another thread is still producing (a backward pass's
buckets, filled as they complete: `awaiting`); that thread must then not wait for the
queue: its `drain` raises at once instead of waiting for a call that waits for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["CallQueue", "Queued"]


class Queued:
    """A call submitted to a `CallQueue`: `wait()` waits for it, then for what it returned.

    The call returns a pending collective (`wait()` and `done()`); so does this.
    """

    __slots__ = ("_done", "_error", "_queue", "_result")

    def __init__(self, queue: CallQueue) -> None:
        self._queue = queue
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether `wait` would return at once: nothing is queued or running any more."""
        return self._queue.idle and (self._error is not None or self._result.done())

    def wait(self) -> Any:
        """The collective's result; raises what the call or the collective raised.

        Waits for the whole queue first: a later call completes this one's collective
        (issuing the next all-reduce completes the one in flight), on the queue's thread.
        """
        self._queue.drain()
        if self._error is not None:
            raise self._error
        return self._result.wait()


class CallQueue:
    """One thread that runs submitted calls in order (started on first use)."""

    def __init__(self) -> None:
        self._calls: list[tuple[Callable[[], Any], contextvars.Context, Queued, float]] = []
        self._busy = 0  # submitted and not finished
        self._bounds = 0.0  # the seconds those may take in all
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        #: (the thread a running call may wait for, why, whether it does) (`awaiting`).
        self._awaited: tuple[threading.Thread, str, Callable[[], bool]] | None = None

    def on_thread(self) -> bool:
        """Whether the caller is the queue's own thread."""
        return threading.current_thread() is self._thread

    @property
    def idle(self) -> bool:
        """Whether nothing is queued or running."""
        return self._busy == 0

    def submit(self, call: Callable[[], Any], bound: float) -> Queued:
        """Run `call()` on the queue's thread after every call submitted before it.

        It runs in a copy of the caller's context variables (`contextvars`), as of now.
        `bound`: the longest it may take (its collective's timeout, and slack).
        """
        queued = Queued(self)
        with self._cond:
            if self._stopped:
                raise RuntimeError("the communicator is closed: nothing can be queued on it")
            self._calls.append((call, contextvars.copy_context(), queued, bound))
            self._busy += 1
            self._bounds += bound
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="crossdevice-queue", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        return queued

    def drain(self) -> None:
        """Wait until every submitted call finished (their errors stay theirs).

        Raises:
            TimeoutError: a call did not finish within its bound (its collective's
                own timeout failed to end it: a bug, reported rather than waited on).
            RuntimeError: the running call waits for this thread's data (`awaiting`).
        """
        if self.on_thread():
            return
        me = threading.current_thread()

        def over() -> bool:
            awaited = self._awaited
            return not self._busy or (awaited is not None and awaited[0] is me and awaited[2]())

        with self._cond:
            if self._busy and not self._cond.wait_for(over, self._bounds):
                raise TimeoutError(
                    f"{self._busy} queued collective call(s) did not finish within "
                    f"{self._bounds:g} s, the bound of their collectives' timeouts: the "
                    "communicator cannot be used; build a new strategy on every worker"
                )
            if self._busy and self._awaited is not None:
                raise RuntimeError(self._awaited[1])

    @contextlib.contextmanager
    def awaiting(
        self, thread: threading.Thread, why: str, missing: Callable[[], bool]
    ) -> Iterator[None]:
        """Inside, the running call may wait for data that `thread` produces.

        While `missing()` says it does, a `drain` from `thread` raises
        RuntimeError(`why`) at once. `why`: what waits for what, and what to do.
        """
        with self._cond:
            self._awaited = (thread, why, missing)
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._awaited = None

    def stop(self) -> None:
        """End the thread once the calls queued so far ran, without waiting for them.

        Later submits fail; calls still queued run against a closed communicator and fail.
        """
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._calls and not self._stopped:
                    self._cond.wait()
                if not self._calls:
                    return
                call, context, queued, bound = self._calls.pop(0)
            try:
                queued._result = context.run(call)
            except BaseException as err:  # the waiter's to raise, as itself
                queued._error = err
            finally:
                with self._cond:
                    queued._done = True
                    self._busy -= 1
                    self._bounds -= bound
                    self._cond.notify_all()
