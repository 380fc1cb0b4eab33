"""`Sequencer`: a worker communicator's collectives, numbered, one at a time, ended cleanly.

Every worker must run the same collectives in the same order; the sequencer numbers them
(the number is in every fingerprint), holds the communicator for one at a time (a second
thread gets an error, not an interleaving), lets at most one all-reduce be in flight
(`Pending`: any collective issued before its `wait` completes it first), runs the calls
queued on it (`submit`: `callqueue.py`) before any other thread's collective, and turns
what ends a collective badly into the error its caller gets (`guard`):

* a failed wait (timeout, failed peers, a broken link): an error naming the ranks at
  fault, and the communicator is broken; what the peers could not learn otherwise is
  told (`tell`): this worker's own timeout, at once (a late peer must raise naming it,
  never sum with what it left), and a failure no peer caused;
* the caller's `fill` raising, or anything else that leaves the peers waiting: the peers
  are told (`abort`), and the error surfaces as itself;
* errors every worker raises alike (mismatches, bad arguments): as they are.

A collective from a thread that is not the run in flight's (`runs`, set by the strategy:
`_strategies/worker_runs.py`) is refused at once, and the peers are told: it would take
a place in this worker's order that the peers fill with one of the run's collectives.
Every collective's fingerprint also says whether it belongs to a run (`IN_RUN`, in its
state), so one issued just before a run on one worker and just after it on another
cannot pair with one of the run's: a mismatch on every worker, not a wrong sum.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from crossdevice._comm.workers.callqueue import CallQueue, Queued
from crossdevice._comm.workers.calls import Call, Standing, WaitFailedError, timed_out
from crossdevice._comm.workers.flight import sequencer_group
from crossdevice._comm.workers.groups import Groups
from crossdevice._comm.workers.health import HealthBoard
from crossdevice._core import purpose
from crossdevice._core.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    WorkerFailedError,
)
from crossdevice._trace import flight as _flight
from crossdevice._trace import state as _trace

__all__ = ["IN_RUN", "FillFailedError", "Pending", "Sequencer", "guarded_fill"]

#: Errors every worker raises alike, before any data moves (or after every worker saw
#: the same thing): nothing to tell the peers.
_ALIKE = (CollectiveMismatchError, WorkerFailedError, CollectiveTimeoutError, ValueError, TypeError)
#: Collective failures that write a flight-recorder report (`crossdevice._trace.flight`).
_REPORTED = (CollectiveMismatchError, WorkerFailedError, CollectiveTimeoutError, KeyboardInterrupt)
#: Flipped in a collective's state (`Call.state`, in its fingerprint) when it belongs to
#: the run in flight (`purpose.agreeing`'s 63-bit digests keep their meaning: two that
#: differ still differ).
IN_RUN: Final = 1 << 62


class FillFailedError(Exception):
    """Internal: the caller's `fill` raised while a collective was moving data."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(repr(error))
        self.error = error


