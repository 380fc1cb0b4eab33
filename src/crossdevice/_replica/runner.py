"""Run a function once per replica, concurrently; replicas meet in one `Rendezvous`.

TF's `mirrored_run` creates a thread per replica on every call and runs them one after
another. Here each strategy keeps N-1 long-lived worker threads and runs replica 0 on the
calling thread, so a `run` costs a few thread hand-offs, and replicas really run in
parallel (NumPy and torch release the GIL in their kernels).

Rules (docs/design.md §3):
* `merge_call` and every in-process collective are rounds of one `Rendezvous`
  (`crossdevice._sync.rendezvous`): replicas that call different things, or that
  return while their peers wait, get an error at once, naming what each one called.
* An exception anywhere (a replica, `merge_fn`) breaks the run: peers blocked in the
  rendezvous are released with `ReplicaAbortedError`, every replica is joined, and the
  caller gets the original exception. The runner is reset and usable for the next run.
  Which exception: the caller's own interrupt first, then one raised by a replica's code
  (the lowest replica's), then a disagreement the rendezvous found. Not the first in
  time: that depends on thread timing, and every mode must end a program the same way.
* Ctrl-C: a KeyboardInterrupt in the caller (in replica 0, or while it waits for the
  others) aborts the run and reaches the caller within `TUNING.interrupt_grace_seconds`, even
  while a replica is stuck in user code; such a replica is abandoned and the next run
  first waits briefly for it, else raises a RuntimeError naming it.
* `strategy.run` inside a `merge_fn` (TF allows it) runs on a nested runner: the outer
  replicas are all parked in that merge_call meanwhile. Every merge_fn runs through
  `run_merge_fn`, a single replica's too (it needs no rendezvous round), so any replica
  count nests.

Small steps may run as cooperative replicas instead, greenlets taking turns on the
caller's thread (`crossdevice._replica.cooperative`, chosen by `set_replica_execution`).
Every wait goes through `cooperative.block`, so both modes share the rules above.

On Linux the worker threads run under SCHED_BATCH (`_batch_scheduling`): a replica thread
that is woken waits for the thread that woke it, which holds the GIL, instead of
preempting it only to sleep again on the GIL. Nothing else changes: the caller's thread
keeps its policy, a worker's CPU share (its nice value) stays, and threads a replica
starts inherit the policy, as threads do.
"""

from __future__ import annotations

import _thread
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from crossdevice._core import context, devices, tuning
from crossdevice._core.errors import ReplicaAbortedError
from crossdevice._replica import cuda_streams, execution, refusals, thread_state
from crossdevice._replica.cooperative import CooperativeScheduler, ReplicaState
from crossdevice._sync import waiting
from crossdevice._sync.call import CallSignature
from crossdevice._sync.rendezvous import Rendezvous, is_rendezvous_error
from crossdevice._trace import flight as _flight
from crossdevice._trace import state as _trace

__all__ = ["ReplicaRunner"]

#: A user's `merge_call`: nothing to agree on but the call itself.
_USER_MERGE: Final = CallSignature("merge_call")

#: Replica threads ask Linux for SCHED_BATCH (`_batch_scheduling`): a woken replica thread
#: then waits for the thread that woke it to block instead of preempting it. That thread
#: holds the GIL, so the woken one could only try to take it, sleep again, and be woken a
#: second time; a step hands the GIL between replica threads at least 2N-2 times. Measured
#: on the 2-core dev VM, 4 replica threads handing over with no work: 36 us a step without
#: a collective, 57 us with one, and 21 and 40 us with SCHED_BATCH (the caller's thread
#: keeps its policy). The policy changes only wake-up preemption: a replica thread's
#: share of the CPU (its nice value) stays the same.
_BATCH_POLICY: Final = getattr(os, "SCHED_BATCH", None)

