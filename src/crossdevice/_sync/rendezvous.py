"""`Rendezvous`: where the replicas of one strategy meet, for `merge_call` and every collective.

Every replica of a strategy makes the same calls in the same order; each call is a
*round*. A replica deposits what it asked for (an `Arrival`: the kind of call, its reduce
op, the nest structure, each leaf's shape and dtype, its inputs) and waits; the last one
to arrive compares the arrivals and completes the round through the arrivals' `Handler`
(a `merge_call` runs `merge_fn`; a `ThreadCommunicator` collective validates, plans and
reduces). Then:

* most rounds are done: every replica takes its result;
* a round may hand out shared work (a large reduction): every replica takes pieces of it,
  and after a second wait every replica returns the same results.

One rendezvous for every kind of call is what makes a collective-order bug an error rather
than a hang: replicas that called different things (`merge_call` in one, `all_reduce` in
another; SUM in one, MEAN in another; `{'a': x}` against `{'b': x}`) meet in the same
round, and the last to arrive raises in every replica, naming what each one called:

    replica 0: all_reduce(SUM, float32[3]) #4; replica 1: merge_call #4

A replica that returns from its function while its peers wait (`finish`) is the other way
replicas can disagree: once every live replica waits, the round can never complete, and it
fails at once. No timeout is needed for either, so no configuration can hang on them;
`timeout` still bounds a wait for a peer that is busy (or stuck) in user code.

Reliability (docs/design.md §5): `abort(exc)` releases every waiter with `ReplicaAbortedError`;
a wait past `timeout` raises `CollectiveTimeoutError` naming the call, its sequence number
and the replicas that did not arrive, and breaks the rendezvous until `reset()` (its peers
are released with the same error rather than left waiting).

Every wait goes through `crossdevice._sync.waiting.block`, so the rules are the same
for replica threads and for cooperative replicas (greenlets on the caller's thread).

Waits use one raw lock per waiter (a *gate*, held while the waiter sleeps, released once
to wake it) rather than a shared `threading.Condition`: woken threads do not queue for the
condition's lock (measured, 4 threads on 2 cores: 46 us per Condition barrier, 29 us with
gates).

When a round completes, replica 0 is woken last: after every other replica has left the
round (`Round.held`). In a strategy replica 0 runs on the caller's thread, which waits for
the other replicas at the end of `run`; woken with them, it would run on, then sleep at
the end of `run` and be woken once more, one more hand-off of the GIL per step (about 12
us on the 2-core dev VM; measured with 4 replica threads and no work: 69 us a step with
one round, 57 us with replica 0 last). Aborts, resets, timeouts and departures still wake
everyone at once.

Tracing (`crossdevice._trace`): every round is noted in `history` (the flight recorder:
the last 1,000 calls, always on), one tuple appended by the round's last arriver, which
keeps the round's arrival times (each arrival stores its time in the round: a list store,
not a record of its own). A failure (replicas that disagree, a timeout) writes a
flight-recorder report, with the unfinished round's arrivals, whose path ends the error's
message.
With tracing on (`_trace.on`, one attribute read when off) each replica's wait, the
reduction and its shares are recorded, and the last arriver feeds the straggler report.
"""

from __future__ import annotations

import collections
import threading
import time
from _thread import allocate_lock as _allocate_lock
from collections.abc import Callable, Sequence
from typing import Any, Final

from crossdevice._core.errors import CollectiveTimeoutError, ReplicaAbortedError
from crossdevice._sync.call import CallSignature
from crossdevice._sync.rounds import Record, Round
from crossdevice._sync.waiting import block, in_cooperative_replica
from crossdevice._trace import flight as _flight
from crossdevice._trace import state as _trace

__all__ = ["MERGE_CALL_MISMATCH", "Rendezvous", "is_rendezvous_error"]

MERGE_CALL_MISMATCH: Final = (
    "Some replicas made a different number of replica_context().merge_call() calls (or "
    "all_reduce / all_gather calls): replicas {done} returned while replicas {waiting} "
    "wait in {call} #{seq}. Every replica must make the same merge_call, all_reduce and "
    "all_gather calls in the same order."
)

#: Marks an error the rendezvous raised in every replica (replicas that disagree), so the
#: runner can prefer the error a user's code raised (`is_rendezvous_error`).
_MARK: Final = "_crossdevice_rendezvous_error"

#: A user's `merge_call`: nothing to agree on but the call itself.
_USER_MERGE: Final = CallSignature("merge_call")


def is_rendezvous_error(exc: BaseException) -> bool:
    """Whether `exc` is a disagreement the rendezvous reported (not a user's own error)."""
    return bool(getattr(exc, _MARK, False))


