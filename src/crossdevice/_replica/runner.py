"""Run a function once per replica, concurrently, with a `merge_call` rendezvous.

TF's `mirrored_run` creates a thread per replica on every call and runs them one after
another. Here each strategy keeps N-1 long-lived worker threads and runs replica 0 on the
calling thread, so a `run` costs a few thread hand-offs, and replicas really run in
parallel (NumPy and torch release the GIL in their kernels).

Rendezvous rules (docs/design.md §3):
* `merge_call`: every replica pauses; the last to arrive runs `merge_fn` once, in
  cross-replica context, with arguments regrouped; each replica gets its own component.
* A replica that returns while its peers wait in a `merge_call` is a RuntimeError
  (TF: "Some replicas made a different number of replica_context().merge_call() calls.").
* An exception anywhere (a replica, `merge_fn`) breaks the run: peers blocked in a
  rendezvous are released with `ReplicaAbortedError`, every thread is joined, and the
  caller gets the original exception. The runner is reset and usable for the next run.
* A KeyboardInterrupt in the caller while it waits for the replica threads aborts the
  run the same way and reaches the caller at once; the next run first waits for the
  replica threads still inside `fn` (they leave at their next collective).

Waits use one raw lock per waiter (held while the waiter sleeps, released once to wake
it) rather than a shared `threading.Condition`: on a 2-core machine a 4-replica dispatch
then costs ~67 µs instead of ~92 µs (measured with both primitives, 3000 runs).

Small steps do better still without threads: `set_replica_execution` ("auto" by default)
runs a step function whose replicas are measured to be faster that way as cooperative
replicas, greenlets taking turns on the caller's thread (`crossdevice._core.cooperative`).
Every wait goes through `cooperative.block`, so both modes share the rules above.

Invariants (guarded by `self._lock`):
* `_arrived` replicas wait in the current merge (`_waiting` names them, except the last
  to arrive); `_finished` replicas have returned from `fn` in this run.
* `_arrived + _finished <= N`; when both are positive and add up to N, the merge can
  never complete: that is the mismatched-merge_call error.
* Every wake lock is released at most once per wait: only the code that removes a
  replica from `_waiting` (or counts the last finisher) releases its lock.
"""

from __future__ import annotations

import _thread
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, Protocol

from crossdevice._core import context, devices
from crossdevice._core import cooperative as cooperative_module
from crossdevice._core.errors import CollectiveTimeoutError, ReplicaAbortedError

__all__ = [
    "EXECUTION_MODES",
    "MERGE_CALL_MISMATCH",
    "ReplicaRunner",
    "get_replica_execution",
    "set_replica_execution",
]

MERGE_CALL_MISMATCH: Final = (
    "Some replicas made a different number of replica_context().merge_call() calls: "
    "replicas {done} returned while replicas {waiting} wait in merge_call #{seq}. Every "
    "replica must make the same merge_call (and all_reduce) calls in the same order."
)

#: How often idle waits wake to check for shutdown or a broken run. Waits are woken by
#: notifications; this only bounds how long a missed wake-up could delay them.
_POLL_SECONDS: Final = 1.0
#: How often `_recover` looks whether an abandoned run's replica threads are done.
_RECOVER_POLL_SECONDS: Final = 0.005


#: `set_replica_execution` choices: pick per step function by timing both, replica
#: threads only, or cooperative replicas (greenlets on the caller's thread) only.
EXECUTION_MODES: Final = ("auto", "threads", "cooperative")

_execution: str = "auto"


def set_replica_execution(mode: Literal["auto", "threads", "cooperative"]) -> None:
    """Choose how `strategy.run` executes the replicas of in-process host strategies.

    * `"auto"` (default): replica threads, except for step functions measured to be
      faster as cooperative replicas (small steps: a metric, a scalar all-reduce), while
      torch is not imported.
    * `"threads"`: one long-lived thread per replica; replicas compute in parallel
      wherever NumPy or torch release the GIL.
    * `"cooperative"`: every replica is a greenlet on the caller's thread and runs until
      it waits in a collective, then the next one runs. No thread hand-offs (a 1 KiB
      all-reduce step costs a fraction of the threaded one) and no parallel compute.
      The context, the device scope and torch's grad mode are kept per replica; other
      thread-local state (torch autocast and inference mode) is shared by the replicas.

    It applies to MirroredStrategy and CentralStorageStrategy on CPU devices;
    MultiWorkerMirroredStrategy and GPU replicas always use threads. Results are the same
    in every mode, bitwise.

    Args:
        mode: one of `EXECUTION_MODES`.

    Raises:
        ValueError: an unknown mode.
    """
    global _execution
    if mode not in EXECUTION_MODES:
        raise ValueError(
            f"replica execution must be one of {list(EXECUTION_MODES)}, received {mode!r}"
        )
    if mode == "cooperative" and not cooperative_module.available():
        raise ValueError(
            "replica execution 'cooperative' needs the greenlet package, which is not "
            "installed: pip install greenlet (or choose 'auto' or 'threads')"
        )
    _execution = mode