#: What a worker runs: (fn, args, kwargs, the caller's torch thread state).
_Job = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Any]


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
        rendezvous: the rendezvous its replicas meet in (None: a new one).
    """

    def __init__(
        self,
        num_replicas: int,
        make_frame: Callable[[int], context.Frame],
        replica_devices: Sequence[str],
        name: str,
        cooperative: bool = False,
        rendezvous: Rendezvous | None = None,
    ) -> None:
        self._n = num_replicas
        self._cooperative_ok = cooperative and num_replicas > 1 and waiting.available()
        self._tuner = execution.Tuner(name)
        self._scheduler: CooperativeScheduler | None = None
        self._make_frame = make_frame
        self._devices = tuple(replica_devices)
        self._name = name
        self._rendezvous = rendezvous if rendezvous is not None else Rendezvous(num_replicas, name)
        self._lock = _thread.allocate_lock()
        self._run_lock = threading.Lock()
        self._start_wake = [_locked() for _ in range(num_replicas)]
        self._worker_wakes = self._start_wake[1:]
        self._done_wake = _locked()
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
        self._interrupted_at: float | None = None
        self._closed = False
        self._run_thread: int | None = None  # the caller of the run in flight (`inside_run`)
        #: Why a `run` from a second thread while another's is in flight is refused (a
        #: RuntimeError saying this); None: it waits its turn.
        self.refuse_concurrent_runs: str | None = None
        self._merge_timeout: float | None = None
        self._caller_devices: list[str] = []
        # The thread running a merge_fn of this runner (a nested run starts there).
        self._merging: int | None = None
        self._nested: ReplicaRunner | None = None
        # GPU replicas: their CUDA device and stream, and the ordering of merge_calls.
        self._cuda = cuda_streams.cuda_replicas(self._devices)
        self._cuda_run: cuda_streams.CudaRun | None = None
        self._threads = [
            threading.Thread(
                target=self._worker, args=(i,), name=f"{name}-replica-{i}", daemon=True
            )
            for i in range(1, num_replicas)
        ]
        for thread in self._threads:
            thread.start()

    # --- public ---------------------------------------------------------------------------
    @property
    def rendezvous(self) -> Rendezvous:
        """The rendezvous this runner's replicas meet in (merge_call and collectives)."""
        return self._rendezvous

    @property
    def mode(self) -> str:
        """The replica execution this runner uses: "threads", "cooperative" or "auto"."""
        return execution.get_replica_execution() if self._cooperative_ok else "threads"

    def execution_choices(self) -> dict[str, str]:
        """Under "auto": the mode chosen for each step function so far, by its name."""
        return self._tuner.choices()

    def run(
        self,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
        merge_timeout: float | None = None,
    ) -> list[Any]:
        """Call `fn(*args_i, **kwargs_i)` on every replica; return the results in order.

        Raises:
            BaseException: the exception that ended the run (see the module doc).
            RuntimeError: the runner is closed, replicas of an interrupted run are
                still stuck in user code, or (`refuse_concurrent_runs` set) another
                thread's run is in flight.
        """
        if self._merging is not None and self._merging == threading.get_ident():
            # strategy.run inside a merge_fn: every replica of this run waits in that
            # merge_call, so a second set of replicas runs the nested call.
            with waiting.blocking():
                return self._nested_runner().run(fn, per_replica_args, merge_timeout)
        run_lock = self._run_lock
        if not run_lock.acquire(False):
            if (refuse := self.refuse_concurrent_runs) is not None:
                raise RuntimeError(refusals.concurrent_run(self._name, self._run_thread, refuse))
            run_lock.acquire()
        try:
            self._run_thread = threading.get_ident()
            return self._run_locked(fn, per_replica_args, merge_timeout)
        finally:
            self._run_thread = None
            run_lock.release()

    def _run_locked(
        self,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
        merge_timeout: float | None,
    ) -> list[Any]:
        """`run`, holding the run lock."""
        if self._abandoned is not None:
            self._recover()
        if _trace.on:
            _trace.step()
        coop, key = self._choose_mode(fn) if self._cooperative_ok else (False, None)
        n = self._n
        # Only replica threads take the caller's torch state: replica 0 runs on the
        # caller's thread, cooperative replicas switch grad mode themselves.
        state = thread_state.capture() if n > 1 and not coop else None
        cuda_run = self._cuda.start() if self._cuda is not None else None
        with self._lock:
            if self._closed:
                raise RuntimeError(
                    f"{self._name}: the strategy is closed (strategy.close() or the end "
                    "of its `with` block); create a new strategy to run replicas again"
                )
            if not coop:
                jobs = self._jobs
                for i in range(1, n):
                    args, kwargs = per_replica_args[i]
                    jobs[i] = (fn, args, kwargs, state)
            self._results = [None] * n
            if self._errors:
                self._errors = []
            self._pending = n
            self._running = [True] * n
            self._interrupted_at = None
            self._merge_timeout = merge_timeout
            self._cuda_run = cuda_run
            current = devices.current_device()
            self._caller_devices = [current] if current else []
        start = time.perf_counter() if key is not None else 0.0
        try:
            if coop:
                self._run_cooperative(fn, per_replica_args)
            else:
                for wake in self._worker_wakes:
                    wake.release()
                args0, kwargs0 = per_replica_args[0]
                self._run_replica(0, fn, args0, kwargs0)
                if not self._done_wake.acquire(False):  # one replica: done already
                    self._wait_done()
                if cuda_run is not None:
                    cuda_run.finish()
        except BaseException as exc:
            # Only the caller's own waiting gets here (a KeyboardInterrupt while it waits
            # for the replica threads; the cooperative scheduler failing twice): replicas
            # report their errors through _fail. Abort the others and leave: the next
            # run first waits for the replica threads still inside `fn`, then resets.
            self._fail(-1, exc)
            self._abandoned = "cooperative" if coop else "threads"
            raise
        # Should an interrupt land before _finish_run has reset the per-run state, the
        # next run does it.
        self._abandoned = "cooperative" if coop else "threads"
        if key is not None:
            self._tuner.record(key, coop, time.perf_counter() - start)
        return self._finish_run()

    def merge_call(
        self,
        replica_id: int,
        merge: Callable[[list[Any]], list[Any]],
        value: Any,
        call: CallSignature | None = None,
    ) -> Any:
        """A `merge_call` round of the rendezvous; `merge(inputs)` runs once.

        Args:
            replica_id: the local replica calling.
            merge: called once with every replica's `value`, in replica order, in the
                caller's device scope; returns the value for each replica.
            value: this replica's input.
            call: what every replica must agree on (`Rendezvous.merge_call`); None: a
                user's merge_call.
        """

        def merge_here(inputs: list[Any]) -> list[Any]:
            # merge_fn sees the caller's device scope, not this replica thread's.
            replica_devices = devices.swap_device_stack(list(self._caller_devices))
            try:
                return self.run_merge_fn(merge, inputs)
            except BaseException as exc:
                # merge_fn's error is the run's, reported once; no replica may catch it as
                # an Exception, not even the one that ran merge_fn.
                self._fail(replica_id, exc)
                raise ReplicaAbortedError() from exc
            finally:
                devices.swap_device_stack(replica_devices)

        call = _USER_MERGE if call is None else call
        cuda_run = self._cuda_run
        if cuda_run is None:
            return self._rendezvous.merge_call(
                replica_id, merge_here, value, call, self._merge_timeout
            )
        cuda_run.arrive(replica_id)
        result = self._rendezvous.merge_call(
            replica_id, cuda_run.merging(merge_here), value, call, self._merge_timeout
        )
        cuda_run.resume(replica_id, result)
        return result

    def run_merge_fn(self, merge_fn: Callable[..., Any], *args: Any) -> Any:
        """Run one of this runner's merge functions on the calling thread: `merge_fn(*args)`.

        Every merge function of a run goes through here, whether a rendezvous round runs
        it (`merge_call`) or the caller does without one (a single replica's merge_call):
        a `run` it makes is then nested, on a second set of replicas (the module doc),
        rather than a wait for the run lock that its own run holds.
        """
        outer, self._merging = self._merging, threading.get_ident()
        try:
            return merge_fn(*args)
        finally:
            self._merging = outer

    def close(self, wait: bool = True) -> None:
        """End the replica threads (idempotent); later runs raise RuntimeError.

        A run in flight on another thread finishes first (waited for up to
        `close_join_seconds`); inside a run: RuntimeError. `wait=False` (the garbage
        collector's, on any thread, inside any lock) neither waits nor refuses.
        """
        if wait and self.inside_run():
            raise RuntimeError(refusals.close_inside_run(self._name))
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Wake the threads without a job (idle: they end); one with a job posted runs
            # it, then ends (dropping it left the run waiting for ever).
            for i in range(1, self._n):
                if self._jobs[i] is None:
                    self._start_wake[i].release()
        if self._nested is not None:
            self._nested.close(wait)
        if not wait:
            return
        # Wait for a run in flight and for the threads: a replica thread still ending at
        # interpreter exit races torch's C++ static destructors and aborts the process
        # ("terminate called without an active exception", seen in 1 of 3 runs).
        deadline = time.monotonic() + tuning.TUNING.close_join_seconds
        if self._run_lock.acquire(timeout=tuning.TUNING.close_join_seconds):
            self._run_lock.release()
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(max(0.0, deadline - time.monotonic()))

    def inside_run(self) -> bool:
        """Whether the calling thread is in a run of this runner (caller, replica, nested)."""
        # A replica thread runs only replicas' functions and merge_fns of this runner.
        # (By object: an ended thread's ident is soon another thread's.)
        if self._run_thread == threading.get_ident() or threading.current_thread() in self._threads:
            return True
        nested = self._nested
        return nested is not None and nested.inside_run()

    # --- replica side ---------------------------------------------------------------------
    def _worker(self, replica_id: int) -> None:
        _batch_scheduling()
        devices.swap_device_stack([self._devices[replica_id]])
        wake = self._start_wake[replica_id]
        while True:
            wake.acquire()  # work, or close(): an idle thread has nothing else to wait for
            job = self._jobs[replica_id]
            self._jobs[replica_id] = None
            if job is None:  # only close() wakes a replica without a job
                return
            fn, args, kwargs, state = job
            if state is None:
                self._run_replica(replica_id, fn, args, kwargs)
            else:
                with state.entered():
                    self._run_replica(replica_id, fn, args, kwargs)
            with self._lock:
                if self._closed:  # closed while this replica ran: nobody wakes it again
                    return

    def _run_replica(
        self, replica_id: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        frame = self._make_frame(replica_id)
        context.push_frame(frame)
        old_devices = None
        if replica_id == 0:
            old_devices = devices.swap_device_stack([self._devices[0]])
        cuda_run = self._cuda_run
        start = time.monotonic() if _trace.on else 0.0
        try:
            if cuda_run is None:
                result = fn(*args, **kwargs)
            else:
                with cuda_run.replica(replica_id):
                    result = fn(*args, **kwargs)
            if start and _trace.on:
                _trace.replica_step(replica_id, start)
        except ReplicaAbortedError:
            result = None
        except BaseException as exc:  # every error reaches the caller of run
            if (
                replica_id == 0
                and isinstance(exc, KeyboardInterrupt)
                and not waiting.in_cooperative_replica()
            ):
                self._interrupted_at = time.monotonic()  # the caller's own Ctrl-C
            self._fail(replica_id, exc)
            result = None
        finally:
            context.pop_frame(frame)
            if old_devices is not None:
                devices.swap_device_stack(old_devices)
        self._rendezvous.finish(replica_id)
        with self._lock:
            self._results[replica_id] = result
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._done_wake.release()
        # After the release: once `_recover` sees no replica running, no release is due.
        self._running[replica_id] = False

    def _wait_done(self) -> None:
        """The caller, after replica 0: wait for the other replicas (see the module doc)."""
        while not self._done_wake.acquire(timeout=tuning.TUNING.done_poll_seconds):
            interrupted = self._interrupted_at
            if (
                interrupted is None
                or time.monotonic() - interrupted < tuning.TUNING.interrupt_grace_seconds
            ):
                continue
            # Interrupted, and some replica is still inside `fn` although the run is
            # aborted: it is stuck in user code. Abandon it.
            stuck = [i for i in range(1, self._n) if self._running[i]]
            error = next(e for _, r, e in self._errors if r == 0)
            error.add_note(
                f"{self._name}: replicas {stuck} were still running user code when the "
                "caller was interrupted; they were abandoned (the next run waits for them)"
            )
            raise error

    def _choose_mode(self, fn: Callable[..., Any]) -> tuple[bool, Any]:
        """(run cooperatively?, the tuning key to record the run under, or None)."""
        if not self._cooperative_ok:
            return False, None
        mode = execution.get_replica_execution()
        if mode == "threads":
            return False, None
        if mode == "cooperative":
            return True, None
        key = execution.tuning_key(fn)
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
            scheduler = self._scheduler = CooperativeScheduler(
                self._n, self._run_replica, lambda exc: self._fail(-1, exc)
            )
        caller_stack = context.copy_stack()
        # What each replica would see on its own thread: replica 0 the caller's context,
        # the others fresh ones; each its device scope; every one the caller's torch state
        # (grad mode is switched per replica; inference mode and autocast are the
        # thread's, that is the caller's).
        grad = waiting.grad_enabled()
        states = [
            ReplicaState(caller_stack if i == 0 else [], [self._devices[i]], grad)
            for i in range(self._n)
        ]
        jobs = [(i, fn, *per_replica_args[i]) for i in range(self._n)]
        scheduler.run(jobs, states)
        # The last replica to finish released the wake the threaded run waits on.
        self._done_wake.acquire(False)

    def _nested_runner(self) -> ReplicaRunner:
        nested = self._nested
        if nested is None:
            nested = self._nested = ReplicaRunner(
                self._n,
                self._make_frame,
                self._devices,
                f"{self._name}-nested",
                cooperative=False,
                rendezvous=self._rendezvous,
            )
        return nested

    # --- failure handling -----------------------------------------------------------------
    def _fail(self, replica_id: int, exc: BaseException) -> None:
        with self._lock:
            self._errors.append((time.monotonic(), replica_id, exc))
            first = self._broken is None
            if first:
                self._broken = exc
        if first:
            if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, maybe of a stuck run: say where
                _flight.attach(exc, source=self._rendezvous)
            self._rendezvous.abort(exc)

    def _finish_run(self) -> list[Any]:
        with self._lock:
            results = self._results
            clean = self._broken is None and not self._errors
        if clean:  # the per-step case
            self._rendezvous.reset()
            self._abandoned = None
            return results
        with self._lock:
            errors = list(self._errors)
            broken = self._broken
        self._reset()  # for the next run, whatever happened in this one
        self._abandoned = None
        if broken is not None:
            raise _outcome(errors, broken)
        return results

    def _reset(self) -> None:
        """Clear a broken run's failure and rendezvous state."""
        with self._lock:
            self._broken = None
            self._errors = []
            self._interrupted_at = None
        self._rendezvous.reset()

    def _recover(self) -> None:
        """Before a run: finish cleaning up after a run its caller abandoned.

        That run is aborted, so its replica threads leave `fn` at their next collective
        or when `fn` returns; wait for them a little. Replica 0 ran on the caller's
        thread, and cooperative replicas were unwound by the scheduler: neither is still
        running.

        Raises:
            RuntimeError: a replica thread is still inside the abandoned run's `fn`.
        """
        if self._abandoned == "threads":
            deadline = time.monotonic() + tuning.TUNING.recover_wait_seconds
            while any(self._running[1:]):
                if time.monotonic() >= deadline:
                    stuck = [i for i in range(1, self._n) if self._running[i]]
                    raise RuntimeError(
                        f"{self._name}: replicas {stuck} are still inside the function of a "
                        "run that was interrupted (KeyboardInterrupt); they are stuck in "
                        "user code and leave when it returns or at their next collective. "
                        "This strategy can run again once they have; meanwhile use a new "
                        "strategy."
                    )
                time.sleep(tuning.TUNING.recover_poll_seconds)
        self._done_wake.acquire(False)  # the abandoned run's last release, if not taken
        self._reset()
        self._abandoned = None


def _outcome(
    errors: list[tuple[float, int, BaseException]], broken: BaseException
) -> BaseException:
    """The exception a failed run raises, with the others named in notes.

    The caller's own errors (replica -1) come first, then those a replica's code raised
    (lowest replica first), then the disagreements the rendezvous found: the same choice
    whatever the thread timing, so every execution mode ends a program the same way.
    """
    if not errors:
        return broken
    ranked = sorted(errors, key=lambda e: (e[1] >= 0, is_rendezvous_error(e[2]), e[1], e[0]))
    first = ranked[0][2]
    seen = {(type(first), str(first))}
    for _, replica, other in ranked[1:]:
        if other is first or (type(other), str(other)) in seen:
            continue
        seen.add((type(other), str(other)))
        first.add_note(f"replica {replica} also raised {type(other).__name__}: {other}")
    return first


def _batch_scheduling() -> None:
    """Put the calling replica thread under SCHED_BATCH where it runs under the default policy.

    Linux only (elsewhere, or where the call is refused, the thread keeps its policy); a
    thread the user gave a policy of its own (real-time, idle) keeps it.
    """
    if _BATCH_POLICY is None:
        return
    try:
        if os.sched_getscheduler(0) == os.SCHED_OTHER:
            os.sched_setscheduler(0, _BATCH_POLICY, os.sched_param(0))
    except OSError:  # pragma: no cover - a sandbox that refuses it: the default policy
        pass


def _locked() -> Any:
    """A raw lock, already held: `release()` wakes the one thread blocked in `acquire()`."""
    lock = _thread.allocate_lock()
    lock.acquire()
    return lock