class Rendezvous:
    """The meeting point of N replicas: one round per call, in order (see the module doc).

    Args:
        num_replicas: how many replicas take part (>= 1).
        name: a name for error messages (the strategy's class).
    """

    def __init__(self, num_replicas: int, name: str = "Rendezvous") -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int):
            raise TypeError(f"num_replicas must be an int >= 1, received {num_replicas!r}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, received {num_replicas!r}")
        self._n = num_replicas
        self._name = name
        self._lock = threading.Lock()
        #: (replica, gate) of every replica asleep in a wait; a gate is a lock held by its
        #: sleeper's wait, one per wait, released once to wake it.
        self._sleepers: list[tuple[int, Any]] = []
        self._seq = 0
        self._round = Round(0, num_replicas, name)
        self._aborted: BaseException | None = None
        self._broken: str | None = None
        self._mismatch: str | None = None
        self._departed: set[int] = set()
        #: The flight recorder: one `Record` per finished round (see `flight_record`).
        self.history: collections.deque[Record] = collections.deque(maxlen=_flight.COLLECTIVES)
        _flight.register(self, _flight.rendezvous_group)

    @property
    def num_replicas(self) -> int:
        """How many replicas take part."""
        return self._n

    @property
    def name(self) -> str:
        """The name used in error messages."""
        return self._name

    def __repr__(self) -> str:
        return f"Rendezvous(num_replicas={self._n}, name={self._name!r})"

    # ------------------------------------------------------------------ calls

    def arrive(self, replica_id: int, arrival: Any, timeout: float | None) -> Any:
        """Take part in the next round with `arrival`; return this replica's result.

        Raises:
            ValueError, RuntimeError: the replicas disagree (raised in every replica,
                naming what each one called).
            CollectiveTimeoutError: a peer did not arrive within `timeout`.
            ReplicaAbortedError: `abort` was called (a peer failed).
        """
        now = _monotonic()  # outside the lock: a longer hold costs peers a futex sleep
        deadline = None if timeout is None else now + timeout
        with self._lock:
            if self._aborted is not None or self._broken is not None or self._mismatch:
                self._raise_if_unusable(None)
            rnd = self._round
            if rnd.arrivals[replica_id] is not None:
                raise ValueError(
                    f"{self._name}: replica {replica_id} called {arrival.kind} twice in "
                    f"call #{rnd.seq}; every replica thread must use its own replica_id"
                )
            rnd.arrivals[replica_id] = arrival
            rnd.times[replica_id] = now
            rnd.count += 1
            last = rnd.count == self._n
            if last:
                self._seq += 1
                self._round = Round(self._seq, self._n, self._name)
            else:
                if self._departed:
                    self._check_departed_locked(rnd)
                    self._raise_if_unusable(rnd)
                gate = _allocate_lock()
                gate.acquire()
                self._sleepers.append((replica_id, gate))
                if not replica_id:
                    rnd.zero_gate = gate
        if last:
            # Outside the lock: a merge_fn may take long, and abort() must still reach
            # the replicas waiting meanwhile.
            self._complete(rnd, replica_id)
            if _trace.on:
                _trace.left(self, rnd, replica_id, now, True, in_cooperative_replica())
            with self._lock:
                rnd.ready = True
                self._wake_round_locked(rnd)
        else:
            try:
                self._wait(replica_id, gate, rnd, "arrive", deadline, timeout, arrival.kind)
            finally:
                if rnd.held is not None and replica_id:
                    self._leave(rnd)
            if _trace.on:
                _trace.left(self, rnd, replica_id, now, False, False)
        if rnd.error is not None:
            _raise_round_error(rnd.error)
        # Read before this replica counts itself done: the last one to finish clears it.
        work = rnd.work
        if work is None and rnd.failure is not None:
            self._raise_failure(rnd, replica_id)
        if work is not None:
            self._share_work(replica_id, rnd, work, deadline, timeout, arrival.kind)
        return arrival.handler.result(rnd, replica_id)

    def _share_work(
        self,
        replica_id: int,
        rnd: Round,
        work: Callable[[int], None],
        deadline: float | None,
        timeout: float | None,
        kind: str,
    ) -> None:
        """Take this replica's share of a round's work, then wait for the others'."""
        start = _monotonic() if _trace.on else 0.0
        try:
            if rnd.failure is None:  # a peer's share failed: skip, but still report
                work(replica_id)
        except BaseException as exc:
            with self._lock:
                if rnd.failure is None:
                    rnd.failure, rnd.failure_replica = exc, replica_id
                self._finish_work_locked(rnd, replica_id)
            raise
        with self._lock:
            self._finish_work_locked(rnd, replica_id)
            last = rnd.finished
            if not last:
                gate = _held_lock()
                self._sleepers.append((replica_id, gate))
        if not last:
            self._wait(replica_id, gate, rnd, "finish", deadline, timeout, kind)
        if start and _trace.on:
            _trace.shared(rnd, replica_id, start)
        if rnd.failure is not None:
            self._raise_failure(rnd, replica_id)

    def merge_call(
        self,
        replica_id: int,
        merge: Callable[[list[Any]], Sequence[Any]],
        value: Any,
        call: CallSignature = _USER_MERGE,
        timeout: float | None = None,
    ) -> Any:
        """A `merge_call` round: `merge(inputs)` runs once and returns one output each.

        Args:
            replica_id: the calling replica.
            merge: called by the last replica to arrive with every replica's `value`, in
                replica order; returns the value for each replica (replica 0's `merge`
                runs, as TF runs the first replica's `merge_fn`).
            value: this replica's input.
            call: what the replicas must agree on: a plain `merge_call` for a user's
                merge_call, or the kind, reduce op, structure and leaf signatures of a
                collective that goes through merge_call (its `describe` names it in
                error messages).
            timeout: seconds to wait for the peers (None: until they come or fail).
        """
        arrival = _MergeArrival(call, value, merge)
        return self.arrive(replica_id, arrival, timeout)

    # ------------------------------------------------------------------ lifecycle

    def abort(self, exc: BaseException) -> None:
        """Release every waiting replica with `ReplicaAbortedError` (a peer failed).

        Later calls raise `ReplicaAbortedError` at once until `reset()`.
        """
        with self._lock:
            if self._aborted is None:
                self._aborted = exc
            self._wake_locked()

    def reset(self) -> None:
        """Make the rendezvous usable again after `abort`, a mismatch or a timeout.

        Call it when no replica is inside a call (after the replicas of a failed run have
        returned).
        """
        with self._lock:
            self._departed.clear()
            if (
                self._aborted is None
                and self._broken is None
                and self._mismatch is None
                and self._round.count == 0
            ):
                return  # a clean run (every run's end): nobody to release, no round to drop
            self._aborted = None
            self._broken = None
            self._mismatch = None
            self._round.cancelled = True
            self._seq += 1
            self._round = Round(self._seq, self._n, self._name)
            self._wake_locked()

    def finish(self, replica_id: int) -> None:
        """Record that `replica_id` will make no more calls in this run.

        A strategy's runner calls this when a replica's function returns. Peers waiting
        for it (now or later) get a RuntimeError naming it instead of a hang (TF: "Some
        replicas made a different number of replica_context().merge_call() calls.");
        `reset()` clears it.
        """
        self._departed.add(replica_id)  # atomic under the GIL
        if self._round.count:
            # Peers wait in a round: they may now never complete it. (A peer arriving
            # after this reads `_departed` under the lock and sees this replica.)
            with self._lock:
                self._check_departed_locked(self._round)

    # ------------------------------------------------------------------ internals

    def _complete(self, rnd: Round, replica_id: int) -> None:
        """Run by the last arriver: compare what the replicas called, then complete."""
        arrivals = rnd.arrivals
        first = arrivals[0]
        kind = rnd.kind = first.kind
        handler = first.handler
        try:
            for a in arrivals:  # a loop, not all(...): no generator on the hot path
                if a.kind != kind or a.handler is not handler:
                    rnd.set_error(
                        RuntimeError,
                        f"{self._name}: the replicas called different collectives: "
                        f"{rnd.describe_calls()}. Every replica must make the same "
                        "merge_call, all_reduce and all_gather calls in the same order.",
                    )
                    break
            else:
                handler.complete(rnd, replica_id)
        except BaseException as exc:
            rnd.failure, rnd.failure_replica = exc, replica_id
            rnd.work = None
        self.history.append(rnd.record(rnd.error is None))
        if rnd.error is not None:  # the replicas disagree: where the report is ends the message
            error, message = rnd.error
            rnd.error = (error, message + _report(self, error, message, rnd.odd_ones()))

    def flight_record(self) -> list[Record]:
        """The finished rounds of `history` (`Round.record`), then the unfinished one, if any."""
        records = list(self.history.copy())  # one C call: it may be appended to meanwhile
        rnd = self._round
        if rnd.count:
            records.append(rnd.snapshot())
        return records

    def _finish_work_locked(self, rnd: Round, replica_id: int) -> None:
        rnd.done += 1
        rnd.done_ids.append(replica_id)
        if rnd.done == self._n:
            # Break the round -> work closure -> round cycle now, so the round and its
            # references to the output buffers die with the last replica's reference
            # (the buffer pool relies on exact reference counts).
            rnd.work = None
            if rnd.failure is None:
                try:
                    rnd.arrivals[0].handler.finalize(rnd)
                except BaseException as exc:
                    rnd.failure, rnd.failure_replica = exc, replica_id
            rnd.finished = True
            self._wake_locked()

    def _raise_failure(self, rnd: Round, replica_id: int) -> None:
        """The replica whose code failed re-raises; its peers are released."""
        assert rnd.failure is not None
        if rnd.failure_replica == replica_id:
            raise rnd.failure
        raise ReplicaAbortedError(
            f"{self._name}: {rnd.kind} #{rnd.seq} failed in replica "
            f"{rnd.failure_replica}: {rnd.failure!r}"
        ) from rnd.failure

    def _raise_if_unusable(self, rnd: Round | None) -> None:
        if self._aborted is not None:
            where = f" in call #{rnd.seq}" if rnd is not None else ""
            raise ReplicaAbortedError(
                f"{self._name}: aborted{where} because a peer failed: {self._aborted!r}"
            ) from self._aborted
        if self._broken is not None:
            raise CollectiveTimeoutError(self._broken)
        if self._mismatch is not None:
            error = RuntimeError(self._mismatch)
            setattr(error, _MARK, True)
            raise error
        if rnd is not None and rnd.cancelled:
            raise ReplicaAbortedError(
                f"{self._name}: call #{rnd.seq} was cancelled by reset() while this "
                "replica waited in it"
            )

    def _wake_round_locked(self, rnd: Round) -> None:
        """`rnd` is ready: wake its sleepers, replica 0 once the others have left it.

        Every replica but 0 and the last arriver is asleep in `rnd` and leaves it as soon
        as it wakes (`_leave`, also when it leaves by an exception), so replica 0's wake
        is only put off, never lost; anything that wakes everyone (`abort`, `reset`, a
        timeout) wakes it too.
        """
        zero = rnd.zero_gate
        sleepers = self._sleepers
        held = None
        usable = self._aborted is None and self._broken is None and self._mismatch is None
        if zero is not None and self._n > 2 and usable:
            held = next((entry for entry in sleepers if entry[1] is zero), None)
        if held is None:
            self._wake_locked()
            return
        # Set before any release: a woken replica reads `held` to know it must leave.
        rnd.zero_left = self._n - 2
        rnd.held = held
        for entry in sleepers:
            if entry is not held:
                entry[1].release()
        sleepers.clear()
        sleepers.append(held)

    def _leave(self, rnd: Round) -> None:
        """A replica other than 0 left the ready round `rnd`: the last one wakes replica 0."""
        with self._lock:
            rnd.zero_left -= 1
            held = rnd.held
            if rnd.zero_left or held is None:
                return
            rnd.held = None
            if held in self._sleepers:  # not woken meanwhile (an abort, its own timeout)
                self._sleepers.remove(held)
                held[1].release()

    def _wake_locked(self) -> None:
        """Release every sleeping replica (each re-checks why it was woken)."""
        sleepers = self._sleepers
        for r, gate in sleepers:
            if r:
                gate.release()
        # Replica 0 last: in a strategy it runs on the caller's thread, which waits for the
        # others at the end of `run`; finishing last saves it a wake-up there. (Two replica
        # 0s may sleep: a nested run's, and its outer run's waiting in the merge_call.)
        for r, gate in sleepers:
            if not r:
                gate.release()
        sleepers.clear()

    def _wait(
        self,
        replica_id: int,
        gate: Any,
        rnd: Round,
        phase: str,
        deadline: float | None,
        timeout: float | None,
        kind: str,
    ) -> None:
        """Sleep on this replica's gate until `rnd` reaches `phase`, fails or times out.

        Called without the lock, after registering in `_sleepers` under it. The waker
        releases the gate (under the lock) and removes the replica from `_sleepers`; the
        sleeper acquires it back. A gate per wait (not per replica) means a release meant
        for one wait can never wake another (a replica unwound where it waited, a nested
        `strategy.run` inside a merge_fn whose replicas wait while their outer selves do).
        """
        entry = (replica_id, gate)
        while True:
            if deadline is None:
                # No timeout: abort(), reset(), finish() and peers' timeouts release it.
                block(gate, None)
            elif not block(gate, max(0.0, deadline - time.monotonic())):
                with self._lock:
                    if entry in self._sleepers:
                        self._sleepers.remove(entry)
                        if rnd.ready if phase == "arrive" else rnd.finished:
                            return
                        self._raise_if_unusable(rnd)
                        self._time_out_locked(rnd, phase, timeout, kind)
                    # Woken between the timeout and taking the lock: take the release.
                    gate.acquire()
            if rnd.ready if phase == "arrive" else rnd.finished:
                return
            with self._lock:
                if rnd.ready if phase == "arrive" else rnd.finished:
                    return
                self._raise_if_unusable(rnd)
                self._sleepers.append(entry)

    def _time_out_locked(self, rnd: Round, phase: str, timeout: float | None, kind: str) -> None:
        if phase == "arrive":
            missing = [r for r, a in enumerate(rnd.arrivals) if a is None]
            what = "did not arrive"
        else:
            missing = [r for r in range(self._n) if r not in rnd.done_ids]
            what = "did not finish their share"
        arrived = [r for r in range(self._n) if r not in missing]
        message = (
            f"{self._name}: {kind} #{rnd.seq} timed out after {timeout} s: replicas "
            f"{missing} {what} (arrived: {arrived}). Every replica must make the same "
            "collectives in the same order; if the step is just slow, raise the timeout "
            "(CommunicationOptions.timeout_seconds). Call reset() before reusing the "
            "communicator."
        )
        culprits = [f"replica {r}" for r in missing]
        self._broken = message + _report(self, CollectiveTimeoutError, message, culprits)
        self._wake_locked()
        raise CollectiveTimeoutError(self._broken)

    def _check_departed_locked(self, rnd: Round) -> None:
        # The first finding stands: replicas that raise it and return must not rewrite it.
        if not self._departed or rnd.count == 0 or rnd.ready or self._mismatch is not None:
            return
        waiting = [r for r, a in enumerate(rnd.arrivals) if a is not None]
        if len(waiting) + len(self._departed - set(waiting)) < self._n:
            return
        call = next(a.handler.describe(a) for a in rnd.arrivals if a is not None)
        message = f"{self._name}: " + MERGE_CALL_MISMATCH.format(
            done=sorted(self._departed), waiting=waiting, call=call, seq=rnd.seq
        )
        culprits = [f"replica {r}" for r in sorted(self._departed)]
        self._mismatch = message + _report(self, RuntimeError, message, culprits)
        self._wake_locked()