def get_replica_execution() -> str:
    """The mode set by `set_replica_execution` ("auto" unless changed)."""
    return _execution


class _Tuner:
    """Per step function: how long its runs take on threads and cooperatively.

    A new function runs on threads. If that took under `TRY_BELOW` seconds it is tried
    cooperatively `SAMPLES` times; afterwards the mode with the smaller median of its
    last `WINDOW` run times runs, and every `EXPLORE_EVERY` runs the other one is timed
    once again, so a step that grows (or shrinks) moves to its faster mode. Medians, not
    averages: one run stalled by the machine (a GC pause, another process) must not move
    a step to its slower mode for the next hundred runs.
    """

    TRY_BELOW: Final = 1e-3
    SAMPLES: Final = 3
    WINDOW: Final = 5
    EXPLORE_EVERY: Final = 64
    MAX_FUNCTIONS: Final = 256

    def __init__(self) -> None:
        self._stats: dict[Any, _StepTimes] = {}

    def choose(self, key: Any) -> bool:
        """Whether the next run of `key` should be cooperative."""
        stats = self._stats.get(key)
        if stats is None:
            return False
        stats.runs += 1
        threads = stats.median[0]
        if len(stats.times[1]) < self.SAMPLES:
            return threads < self.TRY_BELOW
        prefer_coop = stats.median[1] < threads
        if stats.runs % self.EXPLORE_EVERY == 0:
            return not prefer_coop and threads < self.TRY_BELOW
        return prefer_coop

    def record(self, key: Any, coop: bool, seconds: float) -> None:
        """Add one run's wall time to `key`'s recent times in its mode."""
        stats = self._stats.get(key)
        if stats is None:
            if len(self._stats) >= self.MAX_FUNCTIONS:
                self._stats.clear()
            stats = self._stats[key] = _StepTimes(self.WINDOW)
        slot = 1 if coop else 0
        times = stats.times[slot]
        times.append(seconds)
        stats.median[slot] = sorted(times)[len(times) // 2]


class _StepTimes:
    """Recent run times of one step function: [threads, cooperative]."""

    __slots__ = ("median", "runs", "times")

    def __init__(self, window: int) -> None:
        self.times: tuple[deque[float], deque[float]] = (deque(maxlen=window), deque(maxlen=window))
        self.median = [math.inf, math.inf]
        self.runs = 0


def _tuning_key(fn: Callable[..., Any]) -> Any:
    """What identifies a step function across calls (a new lambda each step shares code)."""
    code = getattr(fn, "__code__", None)
    if code is not None:
        return code
    try:
        hash(fn)
    except TypeError:
        return None
    return fn


#: What a worker runs: (fn, args, kwargs).
_Job = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class _Participant(Protocol):
    """A communicator the replicas use during a run (the in-process ThreadCommunicator)."""

    def abort(self, exc: BaseException) -> None:
        """Release every waiter: a replica failed."""

    def finish(self, replica_id: int) -> None:
        """Replica `replica_id` returned: peers waiting for it must not wait forever."""

    def reset(self) -> None:
        """Make it ready for the next run (no replica is inside a collective)."""


class ReplicaRunner:
    """Runs replica functions on long-lived threads (replica 0 on the caller's thread).

    Args:
        num_replicas: local replicas.
        make_frame: `make_frame(i)` returns the context `Frame` of replica `i`.
        replica_devices: the device of each replica (its thread's device scope).
        name: used in thread names and error messages.
        cooperative: whether replicas may run cooperatively on the caller's thread
            (`set_replica_execution`): only where every collective they wait in is an
            in-process rendezvous (host devices, one process).
    """

    def __init__(
        self,
        num_replicas: int,
        make_frame: Callable[[int], context.Frame],
        replica_devices: Sequence[str],
        name: str,
        cooperative: bool = False,
    ) -> None:
        self._n = num_replicas
        self._cooperative_ok = cooperative and num_replicas > 1 and cooperative_module.available()
        self._tuner = _Tuner()
        self._scheduler: cooperative_module.CooperativeScheduler | None = None
        self._make_frame = make_frame
        self._devices = tuple(replica_devices)
        self._name = name
        self._lock = _thread.allocate_lock()
        self._run_lock = threading.Lock()
        self._participants: list[_Participant] = []
        self._start_wake = [_locked() for _ in range(num_replicas)]
        self._done_wake = _locked()
        self._merge_wake = [_locked() for _ in range(num_replicas)]
        # Per-run state (guarded by _lock).
        self._jobs: list[_Job | None] = [None] * num_replicas
        self._results: list[Any] = [None] * num_replicas
        self._errors: list[tuple[float, int, BaseException]] = []
        self._pending = 0
        self._running = [False] * num_replicas  # replica i is inside this run's `fn`
        # How the current run runs ("threads" or "cooperative") from the moment its
        # caller could leave it early (KeyboardInterrupt) until its state is reset; a
        # run that finds it set cleans up first (`_recover`).
        self._abandoned: str | None = None
        self._broken: BaseException | None = None
        self._closed = False
        self._merge_timeout: float | None = None
        self._caller_devices: list[str] = []
        # merge_call state (guarded by _lock).
        self._arrived = 0
        self._finished = 0
        self._merge_seq = 0
        self._merge_inputs: list[Any] = [None] * num_replicas
        self._merge_outputs: list[Any] = [None] * num_replicas
        self._waiting: set[int] = set()
        self._threads = [
            threading.Thread(
                target=self._worker, args=(i,), name=f"{name}-replica-{i}", daemon=True
            )
            for i in range(1, num_replicas)
        ]
        for thread in self._threads:
            thread.start()

    # --- public ---------------------------------------------------------------------------
    def add_participant(self, participant: _Participant) -> None:
        """Register a communicator to tell when replicas return, abort, and reset.

        It is told when each replica's function returns, aborted when a run breaks, and
        reset after every run.
        """
        self._participants.append(participant)

    def run(
        self,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
        merge_timeout: float | None = None,
    ) -> list[Any]:
        """Call `fn(*args_i, **kwargs_i)` on every replica; return the results in order.

        Raises:
            BaseException: the first exception raised by a replica or a `merge_fn`.
        """
        with self._run_lock:
            if self._abandoned is not None:
                self._recover()
            coop, key = self._choose_mode(fn)
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"{self._name}: the strategy's replica threads are closed")
                if not coop:
                    for i in range(1, self._n):
                        args, kwargs = per_replica_args[i]
                        self._jobs[i] = (fn, args, kwargs)
                self._results = [None] * self._n
                self._errors = []
                self._pending = self._n
                self._running = [True] * self._n
                self._merge_timeout = merge_timeout
                current = devices.current_device()
                self._caller_devices = [current] if current else []
            start = time.perf_counter()
            try:
                if coop:
                    self._run_cooperative(fn, per_replica_args)
                else:
                    for i in range(1, self._n):
                        self._start_wake[i].release()
                    args0, kwargs0 = per_replica_args[0]
                    self._run_replica(0, fn, args0, kwargs0)
                    # Replicas always finish: a broken run releases every rendezvous.
                    while not self._done_wake.acquire(timeout=_POLL_SECONDS):
                        pass
            except BaseException as exc:
                # Only the caller's own waiting gets here (a KeyboardInterrupt while it waits
                # for the replica threads; the cooperative scheduler failing twice): replicas
                # report their errors through _fail. Abort the others and leave: the next
                # run first waits for the replica threads still inside `fn`, then resets.
                self._fail(-1, exc)
                self._abandoned = "cooperative" if coop else "threads"
                raise
            # Every replica is done; should an interrupt land before _finish_run has reset
            # the per-run state, the next run does it.
            self._abandoned = "cooperative" if coop else "threads"
            if key is not None:
                self._tuner.record(key, coop, time.perf_counter() - start)
            return self._finish_run()

    def _choose_mode(self, fn: Callable[..., Any]) -> tuple[bool, Any]:
        """(run cooperatively?, the tuning key to record the run under, or None)."""
        if not self._cooperative_ok:
            return False, None
        mode = _execution
        if mode == "threads":
            return False, None
        if mode == "cooperative":
            return True, None
        # auto: torch keeps more thread-local state than a replica switch carries over.
        if "torch" in sys.modules:
            return False, None
        key = _tuning_key(fn)
        if key is None:
            return False, None
        return self._tuner.choose(key), key

    def _run_cooperative(
        self,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> None:
        scheduler = self._scheduler
        if scheduler is None:
            scheduler = self._scheduler = cooperative_module.CooperativeScheduler(
                self._n, self._run_replica, lambda exc: self._fail(-1, exc)
            )
        caller_stack = context.copy_stack()
        torch = sys.modules.get("torch")
        caller_grad = None if torch is None else bool(torch.is_grad_enabled())
        # What each replica would see on its own thread: replica 0 the caller's context
        # and grad mode, the others fresh ones; each its device scope.
        states = [
            cooperative_module.ReplicaState(
                caller_stack if i == 0 else [],
                [self._devices[i]],
                caller_grad if i == 0 or caller_grad is None else True,
            )
            for i in range(self._n)
        ]
        jobs = [(i, fn, *per_replica_args[i]) for i in range(self._n)]
        scheduler.run(jobs, states)
        # The last replica to finish released the wake the threaded run waits on.
        self._done_wake.acquire(False)

    def merge_call(
        self,
        replica_id: int,
        merge: Callable[[list[Any]], list[Any]],
        value: Any,
    ) -> Any:
        """Rendezvous of all replicas; `merge(inputs)` runs once and returns one output each.

        Args:
            replica_id: the local replica calling.
            merge: called by the last replica to arrive with every replica's `value`, in
                replica order; returns the value for each replica.
            value: this replica's input.
        """
        with self._lock:
            if self._broken is not None:
                raise ReplicaAbortedError()
            seq = self._merge_seq
            self._merge_inputs[replica_id] = value
            self._arrived += 1
            last = self._arrived == self._n
            if last:
                inputs = list(self._merge_inputs)
                self._merge_inputs = [None] * self._n
            else:
                self._waiting.add(replica_id)
                self._check_mismatch_locked()
        if not last:
            return self._wait_merge(replica_id, seq)
        # merge_fn sees the caller's device scope, not this replica thread's.
        replica_devices = devices.swap_device_stack(list(self._caller_devices))
        try:
            outputs = merge(inputs)
        except BaseException as exc:
            self._fail(replica_id, exc)
            raise ReplicaAbortedError() from exc
        finally:
            devices.swap_device_stack(replica_devices)
        with self._lock:
            if self._broken is not None:
                raise ReplicaAbortedError()
            self._merge_outputs = list(outputs)
            self._arrived = 0
            self._merge_seq += 1
            woken = list(self._waiting)
            self._waiting.clear()
        for other in woken:
            self._merge_wake[other].release()
        return outputs[replica_id]

    def close(self) -> None:
        """Stop the worker threads (they are daemons; this only lets them exit early)."""
        with self._lock:
            self._closed = True

    # --- replica side ---------------------------------------------------------------------
    def _worker(self, replica_id: int) -> None:
        devices.swap_device_stack([self._devices[replica_id]])
        wake = self._start_wake[replica_id]
        while True:
            if not wake.acquire(timeout=_POLL_SECONDS):
                if self._closed:
                    return
                continue
            job = self._jobs[replica_id]
            self._jobs[replica_id] = None
            if job is not None:
                self._run_replica(replica_id, *job)

    def _run_replica(
        self, replica_id: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        frame = self._make_frame(replica_id)
        context.push_frame(frame)
        old_devices = None
        if replica_id == 0:
            old_devices = devices.swap_device_stack([self._devices[0]])
        try:
            result = fn(*args, **kwargs)
        except ReplicaAbortedError:
            result = None
        except BaseException as exc:  # every error reaches the caller of run
            self._fail(replica_id, exc)
            result = None
        finally:
            context.pop_frame(frame)
            if old_devices is not None:
                devices.swap_device_stack(old_devices)
        for participant in self._participants:
            participant.finish(replica_id)
        with self._lock:
            self._results[replica_id] = result
            self._finished += 1
            self._pending -= 1
            last = self._pending == 0
            if not last:
                self._check_mismatch_locked()
        if last:
            self._done_wake.release()
        # After the release: once `_recover` sees no replica running, no release is due.
        self._running[replica_id] = False

    def _wait_merge(self, replica_id: int, seq: int) -> Any:
        timeout = self._merge_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        wake = self._merge_wake[replica_id]
        # A cooperative replica has no thread to poll with: it waits for the deadline.
        poll = None if cooperative_module.in_cooperative_replica() else _POLL_SECONDS
        while True:
            wait = poll
            if deadline is not None:
                left = max(deadline - time.monotonic(), 0.0)
                wait = left if wait is None else min(wait, left)
            if cooperative_module.block(wake, wait):
                with self._lock:
                    if self._merge_seq == seq:  # woken by a failure, not by the merge
                        raise ReplicaAbortedError()
                    return self._merge_outputs[replica_id]
            if deadline is not None and time.monotonic() >= deadline:
                with self._lock:
                    if replica_id not in self._waiting:
                        continue  # released just now: the next acquire succeeds at once
                    self._waiting.discard(replica_id)
                    missing = [i for i in range(self._n) if self._merge_inputs[i] is None]
                    exc = CollectiveTimeoutError(
                        f"{self._name}: merge_call #{seq} timed out after {timeout} s on "
                        f"replica {replica_id}; replicas that did not arrive: "
                        f"{missing or '(none: merge_fn is still running)'}"
                    )
                    self._fail_locked(replica_id, exc)
                raise ReplicaAbortedError() from exc

    # --- failure handling -----------------------------------------------------------------
    def _check_mismatch_locked(self) -> None:
        if self._arrived > 0 and self._finished > 0 and self._arrived + self._finished == self._n:
            waiting = sorted(self._waiting)
            done = [i for i in range(self._n) if i not in self._waiting]
            exc = RuntimeError(
                MERGE_CALL_MISMATCH.format(done=done, waiting=waiting, seq=self._merge_seq)
            )
            self._fail_locked(-1, exc)

    def _fail(self, replica_id: int, exc: BaseException) -> None:
        with self._lock:
            self._fail_locked(replica_id, exc)

    def _fail_locked(self, replica_id: int, exc: BaseException) -> None:
        self._errors.append((time.monotonic(), replica_id, exc))
        if self._broken is None:
            self._broken = exc
            for participant in self._participants:
                participant.abort(exc)
        woken = list(self._waiting)
        self._waiting.clear()
        for other in woken:
            self._merge_wake[other].release()

    def _finish_run(self) -> list[Any]:
        with self._lock:
            results = self._results
            if self._broken is None and not self._errors:
                # A clean run (the per-step case): only the merge counters to clear.
                self._arrived = 0
                self._finished = 0
                self._merge_outputs = [None] * self._n  # drop the last merge's values
                clean = True
            else:
                clean = False
        if clean:
            for participant in self._participants:
                participant.reset()
            self._abandoned = None
            return results
        with self._lock:
            errors = sorted(self._errors, key=lambda e: e[0])
            broken = self._broken
            results = list(self._results)
        self._reset()  # for the next run, whatever happened in this one
        self._abandoned = None
        if broken is not None:
            first = errors[0][2] if errors else broken
            for _, replica, other in errors[1:]:
                if other is not first:
                    first.add_note(f"replica {replica} also raised {type(other).__name__}: {other}")
            raise first
        return results

    def _reset(self) -> None:
        """Clear a broken run's failure and rendezvous state, and reset the participants."""
        with self._lock:
            self._broken = None
            self._errors = []
            self._arrived = 0
            self._finished = 0
            self._merge_inputs = [None] * self._n
            self._merge_outputs = [None] * self._n
            self._waiting.clear()
            # Fresh wake locks: a failure releases those of the replicas waiting in a
            # merge_call, and one unwound without taking its release (a cooperative
            # replica of an abandoned run) would wake its next merge_call at once.
            self._merge_wake = [_locked() for _ in range(self._n)]
        for participant in self._participants:
            participant.reset()

    def _recover(self) -> None:
        """Before a run: finish cleaning up after a run its caller abandoned.

        That run is aborted, so its replica threads leave `fn` at their next collective
        or when `fn` returns; wait for them. Replica 0 ran on the caller's thread, and
        cooperative replicas were unwound by the scheduler: neither is still running.
        """
        if self._abandoned == "threads":
            while any(self._running[1:]):
                time.sleep(_RECOVER_POLL_SECONDS)
        self._done_wake.acquire(False)  # the abandoned run's last release, if not taken
        self._reset()
        self._abandoned = None


def _locked() -> Any:
    """A raw lock, already held: `release()` wakes the one thread blocked in `acquire()`."""
    lock = _thread.allocate_lock()
    lock.acquire()
    return lock
