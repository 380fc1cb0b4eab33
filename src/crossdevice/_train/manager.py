"""`CheckpointManager`: TF's `tf.train.CheckpointManager`, one writer per directory.

It numbers checkpoints `ckpt-N`, keeps the newest `max_to_keep` (plus one every
`keep_checkpoint_every_n_hours`), and records them in the directory's `checkpoint` file.
The order after each write is TF's, safe against a crash at any point: record the new
checkpoint, then delete the old ones, then record again. A checkpoint is recorded only
once its write is durable, so `latest_checkpoint` never names one that is not whole
(reading it waits for a write in flight).

Only the chief writes and records; on the other workers the manager computes the same
paths. A directory has one writer: the chief's manager holds a lock on
`<directory>/.lock` (`flock`, released by the kernel when the process dies, so a crashed
job leaves no stale lock), and a second manager on the directory is an error that names
the holder. Unfinished writes a crash left behind (hidden `.ckpt-N.tmp-*` directories)
are removed when the lock is taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from crossdevice._train import job, storage
from crossdevice._train.checkpoint import Checkpoint, PathLike
from crossdevice._train.state_file import CheckpointState, is_complete, read_state, write_state

__all__ = ["CheckpointManager"]

_LOCK_FILE: Final = ".lock"


def _lock(directory: Path) -> int:
    """Take the directory's writer lock; the file descriptor holds it."""
    path = directory / _LOCK_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise OSError(err.errno, storage.unwritable(directory, err)) from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RuntimeError(
            f"the checkpoint directory {str(directory)!r} is in use by another "
            f"CheckpointManager ({holder}): two jobs writing one directory would delete each "
            "other's checkpoints. Give each job its own directory, or stop the other job"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.ctime()}".encode(), 0)
    return fd