class _MergeArrival:
    """A replica's `merge_call`: its input, its `merge`, and what it must agree on."""

    __slots__ = ("call", "kind", "merge", "value")

    handler: _MergeHandler

    def __init__(
        self, call: CallSignature, value: Any, merge: Callable[[list[Any]], Sequence[Any]]
    ) -> None:
        self.kind = call.kind
        self.call = call
        self.value = value
        self.merge = merge

    @property
    def sig(self) -> tuple[tuple[Any, Any], ...]:
        """The leaves' (shape, dtype), for the flight recorder."""
        return self.call.leaves


class _MergeHandler:
    """Completes merge_call rounds: the same call everywhere, then `merge` once."""

    def describe(self, arrival: _MergeArrival) -> str:
        return arrival.call.describe()

    def complete(self, rnd: Round, replica_id: int) -> None:
        del replica_id
        arrivals: list[_MergeArrival] = rnd.arrivals
        first = arrivals[0]
        if any(a.call != first.call for a in arrivals):
            rnd.set_error(
                ValueError,
                f"{rnd.name}: the replicas' {first.kind} calls disagree: "
                f"{rnd.describe_calls()}. Every replica must pass the same reduce "
                "op, nest structure, shapes and dtypes.",
            )
            return
        rnd.results = list(first.merge([a.value for a in arrivals]))

    def finalize(self, rnd: Round) -> None:
        del rnd

    def result(self, rnd: Round, replica_id: int) -> Any:
        return rnd.results[replica_id]


_MERGE: Final = _MergeHandler()
_MergeArrival.handler = _MERGE


_monotonic: Final = time.monotonic


def _raise_round_error(error: tuple[type[BaseException], str]) -> None:
    """Raise a round's error (the replicas disagree), marked as the rendezvous' own."""
    kind, message = error
    exc = kind(message)
    setattr(exc, _MARK, True)
    raise exc


def _report(
    rendezvous: Rendezvous, kind: type[BaseException], message: str, culprits: list[str]
) -> str:
    """Write a flight-recorder report of an error every replica raises; the note for it."""
    return _flight.report(kind.__name__, message, culprits, source=rendezvous)


def _held_lock() -> Any:
    """A raw lock, already held: the gate one wait sleeps on."""
    lock = _allocate_lock()
    lock.acquire()
    return lock
