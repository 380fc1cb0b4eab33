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
the holder (in this process: the live manager to close or to reuse). Unfinished writes a
crash left behind (hidden `.ckpt-N.tmp-*` directories, `.checkpoint.tmp-*` files) are
removed when the lock is taken.

Every manager, on every worker, reads the directory the same way at construction (so
every worker's `checkpoints` is the chief's, and each save updates them alike). The
rename of a checkpoint into place is its commit, so a complete `ckpt-N` on disk newer
than every listed one (a crash after the rename, before the `checkpoint` file recorded
it; or a lost `checkpoint` file) is listed again and becomes the latest, with a log
line. A listed checkpoint without its index is skipped with a log line, and a save of
its number moves it aside (`ckpt-N.incomplete-<time>`) rather than failing forever.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import logging
import os
import re
import shutil
import socket
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from crossdevice._train import job, storage
from crossdevice._train.checkpoint import Checkpoint, PathLike, check_between_steps
from crossdevice._train.recovery import Listing, index_time, scan, set_aside
from crossdevice._train.state_file import STATE_FILE, CheckpointState, read_state, write_state

__all__ = ["CheckpointManager", "live_manager"]

_LOG: Final = logging.getLogger("crossdevice")
_LOCK_FILE: Final = ".lock"
#: The open managers of this process, by resolved directory (the newest one of each).
_MANAGERS: weakref.WeakValueDictionary[str, CheckpointManager] = weakref.WeakValueDictionary()


def _key(directory: Path) -> str:
    return str(directory.resolve())


def live_manager(directory: PathLike, checkpoint: Checkpoint) -> CheckpointManager | None:
    """This process's open manager of `checkpoint` in `directory`, if there is one."""
    manager = _MANAGERS.get(_key(Path(os.fspath(directory))))
    return manager if manager is not None and manager.checkpoint is checkpoint else None


def _try_lock(directory: Path) -> int | str:
    """Take the directory's writer lock: the file descriptor holding it, or the holder."""
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
        return holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.ctime()}".encode(), 0)
    return fd


def _lock(directory: Path) -> int:
    """Take the directory's writer lock; the file descriptor holds it."""
    got = _try_lock(directory)
    if isinstance(got, int):
        return got
    if _key(directory) in _MANAGERS:  # held in this process
        # A manager nothing refers to any more, not yet collected (a reference cycle),
        # lets go when it is: a notebook cell run again after `del manager`.
        gc.collect()
        got = _try_lock(directory)
        if isinstance(got, int):
            return got
        other = _MANAGERS.get(_key(directory))
        if other is not None:
            raise RuntimeError(
                f"the checkpoint directory {str(directory)!r} is in use by another "
                f"CheckpointManager of this process (pid {os.getpid()}: {other!r}, still "
                "open); expected one manager per directory, since two would delete each "
                "other's checkpoints. Use that manager (PreemptionCheckpointHandler(None, "
                "manager) takes it, and so does PreemptionCheckpointHandler(None, checkpoint, "
                "checkpoint_dir) for the same Checkpoint), or call close() on it first (when "
                "running a notebook cell again: close the old manager before making a new one)"
            )
    raise RuntimeError(
        f"the checkpoint directory {str(directory)!r} is in use by another "
        f"CheckpointManager ({got}): two jobs writing one directory would delete each "
        "other's checkpoints. Give each job its own directory, or stop the other job"
    )