class Sequencer:
    """Numbering, exclusion, the all-reduce in flight and failure handling of a communicator.

    Args:
        standing: the communicator's shared state (broken, rank, replica counts).
        health: its health board (arrival marks, diagnosis).
        groups: its process groups (kept alive, unregistered, when a wait fails).
        abort: tells the peers that this worker quits (the communicator's `abort`).
        name: the communicator's class name, for messages.
    """

    def __init__(
        self,
        standing: Standing,
        health: HealthBoard,
        groups: Groups,
        abort: Callable[[BaseException], None],
        name: str,
    ) -> None:
        self.seq = 0
        self.closed = False
        self.lock = threading.Lock()
        self.pending: Pending | None = None
        #: The calls queued on this communicator (`submit`), made on first use.
        self.queue: CallQueue | None = None
        self._standing = standing
        self._health = health
        self._groups = groups
        self._abort = abort
        self._name = name
        #: Marks this worker gone from shared memory's rounds, and why (`tell`), if any.
        self.poison: Callable[[str], None] | None = None
        #: Per thread: collectives it held itself (not the queue's; `held_here`).
        self._here = threading.local()
        #: Asked before each collective, with its name, on the calling thread: True, it
        #: belongs to the run in flight; False, no run is in flight; a str, a run is in
        #: flight and this thread is not its: the refusal's message. None: no runs
        #: (`_strategies/worker_runs.py` sets it).
        self.runs: Callable[[str], bool | str] | None = None
        #: On the queue's thread: whether the call it runs was submitted in a run.
        self._queued = threading.local()
        #: The thread that last took the lock (named when another is refused: `hold`).
        self._holder: threading.Thread | None = None
        #: A state the next numbered collective carries besides its own (`ended`).
        self._carried: purpose.State | None = None
        #: The last collectives' `Call`s: the flight recorder (`crossdevice._trace`).
        self.history: collections.deque[Call] = collections.deque(maxlen=_flight.COLLECTIVES)
        _flight.register(self, sequencer_group)

    def collective(self, name: str, timeout: float) -> _Held:
        """Number a collective, publish this worker's arrival at it, hold it exclusively.

        Use as `with sequencer.collective(name, timeout) as call:`; the lock is held
        until the block ends. The all-reduce in flight, if any, completes first.
        `timeout` bounds it.
        """
        if self.closed:
            raise RuntimeError(
                f"{name}: this {self._name} is closed; create a new one (on every worker)"
            )
        if self._standing.broken is not None:
            raise RuntimeError(
                f"{name}: this worker's collectives are broken ({self._standing.broken}); "
                "nothing can pair up with the other workers any more: build a new strategy "
                "(or communicator) on every worker"
            )
        in_run = self._admit(name)
        self.hold(name)
        try:
            self.settle()
            self.seq += 1
            self._health.reached = self.seq  # published by the board's thread
            value, text = purpose.state()
            carried, self._carried = self._carried, None
            if carried is not None:  # (a skipped has-data agreement's: `ended`)
                value, text = value ^ carried[0], _joined(carried[1], text)
            if in_run:
                value ^= IN_RUN
            text = _run_text(in_run, text)
            call = Call(
                name,
                self.seq,
                timeout,
                time.monotonic(),
                purpose=purpose.current(),
                state=value,
                state_text=text,
            )
            self.history.append(call)
            if _trace.on:
                _trace.worker_issued(self, call)
        except BaseException:
            self.lock.release()
            raise
        return _Held(self.lock, call)

    def submit(self, call: Callable[[], Any], bound: float) -> Queued:
        """Queue `call` (it issues a collective) to run after the calls queued before it.

        Any collective from another thread first waits for the queue (`hold`), so the
        collectives keep the caller's order. `bound`: the seconds `call` may take.
        """
        if self.closed:
            raise RuntimeError(f"this {self._name} is closed: nothing can be queued on it")
        in_run = self._admit("a queued all_reduce")  # the submitter's, not the queue's
        if self.queue is None:
            self.queue = CallQueue()
        queued = self._queued

        def marked() -> Any:
            queued.in_run = in_run
            try:
                return call()
            finally:
                queued.in_run = False

        return self.queue.submit(marked, bound)

    def _admit(self, name: str) -> bool:
        """Whether the calling thread's collective `name` belongs to the run in flight.

        The queue's thread runs calls for their submitters (`submit` asked for them).
        Raises RuntimeError, once the peers are told, for a collective from a thread
        that is not the run in flight's (`runs`).
        """
        queue = self.queue
        if queue is not None and queue.on_thread():
            return bool(getattr(self._queued, "in_run", False))
        runs = self.runs
        if runs is None:
            return False
        verdict = runs(name)
        if isinstance(verdict, bool):
            return verdict
        # Its place in this worker's order stays empty: peers that made this collective
        # (or will) must not wait for it, nor pair it with the next one (`abort`).
        error = RuntimeError(verdict)
        self._abort(error)
        raise error

    def close(self) -> bool:
        """Refuse collectives from now on and end the queue's thread; False if closed."""
        if self.closed:
            return False
        self.closed = True
        if self.queue is not None:
            self.queue.stop()
        return True

    def hold(self, name: str, blocking: bool = True) -> bool:
        """Take the communicator's lock, or say why another thread holds it.

        The calls queued by this thread run first (`submit`). With `blocking=False`, a
        lock another thread holds is not waited for: False (`abort`, best effort).
        """
        queue = self.queue
        caller = queue is None or not queue.on_thread()  # not one of the queued calls
        if caller and queue is not None and not queue.idle:
            if not blocking:
                return False
            queue.drain()
        if blocking and caller:
            self._here.count = getattr(self._here, "count", 0) + 1
        if not blocking:
            return bool(self.lock.acquire(blocking=False))
        if not self.lock.acquire(blocking=False):
            holder = self._holder
            raise RuntimeError(
                f"{name}: thread {threading.current_thread().name!r} issued a collective "
                f"while thread {holder.name if holder else 'another thread'!r} is in one on "
                "this communicator; expected one at a time, from the thread that runs the "
                "steps (or a run's replicas), in the same order on every worker. Issue "
                "collectives from one thread, or hand them from thread to thread in an "
                "order the program fixes (a lock alone does not: it orders by timing)"
            )
        self._holder = threading.current_thread()
        return True

    def held_here(self) -> int:
        """How many collectives the calling thread has started itself (not queued ones)."""
        return int(getattr(self._here, "count", 0))

    def settle(self, pending: Pending | None = None) -> None:
        """Complete the all-reduce in flight (the lock is held), if it is `pending` or any."""
        current = self.pending
        if current is not None and (pending is None or pending is current):
            self.pending = None
            current.complete()

    def guard(self, call: Call, run: Callable[[], Any]) -> Any:
        """Run a collective's work; turn what ends it badly into the error the caller gets."""
        try:
            result = run()
        except WaitFailedError as err:
            standing = self._standing
            standing.broken = f"{call.label} failed"
            # This worker gives up the collective. Its peers may still come: they must
            # raise naming it, not pair with what it left (its shared-memory slots of a
            # round it arrived at; on Gloo a closed connection, which says nothing).
            own_timeout = isinstance(err.cause, TimeoutError)
            if own_timeout:  # said at once: a late peer may be arriving now
                self.tell(timed_out(call))
            failure = self._health.diagnose(call, err.cause, standing)
            if not own_timeout:
                # Failed peers told theirs (an abort record, `give_up`'s, an exit): only
                # the mark, then. A failure no peer is known to have caused is this one's.
                failed = isinstance(failure, WorkerFailedError)
                self.tell(None if failed else f"{type(failure).__name__}: {failure}")
            self._groups.destroy(keep_alive=True)
            self._report(call, failure)
            raise failure from failure.__cause__
        except FillFailedError as err:
            self._abort(err.error)
            raise err.error from None
        except _ALIKE as err:
            if isinstance(err, _REPORTED):
                self._report(call, err)
            raise
        except BaseException as err:
            if isinstance(err, _REPORTED):
                self._report(call, err)
            self._abort(err)
            raise
        call.ended = time.monotonic()
        if _trace.on:
            _trace.worker_ended(self, call)
        return result

    def tell(self, reason: str | None) -> None:
        """Leave the marks that tell the peers this worker quit, and why (`reason`).

        The store's abort record (`HealthBoard.post_abort`), then the poison mark of
        shared memory's rounds, where peers waiting in (or reaching) one raise; it keeps
        `reason` too, for when the store is gone with its host. None: the mark alone (the
        peers learn why elsewhere).
        """
        if reason is not None:
            self._health.post_abort(reason)
        if self.poison is not None:
            self.poison(reason or "")

    def ended(self, call: Call, carry: purpose.State | None = None) -> None:
        """`call` ended with nothing to run (a collective every worker skips alike).

        `carry`: a state (`purpose.agreeing`'s value and words) that the next numbered
        collective carries besides its own, XORed into its value: what the skipped call
        would have compared (a step's global batch digest: `has_data.carried_state`).
        """
        self._carried = carry
        call.ended = time.monotonic()
        if _trace.on:
            _trace.worker_ended(self, call)

    def _report(self, call: Call, error: BaseException) -> None:
        """Write a flight-recorder report of `error`, which ended `call` (it did not end)."""
        call.ended = 0.0
        _flight.attach(error, tag=f"-rank{self._standing.rank}", source=self)


