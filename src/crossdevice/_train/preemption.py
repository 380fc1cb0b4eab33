"""`PreemptionCheckpointHandler` and `TerminationConfig` (TF's `tf.distribute.experimental`).

The handler wraps each training step (`run(step_fn, ...)`). At construction it restores
the latest checkpoint. When a termination notice reaches any one worker (SIGTERM by
default, or a `termination_watcher_fn` that returns True), every worker saves the same
step and exits: after a step the workers agree, with one small all-reduce, whether
any of them was told to stop, and since synchronous workers are at the same step, they
save the same one, wait for the chief's write to be durable, and exit with
`RESTART_EXIT_CODE` (42, TF's code on platforms it does not know), which a launcher such
as `torchrun --max-restarts=N` answers by starting the job again; the handler of the new
job restores that checkpoint.

A worker that dies instead (SIGKILL, a crash) cannot save. Its peers learn of it in their
next collective within seconds (`WorkerFailedError`, from the health checks of
`MultiWorkerMirroredStrategy`), and the handler makes them exit with the restart code too,
so the launcher restarts the job from the last periodic checkpoint rather than waiting
on a hung one (`run` covers its step; `watch_preemption_scope()` covers a whole loop).
Save periodically with the same manager for that case.

Where TF uses its coordination service (a background thread, keys in a store) we use
the strategy's own all-reduce: on several workers one small collective every
`TUNING.preemption_agree_seconds` of steps (every step, when steps are longer), none in
one process, and no dependency on how the workers talk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Final

import numpy as np

from crossdevice._core import tuning
from crossdevice._core.errors import CollectiveTimeoutError, WorkerFailedError
from crossdevice._strategies.context import has_strategy
from crossdevice._train import job, trackable
from crossdevice._train.checkpoint import Checkpoint
from crossdevice._train.manager import CheckpointManager, live_manager

__all__ = ["RESTART_EXIT_CODE", "PreemptionCheckpointHandler", "TerminationConfig"]

_LOG: Final = logging.getLogger("crossdevice")

RESTART_EXIT_CODE: Final = 42
"""The exit code after a preemption save or a peer's death (TF's default: 42).

