"""`CooperativeScheduler`: a step's replicas as greenlets taking turns on the caller's thread.

The wait primitive they park in (`block`) and why this mode exists are in
`crossdevice._sync.waiting`; this module is the scheduler that runs the replicas,
resumes each one whose gate was released, and switches each replica's thread-local state
(context stack, device scope, torch grad mode) in and out with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from crossdevice._core import context, devices, tuning
from crossdevice._core.errors import ReplicaAbortedError
from crossdevice._sync.waiting import greenlet_module, swap_hub, torch_c
from crossdevice._trace import flight as _flight

__all__ = ["CooperativeScheduler", "ReplicaState"]

_greenlet = greenlet_module()

#: What a replica greenlet hands back when its job is done (anything else: it parked).
_DONE: Final = object()


class ReplicaState:
    """The thread-local state of one cooperative replica, swapped in while it runs.

    Attributes:
        stack: its context stack (`context.swap_stack`).
        device_stack: its device-scope stack (`devices.swap_device_stack`).
        grad_enabled: torch's grad mode, or None where torch is not imported.
    """

    __slots__ = ("device_stack", "grad_enabled", "stack")

    def __init__(
        self, stack: list[Any], device_stack: list[str], grad_enabled: bool | None
    ) -> None:
        self.stack = stack
        self.device_stack = device_stack
        self.grad_enabled = grad_enabled


class CooperativeScheduler:
    """Runs one job per replica as greenlets on the calling thread (see the module doc).

    Args:
        num_replicas: how many replicas.
        run_replica: `run_replica(i, fn, args, kwargs)` runs replica `i`'s job; it must
            not raise (the runner records a replica's error and returns).
        fail: `fail(exc)` breaks the run: it records `exc` for the caller and releases
            every waiter (the replicas then return with `ReplicaAbortedError`).
    """

    def __init__(
        self,
        num_replicas: int,
        run_replica: Callable[[int, Callable[..., Any], tuple[Any, ...], dict[str, Any]], None],
        fail: Callable[[BaseException], None],
    ) -> None:
        if _greenlet is None:
            raise RuntimeError(
                "cooperative replica execution needs the greenlet package, which is not "
                "installed; pip install greenlet, or use replica threads "
                "(crossdevice.config.set_replica_execution('threads'))"
            )
        self._n = num_replicas
        self._run_replica = run_replica
        self._fail = fail
        # Greenlets belong to the thread that made them: one set per calling thread.
        self._local = threading.local()
        # Consecutive stalls with no deadline in this run (the second is a bug).
        self._stalls = 0
        # The greenlets of the latest run, whichever thread ran it (flight-recorder stacks).
        self._latest: list[Any] = []
        _flight.register_stacks(self, CooperativeScheduler._parked_frames)

    def run(
        self,
        jobs: Sequence[tuple[int, Callable[..., Any], tuple[Any, ...], dict[str, Any]]],
        states: Sequence[ReplicaState],
    ) -> None:
        """Run `jobs[i]` (`(i, fn, args, kwargs)`) as replica `i` with `states[i]`; wait for all.

        Returns when every replica's job has returned. A failure inside the scheduler
        itself (a KeyboardInterrupt while it sleeps) is handed to `fail`, the replicas
        are run to their end, and it returns: the runner raises the recorded error. A
        second one while they drain is raised, after the replicas still parked are
        unwound with ReplicaAbortedError.
        """
        hub = _greenlet.getcurrent()
        greenlets = self._greenlets(hub)
        n = self._n
        parked: list[tuple[Any, float | None] | None] = [None] * n
        previous_hub = swap_hub(hub)
        self._stalls = 0
        try:
            failed = False
            for i in range(n):
                self._resume(greenlets, states, parked, i, jobs[i])
            while any(entry is not None for entry in parked):
                try:
                    self._step(greenlets, states, parked)
                except BaseException as exc:  # reported through fail(), then drained
                    if failed:
                        raise  # failing again while draining: give the greenlets up
                    failed = True
                    self._fail(exc)
        except BaseException as exc:
            # Failing again while draining: unwind every replica still parked (a
            # ReplicaAbortedError where it waits), so that each leaves `fn` and reports
            # itself done now rather than when its greenlet is collected, mid-way through
            # some later run. The runner then raises this second error; anything the
            # unwinding raises is named on it rather than lost.
            for i, entry in enumerate(parked):
                if entry is not None:
                    parked[i] = None
                    try:
                        self._resume(greenlets, states, parked, i, ReplicaAbortedError())
                    except BaseException as other:
                        exc.add_note(
                            f"unwinding replica {i} also raised {type(other).__name__}: {other}"
                        )
            self._local.greenlets = None  # parked or broken greenlets are never reused
            self._latest = []  # nor kept for reports: they may go now
            raise
        finally:
            swap_hub(previous_hub)

    # --- scheduling -----------------------------------------------------------------------
    def _greenlets(self, hub: Any) -> list[Any]:
        greenlets: list[Any] | None = getattr(self._local, "greenlets", None)
        if greenlets is None or any(g.dead for g in greenlets):
            greenlets = [_greenlet.greenlet(self._serve) for _ in range(self._n)]
            self._local.greenlets = greenlets
        for g in greenlets:
            if g.parent is not hub:  # run() called from another greenlet of this thread
                g.parent = hub
        self._latest = greenlets
        return greenlets

    def _parked_frames(self) -> list[tuple[str, Any]]:
        """(name, top frame) of each replica greenlet parked mid-job: its stack is in no thread's.

        The running one's is (its thread's); an idle one's ends in `_serve` (no user code).
        """
        out = []
        for i, g in enumerate(self._latest):
            frame = None if g.dead else g.gr_frame
            if frame is not None and frame.f_code is not CooperativeScheduler._serve.__code__:
                out.append((f"cooperative replica {i} (a greenlet, parked)", frame))
        return out

    def _serve(self, job: tuple[int, Callable[..., Any], tuple[Any, ...], dict[str, Any]]) -> None:
        """A replica greenlet's life: run a job, report it done, wait for the next."""
        while True:
            self._run_replica(*job)
            job = _greenlet.getcurrent().parent.switch(_DONE)

    def _resume(
        self,
        greenlets: list[Any],
        states: Sequence[ReplicaState],
        parked: list[tuple[Any, float | None] | None],
        i: int,
        value: Any,
    ) -> None:
        """Switch to replica `i` with its state until it parks (in `parked[i]`) or is done."""
        state = states[i]
        hub_stack = context.swap_stack(state.stack)
        hub_devices = devices.swap_device_stack(state.device_stack)
        torch_module = torch_c()
        hub_grad = None
        if torch_module is not None:
            hub_grad = torch_module.is_grad_enabled()
            torch_module._set_grad_enabled(
                hub_grad if state.grad_enabled is None else state.grad_enabled
            )
        try:
            # A job (i, fn, args, kwargs) starts a replica; True/False answer its wait;
            # an exception is raised where it waits.
            if isinstance(value, BaseException):
                out = greenlets[i].throw(value)
            else:
                out = greenlets[i].switch(value)
        finally:
            state.stack = context.swap_stack(hub_stack)
            state.device_stack = devices.swap_device_stack(hub_devices)
            if torch_module is not None:
                state.grad_enabled = torch_module.is_grad_enabled()
                torch_module._set_grad_enabled(hub_grad)
        if out is not _DONE:
            parked[i] = out

    def _step(
        self,
        greenlets: list[Any],
        states: Sequence[ReplicaState],
        parked: list[tuple[Any, float | None] | None],
    ) -> None:
        """Resume every parked replica whose gate was released; handle a stall."""
        moved = False
        for i, entry in enumerate(parked):
            if entry is not None and entry[0].acquire(False):
                parked[i] = None
                moved = True
                self._resume(greenlets, states, parked, i, True)
        if moved:
            self._stalls = 0
        else:
            self._stalled(greenlets, states, parked)

    def _stalled(
        self,
        greenlets: list[Any],
        states: Sequence[ReplicaState],
        parked: list[tuple[Any, float | None] | None],
    ) -> None:
        """Every unfinished replica waits and none can go on: time one out, or fail."""
        waits = [(entry[1], i) for i, entry in enumerate(parked) if entry is not None]
        deadlines = [(d, i) for d, i in waits if d is not None]
        if not deadlines:
            self._stalls += 1
            if self._stalls > 1:  # failing the run released nobody: never spin on it
                raise RuntimeError(
                    "crossdevice bug: a failed cooperative run did not release its waiting "
                    "replicas; please report it (crossdevice.config.set_replica_execution"
                    "('threads') avoids this mode meanwhile)"
                )
            ids = [i for _, i in waits]
            # On threads they would wait for ever: every peer they wait for waits too.
            self._fail(
                RuntimeError(
                    f"replicas {ids} all wait in a rendezvous and none of them can go on: "
                    "they called different collectives (merge_call, all_reduce, ...) or "
                    "called them in a different order. Every replica must make the same "
                    "collective calls in the same order."
                )
            )
            return
        deadline, i = min(deadlines)
        delay = deadline - time.monotonic()
        if delay > 0:
            # Sleep in slices: another thread (an abort) may release a gate meanwhile.
            time.sleep(min(delay, tuning.TUNING.stall_poll_seconds))
            return
        entry = parked[i]
        assert entry is not None
        parked[i] = None
        self._resume(greenlets, states, parked, i, entry[0].acquire(False))