def _joined(first: Callable[[], str] | None, then: Callable[[], str] | None) -> Callable[[], str]:
    """Two states' words, `first`'s first (a worker's detail is cut at `fp.DETAIL_BYTES`)."""
    return lambda: "; ".join(f() for f in (first, then) if f is not None)


def _run_text(in_run: bool, text: Callable[[], str] | None) -> Callable[[], str]:
    """A call's state in words (`Call.state_text`): `text`'s, then whether it is a run's.

    Last and short: a worker's detail has `fp.DETAIL_BYTES`, and `text` says more.
    """

    def described() -> str:
        where = (
            "issued inside strategy.run"
            if in_run
            else "issued outside any strategy.run (from a thread beside the steps it meets "
            "their collectives by timing: make it from the steps' thread)"
        )
        return f"{text()}; {where}" if text is not None else where

    return described


class _Held:
    """A numbered collective's hold on the sequencer: `with` gives its `Call`, then lets go.

    (A class rather than a generator context manager: it runs on every collective.)
    """

    __slots__ = ("_call", "_lock")

    def __init__(self, lock: threading.Lock, call: Call) -> None:
        self._lock = lock
        self._call = call

    def __enter__(self) -> Call:
        return self._call

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class Pending:
    """A collective in flight (`ProcessGroupCommunicator.all_reduce_async`, `any_has_data_async`).

    `wait()` returns the reduced values, or raises what ended the all-reduce (each time
    it is asked); `done()` says whether it completed.
    """

    __slots__ = ("_call", "_error", "_finish", "_results", "_sequencer", "_shape")

    def __init__(
        self,
        sequencer: Sequencer,
        call: Call,
        finish: Callable[[], Any],
        shape: Callable[[Any], Any],
    ) -> None:
        self._sequencer = sequencer
        self._call = call
        self._finish: Callable[[], Any] | None = finish
        self._shape = shape
        self._results: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether it completed (`wait` returns, or raises, at once)."""
        return self._finish is None

    def wait(self) -> Any:
        """The reduced values; raises what ended the all-reduce (each time it is asked)."""
        if self._finish is not None:
            sequencer = self._sequencer
            sequencer.hold(self._call.name)
            try:
                sequencer.settle(self)
            finally:
                sequencer.lock.release()
        if self._error is not None:
            raise self._error
        return self._results

    def complete(self) -> None:
        """Finish it (the sequencer's lock is held); keep its results or its error."""
        finish, self._finish = self._finish, None
        if finish is None:
            return
        try:
            self._results = self._shape(self._sequencer.guard(self._call, finish))
        except BaseException as err:
            self._error = err
            raise


def guarded_fill(fill: Callable[..., bool] | None) -> Callable[..., bool] | None:
    """`fill`, its exceptions wrapped (`FillFailedError`): they surface as themselves, told."""
    if fill is None:
        return None

    def guarded(*args: Any, **kwargs: Any) -> bool:
        try:
            return fill(*args, **kwargs)
        except BaseException as err:
            raise FillFailedError(err) from err

    return guarded