def _clear_leftovers(directory: Path) -> None:
    """Remove what a crash left: hidden write directories and `checkpoint` temp files."""
    state_tmp = re.compile(rf"^\.{re.escape(STATE_FILE)}\.tmp-\d+$")
    own = f".{STATE_FILE}.tmp-{os.getpid()}"
    for stale in directory.iterdir():
        if storage.TMP_PATTERN.match(stale.name) and stale.is_dir():
            storage.discard(stale)
        elif state_tmp.match(stale.name) and stale.name != own and stale.is_file():
            with contextlib.suppress(OSError):
                stale.unlink()


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
            _clear_leftovers(self._directory)
        # Every worker reads the directory alike: the same checkpoints, the same latest.
        listing = scan(self._directory, checkpoint_name, read_state(self._directory), max_to_keep)
        self._kept: list[tuple[str, float]] = listing.kept
        self._last_preserved = listing.last_preserved
        self._latest = listing.latest
        if self._writer:
            self._report(listing)
        _MANAGERS[_key(self._directory)] = self

    def _report(self, listing: Listing) -> None:
        """Log what the directory's reading repaired, and record the checkpoints found."""
        state_file = str(self._directory / STATE_FILE)
        for path in listing.skipped:
            _LOG.warning(
                "crossdevice: the checkpoint %s is listed in %s but %s: skipped, the latest "
                "is %s. A save of its number moves it aside",
                path,
                state_file,
                f"its {storage.INDEX_FILE} is missing or unreadable (incomplete or damaged)"
                if Path(path).exists()
                else "is gone (deleted?)",
                self._latest,
            )
        if listing.adopted:
            why = (
                "it is missing (deleted?)"
                if listing.state_missing
                else "they are complete but were not recorded (a crash after the write, "
                "before the record)"
            )
            _LOG.warning(
                "crossdevice: found checkpoints %s in %s that %s does not list: %s; listed "
                "them again, the latest is now %s",
                [Path(p).name for p in listing.adopted],
                self._directory,
                state_file,
                why,
                self._latest,
            )
            self._write_state()

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
        check_between_steps("CheckpointManager.save()")
        last_step = self._last_step
        if self._interval is not None:
            step = int(self._step_counter)
            if last_step is not None and (
                step == last_step or (check_interval and step < last_step + self._interval)
            ):
                return None
            self._last_step = step
        checkpoint = self._checkpoint
        checkpoint.sync()
        try:
            with checkpoint._next_save() as counter:
                number = counter if checkpoint_number is None else int(checkpoint_number)
                path = f"{self._prefix}-{number}"
                if self._writer and Path(path).exists():
                    self._make_room(Path(path), number)
                when = time.time()
                record = None if not self._writer else lambda: self._record(path, when)
                saved = checkpoint._save(Path(path), record)
        except BaseException:
            self._last_step = last_step  # a failed save is no save: the interval still counts
            raise
        if not self._writer:
            # The chief's `_record`, without the files: every worker lists the same.
            self._add(path, when)
            self._retain()
        return saved

    def _make_room(self, path: Path, number: int) -> None:
        """`path` exists: move it aside if it is no checkpoint, else refuse to overwrite it."""
        if path.is_dir() and index_time(str(path)) is None:
            aside = set_aside(path)
            _LOG.warning(
                "crossdevice: %s is no complete checkpoint (its %s is missing or unreadable): "
                "moved aside to %s to save a new checkpoint under its name; delete it once "
                "you no longer need it",
                path,
                storage.INDEX_FILE,
                aside,
            )
            return
        if self._latest is None:
            known = "this manager lists no checkpoint"
        else:
            known = f"the latest is {self._latest!r}"
        raise FileExistsError(
            f"cannot save {str(path)!r}: it exists already (checkpoints are never overwritten; "
            f"expected a new number, got {number} from the save_counter). The directory holds "
            f"an earlier run's checkpoints ({known}): call restore_or_initialize() first to "
            "continue that run, or save into another directory"
        )

    def _add(self, path: str, now: float) -> None:
        """Make `path` the newest kept checkpoint and the latest."""
        self._kept = [(p, t) for p, t in self._kept if p != path] + [(path, now)]
        self._latest = path

    def _retain(self) -> list[str]:
        """Drop what is beyond `max_to_keep` from the list; return what to delete."""
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
        return doomed

    def _record(self, path: str, now: float) -> None:
        """After the write: record, delete what is beyond `max_to_keep`, record again."""
        self._add(path, now)
        self._write_state()
        doomed = self._retain()
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
        check_between_steps("restore_or_initialize()")
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
            if _MANAGERS.get(_key(self._directory)) is self:
                del _MANAGERS[_key(self._directory)]
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