Non-zero, so that a launcher restarts the job: `torchrun --max-restarts=N` restarts it
on any non-zero exit (each restart uses one of the N), as Borg does for TF.
"""
#: TF's margin before a grace period's end: this many mean step times, for the save.
_GRACE_STEPS: Final = 6
_MAX_INTERVAL: Final = 10_000


class _RunCount:
    """`total_run_calls` as checkpoint state (TF's `checkpointed_runs`), read at each save."""

    def __init__(self) -> None:
        self.runs = 0

    def state_dict(self) -> dict[str, Any]:
        return {"runs": np.int64(self.runs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.runs = int(state["runs"])


def _exit_for_restart() -> None:
    sys.exit(RESTART_EXIT_CODE)


class TerminationConfig:
    """How a `PreemptionCheckpointHandler` learns of termination and how it exits (TF's).

    Args:
        termination_watcher_fn: a function returning True once the worker is about to
            be terminated, polled every second on a daemon thread; default: a SIGTERM
            handler (installed from the main thread).
        exit_fn: what to call after the preemption save; default
            `sys.exit(RESTART_EXIT_CODE)` (42). Exit non-zero so the launcher restarts.
        grace_period: seconds between the notice and the kill. Above 0, the workers save
            at once and go on training until a few step times before the end, then
            save again and exit. Default 0: save and exit at once.
        save_fn: called instead of the manager's `save` for the preemption save.
    """

    def __init__(
        self,
        termination_watcher_fn: Callable[[], bool] | None = None,
        exit_fn: Callable[[], Any] | None = None,
        grace_period: float | None = None,
        save_fn: Callable[[], Any] | None = None,
    ) -> None:
        for name, fn in (("termination_watcher_fn", termination_watcher_fn), ("exit_fn", exit_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function or None, got {fn!r}")
        if save_fn is not None and not callable(save_fn):
            raise TypeError(f"save_fn must be a function or None, got {save_fn!r}")
        if grace_period is not None and (
            isinstance(grace_period, bool)
            or not isinstance(grace_period, int | float)
            or grace_period < 0
        ):
            raise ValueError(f"grace_period must be a number of seconds >= 0, got {grace_period!r}")
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn if exit_fn is not None else _exit_for_restart
        self.grace_period = float(grace_period or 0)
        self.save_fn = save_fn

    def __repr__(self) -> str:
        return (
            f"TerminationConfig(termination_watcher_fn={self.termination_watcher_fn!r}, "
            f"exit_fn={self.exit_fn!r}, grace_period={self.grace_period!r}, "
            f"save_fn={self.save_fn!r})"
        )


class PreemptionCheckpointHandler:
    """Saves every worker's state at the same step when any worker is told to stop (TF's).

    Args:
        cluster_resolver: the job's cluster resolver (TF needs it; here the workers come
            from the strategy, so it is only kept, and may be None).
        checkpoint_or_checkpoint_manager: a `CheckpointManager` (used for the restore at
            construction and for the preemption save; save periodic checkpoints with it
            too), or a `Checkpoint` (then the open `CheckpointManager` of this process
            for that checkpoint in `checkpoint_dir` is used, or else a manager keeping one
            checkpoint there is made).
        checkpoint_dir: the directory, when a `Checkpoint` is given.
        termination_config: a `TerminationConfig`.

    Example (one process; `torchrun` for several workers)::

        manager = crossdevice.train.CheckpointManager(ckpt, "ckpts", max_to_keep=3)
        handler = crossdevice.experimental.PreemptionCheckpointHandler(None, manager)
        while handler.total_run_calls < STEPS:       # resumes where the last job stopped
            handler.run(train_step, next(iterator))  # SIGTERM: save, exit(42)
    """

    def __init__(
        self,
        cluster_resolver: Any,
        checkpoint_or_checkpoint_manager: Checkpoint | CheckpointManager,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        termination_config: TerminationConfig | None = None,
    ) -> None:
        given = checkpoint_or_checkpoint_manager
        if isinstance(given, CheckpointManager):
            manager = given
        elif isinstance(given, Checkpoint):
            if checkpoint_dir is None:
                raise ValueError(
                    "When a checkpoint is passed, a checkpoint_dir must be passed as well "
                    "(or pass a crossdevice.train.CheckpointManager)"
                )
            # TF's pattern: periodic saves with a manager, and a handler given the same
            # checkpoint and directory. Two managers on one directory would delete each
            # other's checkpoints: the handler saves with the open one of this process.
            live = live_manager(checkpoint_dir, given)
            manager = live or CheckpointManager(given, checkpoint_dir, max_to_keep=1)
        else:
            raise TypeError(
                "checkpoint_or_checkpoint_manager must be a crossdevice.train.Checkpoint or "
                f"CheckpointManager, got {given!r}"
            )
        config = termination_config or TerminationConfig()
        if not isinstance(config, TerminationConfig):
            raise TypeError(f"termination_config must be a TerminationConfig, got {config!r}")
        self._cluster_resolver = cluster_resolver
        self._config = config
        self._manager = manager
        self._checkpoint = manager.checkpoint
        self._strategy = self._checkpoint._strategy()  # the scope's, as TF's handler
        if self._checkpoint._scope_strategy is None and has_strategy():
            # Built under the scope (as TF's handler is): later saves use that strategy.
            self._checkpoint.__dict__["_scope_strategy"] = self._strategy
        self._count = _RunCount()
        self._checkpoint.checkpointed_runs = self._count
        manager.restore_or_initialize()
        self._notice = threading.Event()
        self._notice_time = 0.0
        self._deadline: float | None = None
        self._finished = False  # saved for the last time (an exit_fn that returned)
        self._mean_step = 0.0
        self._workers, worker = job.worker_position(self._strategy)
        self._chief = worker == 0
        self._boundaries = 0  # step boundaries seen (save_checkpoint_if_preempted calls)
        self._next_agreement = 1
        self._last_boundary: float | None = None
        self._boundary_time = 0.0  # mean seconds between boundaries (chief's proposal)
        #: Each tracked LR scheduler's `last_epoch` when the last `run` returned.
        self._schedules: dict[str, int] | None = None
        self._warned = False
        self._watch()

    # --- notices --------------------------------------------------------------------------
    def _note(self) -> None:
        if not self._notice.is_set():
            self._notice_time = time.monotonic()
            self._notice.set()

    def _watch(self) -> None:
        watcher = self._config.termination_watcher_fn
        if watcher is None:
            if threading.current_thread() is not threading.main_thread():
                raise ValueError(
                    "PreemptionCheckpointHandler installs a SIGTERM handler, which Python "
                    "allows only on the main thread; build it there, or pass "
                    "TerminationConfig(termination_watcher_fn=...)"
                )
            signal.signal(signal.SIGTERM, lambda signum, frame: self._note())
            return

        def poll() -> None:
            while not self._notice.wait(tuning.TUNING.preemption_watch_seconds):
                if watcher():
                    self._note()

        threading.Thread(target=poll, name="crossdevice-termination-watcher", daemon=True).start()

    # --- the step boundary ----------------------------------------------------------------
    @property
    def total_run_calls(self) -> int:
        """How many `run` calls this job has made, counting those of earlier launches."""
        return self._count.runs

    def run(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one training step; then, if any worker was told to stop, save and exit.

        Wrap exactly one step: the workers agree after each call. The check comes after
        the step (TF checks before it), so a checkpoint holds the data position of the
        batches trained on, also when the batch was fetched for this call
        (`handler.run(step, next(iterator))`). A peer's death during the step makes this
        worker exit with `RESTART_EXIT_CODE` instead of waiting.

        Returns:
            What `distributed_train_function(*args, **kwargs)` returned.
        """
        self._check_schedulers()
        start = time.monotonic()
        try:
            result = distributed_train_function(*args, **kwargs)
        except (WorkerFailedError, CollectiveTimeoutError) as err:
            self._exit_after_failure(err)
        elapsed = time.monotonic() - start
        self._count.runs += 1
        self._mean_step += (elapsed - self._mean_step) / min(self._count.runs, 100)
        self.save_checkpoint_if_preempted()
        self._schedules = _schedules(self._checkpoint)
        return result

    def _check_schedulers(self) -> None:
        """Warn, once, of a tracked LR scheduler stepped between two `run` calls.

        A preemption saves inside `run`, right after the step: a scheduler stepped after
        `run` in the loop body (torch's per-iteration idiom, or a per-epoch schedule at
        the epoch's end) has not stepped for that step yet, and the resumed job runs on
        one schedule step behind the data, silently (the bug hunt of session 57).
        """
        if self._schedules is None or self._warned:
            return
        now = _schedules(self._checkpoint)
        moved = [name for name, epoch in now.items() if self._schedules.get(name, epoch) != epoch]
        if moved:
            self._warned = True
            warnings.warn(
                f"the LR scheduler(s) {moved} stepped between PreemptionCheckpointHandler.run "
                "calls: a preemption saves inside run, right after the step, before such a "
                "scheduler steps for it, so the job resumed from that checkpoint would run "
                "one schedule step behind. Step it inside the function given to run (a "
                "per-epoch schedule: on the epoch's last step)",
                UserWarning,
                stacklevel=3,
            )

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """Context manager: a peer's death anywhere inside exits with `RESTART_EXIT_CODE`.

        `run` covers its step; wrap the whole training loop to cover what happens
        between steps too, such as `next(iterator)` (which agrees with the other workers
        whether any has data). Other errors pass through. When the loop ends, the workers
        agree once more, so that a notice that came after their last agreement (less than
        `TUNING.preemption_agree_seconds` before the end) still saves and exits.

        Example::

            with handler.watch_preemption_scope():
                for batch in dist_dataset:
                    handler.run(train_step, batch)
        """
        try:
            yield
        except (WorkerFailedError, CollectiveTimeoutError) as err:
            self._exit_after_failure(err)
        self._next_agreement = self._boundaries + 1  # agree now, whatever the interval
        self.save_checkpoint_if_preempted()

    def save_checkpoint_if_preempted(self) -> None:
        """At a step boundary: if any worker was told to stop, save (and exit) now.

        `run` calls it after each step; call it yourself at each step boundary if your
        loop does not go through `run`. Every worker must call it at the same steps.
        """
        if self._finished:
            return
        if self._deadline is None:
            flag = self._notice.is_set()
        else:
            flag = time.monotonic() >= self._deadline
        if not self._agree(flag):
            return
        path = self._save()
        grace = self._config.grace_period
        if grace > 0 and self._deadline is None:
            since = time.monotonic() - self._notice_time if self._notice.is_set() else 0.0
            self._deadline = time.monotonic() + grace - since - _GRACE_STEPS * self._mean_step
            _LOG.warning(
                "crossdevice: termination notice; saved %s at step %d, training on for the "
                "grace period",
                path,
                self._count.runs,
            )
            return
        _LOG.warning(
            "crossdevice: termination notice; saved %s at step %d; exiting for a restart",
            path,
            self._count.runs,
        )
        self._finished = True
        self._config.exit_fn()

    def _agree(self, flag: bool) -> bool:
        """Whether any worker has `flag` set; every worker gets the same answer.

        One process: the flag itself. Several: at agreed boundaries only, an all-reduce
        of `[flag, interval]`, in which the chief proposes how many boundaries to the
        next agreement (about `TUNING.preemption_agree_seconds` of steps), so that short
        steps do not each pay for a collective; the boundaries in between say no at once.
        """
        now = time.monotonic()
        if self._last_boundary is not None:
            elapsed = now - self._last_boundary
            mean = self._boundary_time
            self._boundary_time = elapsed if mean == 0 else mean + (elapsed - mean) / 10
        self._last_boundary = now
        if self._workers == 1:
            return flag
        self._boundaries += 1
        if self._boundaries < self._next_agreement:
            return False
        interval = 0
        if self._chief:  # one interval for all; before any timing, the next boundary
            seconds = self._boundary_time
            interval = (
                1 if seconds == 0 else round(tuning.TUNING.preemption_agree_seconds / seconds)
            )
            interval = max(1, min(_MAX_INTERVAL, interval))
        try:
            flags, interval = job.sum_over_workers(
                self._strategy, np.asarray([int(flag), interval])
            )
        except (WorkerFailedError, CollectiveTimeoutError) as err:
            self._exit_after_failure(err)
        self._next_agreement = self._boundaries + max(1, int(interval))
        return bool(flags > 0)

    def _save(self) -> str | None:
        if self._config.save_fn is not None:
            self._config.save_fn()
            path = None
        else:
            path = self._manager.save(check_interval=False)
        # The write is durable on the chief before anyone exits (a launcher that sees one
        # worker leave stops the others).
        self._manager.sync()
        job.barrier(self._strategy)
        return path

    def _exit_after_failure(self, error: BaseException) -> None:
        _LOG.error(
            "crossdevice: a worker failed (%s: %s); exiting with code %d so the launcher "
            "restarts the job from the last checkpoint",
            type(error).__name__,
            error,
            RESTART_EXIT_CODE,
        )
        try:
            self._manager.sync()  # a periodic checkpoint still being written
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            # Not sys.exit: tearing down a process group whose peer died can block.
            os._exit(RESTART_EXIT_CODE)

    def __repr__(self) -> str:
        return f"PreemptionCheckpointHandler({self._manager!r}, total_run_calls={self._count.runs})"


def _schedules(checkpoint: Checkpoint) -> dict[str, int]:
    """The `last_epoch` of each LR scheduler `checkpoint` tracks (by name; at the top)."""
    objects = checkpoint.__dict__.get("_objects", {})
    return {
        name: int(getattr(obj, "last_epoch", 0))
        for name, obj in objects.items()
        if trackable.is_scheduler(obj)
    }