def _positive_or_none(value: Any, name: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{name} must be a positive number or None, got {value!r}")


class CheckpointManager:
    """Saves numbered checkpoints into a directory and keeps the newest few (TF's).

    Args:
        checkpoint: the `Checkpoint` to save and restore.
        directory: where the checkpoints go (created if needed).
        max_to_keep: how many to keep (the newest); None keeps all.
        keep_checkpoint_every_n_hours: also keep one checkpoint per this many hours.
        checkpoint_name: the prefix of the checkpoints' names (`ckpt-N`).
        step_counter: a `Variable` (or anything `int()` reads) counting training steps;
            needed with `checkpoint_interval`.
        checkpoint_interval: save only when `step_counter` moved this many steps since
            the last save.
        init_fn: called by `restore_or_initialize` when there is nothing to restore.

    Example:
        >>> import tempfile, numpy as np, crossdevice
        >>> ckpt = crossdevice.train.Checkpoint(step=crossdevice.Variable(np.int64(0)))
        >>> manager = crossdevice.train.CheckpointManager(ckpt, tempfile.mkdtemp(), max_to_keep=2)
        >>> for _ in range(3):
        ...     _ = manager.save()
        >>> tuple(p.rsplit("/", 1)[1] for p in manager.checkpoints)
        ('ckpt-2', 'ckpt-3')
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: PathLike,
        max_to_keep: int | None,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: Any = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], Any] | None = None,
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                f"CheckpointManager needs a crossdevice.train.Checkpoint, got {checkpoint!r}"
            )
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep <= 0
        ):
            raise ValueError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
        _positive_or_none(keep_checkpoint_every_n_hours, "keep_checkpoint_every_n_hours")
        _positive_or_none(checkpoint_interval, "checkpoint_interval")
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError("step_counter should be passed if checkpoint_interval is not None.")
        self._checkpoint = checkpoint
        self._directory = Path(os.fspath(directory))
        self._max_to_keep = max_to_keep
        self._keep_seconds = (
            None if keep_checkpoint_every_n_hours is None else keep_checkpoint_every_n_hours * 3600
        )
        self._prefix = self._directory / checkpoint_name
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        self._init_fn = init_fn
        self._last_step: int | None = None
        _, worker = job.worker_position(checkpoint._strategy())
        self._writer = worker == 0
        self._lock_fd: int | None = None
        if self._writer:
            self._lock_fd = _lock(self._directory)
            for stale in self._directory.iterdir():
                if storage.TMP_PATTERN.match(stale.name) and stale.is_dir():
                    storage.discard(stale)
        state = read_state(self._directory) or CheckpointState()
        kept = [p for p in state.paths if is_complete(p)]
        times = dict(zip(state.paths, state.timestamps, strict=False))
        self._kept: list[tuple[str, float]] = [(p, times.get(p, time.time())) for p in kept]
        self._last_preserved = state.last_preserved or time.time()
        latest = state.latest if state.latest and is_complete(state.latest) else None
        self._latest = latest or (kept[-1] if kept else None)

    # --- what is there --------------------------------------------------------------------
    @property
    def directory(self) -> str:
        """The checkpoint directory."""
        return str(self._directory)

    @property
    def checkpoint(self) -> Checkpoint:
        """The managed `Checkpoint`."""
        return self._checkpoint

    @property
    def checkpoint_interval(self) -> int | None:
        """The minimum number of steps between saves, or None."""
        return self._interval

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint's path, or None; waits for a write in flight."""
        self._checkpoint.sync()
        return self._latest

    @property
    def checkpoints(self) -> list[str]:
        """The kept checkpoints, oldest first (waits for a write in flight)."""
        self._checkpoint.sync()
        return [path for path, _ in self._kept]

    def sync(self) -> None:
        """Wait until the last save is on disk and recorded."""
        self._checkpoint.sync()

    # --- saving ---------------------------------------------------------------------------
    def save(
        self, checkpoint_number: int | None = None, check_interval: bool = True, options: Any = None
    ) -> str | None:
        """Save a new checkpoint `ckpt-N` and drop the ones beyond `max_to_keep`.

        Args:
            checkpoint_number: `N`; default the checkpoint's `save_counter` (which is
                incremented either way, as TF does).
            check_interval: with `checkpoint_interval`, save only if the step counter
                moved that much since the last save.
            options: accepted for TF compatibility and ignored.

        Returns:
            The new checkpoint's path, or None when the interval says not yet.
        """
        del options
        if self._interval is not None:
            step = int(self._step_counter)
            if self._last_step is not None and (
                step == self._last_step
                or (check_interval and step < self._last_step + self._interval)
            ):
                return None
            self._last_step = step
        checkpoint = self._checkpoint
        checkpoint.sync()
        counter = checkpoint.save_counter
        counter.assign_add(1, read_value=False)
        number = int(counter.numpy()) if checkpoint_number is None else int(checkpoint_number)
        path = f"{self._prefix}-{number}"
        if self._writer and Path(path).exists():
            raise FileExistsError(
                f"cannot save {path!r}: it exists already (checkpoints are never overwritten). "
                f"The directory holds an earlier run's checkpoints, the latest "
                f"{self._latest!r}: call restore_or_initialize() first to continue that run, "
                "or save into another directory"
            )
        if not self._writer:
            self._latest = path
            return checkpoint._save(Path(path), None)
        when = time.time()
        return checkpoint._save(Path(path), lambda: self._record(path, when))

    def _record(self, path: str, now: float) -> None:
        """After the write: record, delete what is beyond `max_to_keep`, record again."""
        self._kept = [(p, t) for p, t in self._kept if p != path] + [(path, now)]
        self._latest = path
        self._write_state()
        doomed = []
        while self._max_to_keep is not None and len(self._kept) > self._max_to_keep:
            old, stamp = self._kept.pop(0)
            if (
                self._keep_seconds is not None
                and stamp - self._last_preserved >= self._keep_seconds
            ):
                self._last_preserved = stamp
                continue
            doomed.append(old)
        if doomed:
            self._write_state()
            for old in doomed:
                _delete(Path(old))

    def _write_state(self) -> None:
        write_state(
            self._directory,
            CheckpointState(
                latest=self._latest,
                paths=[p for p, _ in self._kept],
                timestamps=[t for _, t in self._kept],
                last_preserved=self._last_preserved,
            ),
        )

    # --- restoring ------------------------------------------------------------------------
    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint and return its path, or call `init_fn` and return None.

        In a multi-worker job every worker calls it, and the workers check that they
        restore the same checkpoint, or all none (see `Checkpoint.restore`).
        """
        latest = self.latest_checkpoint
        # With None too: every worker takes part in the check that they agree.
        self._checkpoint.restore(latest)
        if latest is not None:
            if self._interval is not None:
                self._last_step = int(self._step_counter)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None

    def close(self) -> None:
        """Wait for the write in flight and release the directory (also at garbage collection)."""
        try:
            self._checkpoint.sync()
        finally:
            fd, self._lock_fd = self._lock_fd, None
            if fd is not None:
                os.close(fd)

    def __del__(self) -> None:
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            # At interpreter teardown `os` may be gone; the kernel releases the lock anyway.
            with contextlib.suppress(Exception):
                os.close(fd)

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self._directory)!r}, max_to_keep={self._max_to_keep})"


def _delete(path: Path) -> None:
    """Delete a checkpoint: hide it first, so a crash mid-delete leaves nothing half there."""
    if not re.search(r"-\d+$", path.name) or not path.is_dir():
        return
    hidden = path.parent / f".{path.name}.tmp-{os.getpid():x}"
    try:
        os.rename(path, hidden)
    except OSError:
        return
    shutil.rmtree(hidden, ignore_errors=True)
