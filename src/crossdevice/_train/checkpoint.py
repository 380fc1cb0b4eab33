"""`Checkpoint`: TF's `tf.train.Checkpoint` for crossdevice programs.

Every keyword argument is an object to track (`trackable`); attributes assigned later
are tracked too. A checkpoint also holds, without being asked, the global random state
of every worker (`global_random`: NumPy, Python, torch and CUDA generators, which also
seed the per-replica torch streams), so that a restored run draws what the saved one
would have drawn.

A save is one collective step of the job and one write: every worker captures the state
(reading sync-on-read variables and gathering random states are collectives), only the
chief writes (`storage`: DCP or `.npz`, written aside and renamed into place), and it
writes off the training thread (`writer`). `save` returns once the state is staged: one
in-memory copy. A second save, a restore and `sync()` wait for the write in flight.

A restore reads the whole checkpoint, checks every value against its object (shapes and
dtypes, module keys, counts, states: `trackable.validate`) before it loads anything, then
loads. It changes every object or none: should a load still fail (a hook, a state no
check foresaw), what was loaded is put back (`rollback.snapshot`, taken before the first
load) and the error says so; TF and torch leave a half-restored model there, which a
caller that catches the error and trains on (from the previous checkpoint, or afresh)
would silently train. Values whose object is not tracked yet wait for it: assigning
`ckpt.name = obj` later restores into `obj` then (TF's restore-on-create), as one load.

In a job of several workers, every worker restores, and the workers agree first (one
small collective) on what they restore: the same checkpoint (name, save counter and the
id each save writes) or nothing. A worker that sees another checkpoint, or none (its
directory is not on a file system every worker sees), is an error on every worker before
anything is loaded, instead of workers training on from different states. TF does not
check this. After loading they agree again (a second small collective): a load that
failed on one worker is put back on every worker.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import numpy as np

from crossdevice._arrays import global_random, is_torch
from crossdevice._core import context
from crossdevice._strategies.context import get_strategy, has_strategy
from crossdevice._train import job, rollback, storage, trackable, tree
from crossdevice._train.state_file import (
    CheckpointState,
    latest_checkpoint,
    read_state,
    write_state,
)
from crossdevice._train.status import CheckpointLoadStatus, InitializationOnlyStatus
from crossdevice._train.writer import BackgroundWriter, Stager, wait_for_path
from crossdevice._values.variables import Variable

__all__ = ["Checkpoint"]

_LOG: Final = logging.getLogger("crossdevice")
#: Array keys of the workers' random states (no tracked name starts with it).
_RANDOM: Final = "_crossdevice_random"
_RESERVED: Final = frozenset({"save_counter", "save", "write", "restore", "read", "sync"})

PathLike = str | os.PathLike[str]


def check_between_steps(call: str) -> None:
    """Raise unless in cross-replica context: a checkpoint is saved and restored between steps.

    Called first, before anything is changed (a counter, a variable, a file): inside
    `strategy.run` each replica would save or restore on its own.
    """
    frame = context.current_frame()
    if frame is not None and frame.replica_context is not None:
        raise RuntimeError(
            f"{call} was called inside strategy.run (in a replica context, once per "
            f"replica); expected between steps, once per worker: call {call} outside "
            "strategy.run, after the step returns. Nothing was saved or restored"
        )


class _Counter(Variable):
    """A plain int64 variable, never mirrored by a strategy in scope: a checkpoint's counter."""


def _to_library(array: Any, lib: str) -> Any:
    if lib == "numpy":
        return array.numpy() if is_torch(array) else array
    if is_torch(array):
        return array
    import torch

    return torch.from_numpy(np.asarray(array))


class Checkpoint:
    """Groups objects to save and restore together (TF's `tf.train.Checkpoint`).

    Args:
        **objects: what to track, by name: `crossdevice.Variable`s, torch modules and
            optimizers (mirrored or not), LR schedulers, `GradScaler`s, distributed
            datasets and iterators, random generators, anything with `state_dict()` and
            `load_state_dict()`, and lists, tuples and dicts of these.

    Example:
        >>> import tempfile, numpy as np, crossdevice
        >>> step = crossdevice.Variable(np.int64(0))
        >>> ckpt = crossdevice.train.Checkpoint(step=step)
        >>> path = ckpt.save(tempfile.mkdtemp() + "/ckpt")
        >>> _ = step.assign(7)
        >>> ckpt.restore(path).assert_consumed()
        CheckpointLoadStatus(..., matched=['step'])
        >>> int(step.numpy())
        0
    """

    def __init__(self, **objects: Any) -> None:
        self.__dict__.update(
            _objects={},
            _pending={},
            _matched=set(),
            _writer=BackgroundWriter(),
            _stager=Stager(),
            _save_counter=_Counter(
                np.int64(0), name="save_counter", trainable=False, device="CPU:0"
            ),
            # TF builds checkpoints under `strategy.scope()`: that strategy is the job's.
            _scope_strategy=get_strategy() if has_strategy() else None,
        )
        for name, obj in objects.items():
            setattr(self, name, obj)

    # --- tracking -------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _RESERVED or name.startswith("_"):
            raise AttributeError(
                f"{name!r} cannot name a tracked object: it is a Checkpoint attribute or "
                "starts with '_'; choose another name"
            )
        trackable.check_trackable(value, name)
        pending = self._pending.get(name)
        if pending is not None:  # restore-on-create: a failed one tracks nothing, keeps the value
            where = f"the value for {name!r} held since the last restore"
            try:
                trackable.validate(value, pending, name)
            except Exception as err:
                err.add_note(f"{where} was not loaded: nothing was changed or tracked.")
                raise
            self._load(where, {name: (value, pending)}, None, None, agree=False)
            del self._pending[name]
            self._matched.add(name)
        self._objects[name] = value

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"this Checkpoint tracks no {name!r} (it tracks {sorted(objects)!r})")

    @property
    def save_counter(self) -> Variable:
        """How many times `save` has run (restored with the checkpoint), an int64 Variable."""
        return self.__dict__["_save_counter"]

    def _strategy(self) -> Any:
        """The job's strategy: a tracked object's, the scope's at construction, or now."""
        strategy = next(
            (s for s in map(trackable.strategy_of, self._objects.values()) if s is not None),
            self._scope_strategy or get_strategy(),
        )
        if job.worker_position(strategy)[0] == 1 and job.torch_world_size() > 1:
            raise RuntimeError(
                f"this process is one of {job.torch_world_size()} workers (torch.distributed), "
                f"but the checkpoint found no multi-worker strategy (it found {strategy!r}), "
                "so every worker would write it. Create the Checkpoint under "
                "`with strategy.scope():` of your MultiWorkerMirroredStrategy, or track an "
                "object of that strategy"
            )
        return strategy

    # --- saving ---------------------------------------------------------------------------
    def save(self, file_prefix: PathLike, options: Any = None) -> str:
        """Save to `file_prefix-N` (`N` = `save_counter` after adding one) and record it.

        The directory's `checkpoint` file then names it the latest. Every worker must
        call it; only the chief writes. The write continues on a background thread after
        this returns (`sync()` waits for it).

        Args:
            file_prefix: the path prefix, e.g. `"/tmp/run/ckpt"`.
            options: accepted for TF compatibility and ignored.

        Returns:
            The checkpoint's path.
        """
        del options
        check_between_steps("save()")
        self._writer.wait()
        with self._next_save() as counter:
            path = Path(f"{os.fspath(file_prefix)}-{counter}")
            return self._save(path, lambda: _record(path))

    @contextlib.contextmanager
    def _next_save(self) -> Iterator[int]:
        """Add one to `save_counter` for a save; a save that raises takes it back.

        `_save` raises only before its write starts (a refused state, a bad path), so a
        failed save leaves the counter, like everything else, as it was.
        """
        counter = int(self.save_counter.numpy())
        self.save_counter.assign(np.int64(counter + 1), read_value=False)
        try:
            yield counter + 1
        except BaseException:
            self.save_counter.assign(np.int64(counter), read_value=False)
            raise

    def write(self, file_prefix: PathLike, options: Any = None) -> str:
        """Save to exactly `file_prefix`, with no counter and no `checkpoint` file (TF's).

        Args:
            file_prefix: the checkpoint's path.
            options: accepted for TF compatibility and ignored.

        Returns:
            The checkpoint's path.
        """
        del options
        check_between_steps("write()")
        return self._save(Path(os.fspath(file_prefix)), None)

    def sync(self) -> None:
        """Wait until the last save is on disk; raise its error if the write failed."""
        self._writer.wait()

    def _save(self, path: Path, after: Callable[[], None] | None) -> str:
        """Save to `path` (all workers); the chief's writer runs `after` once it is durable."""
        check_between_steps("save()")
        self._writer.wait()
        strategy = self._strategy()
        workers, index = job.worker_position(strategy)
        # The state first: one that cannot be saved (`tree.encode`) fails before any file
        # or directory is made.
        arrays: dict[str, Any] = {}
        with job.collective_call(f"saving the checkpoint {str(path)!r}", "save()"):
            objects = {
                name: tree.encode(trackable.capture(obj), (name,), arrays)
                for name, obj in self._objects.items()
            }
            states = job.gather_states(strategy, global_random.capture())
            randoms = {f"worker_{w}": state for w, state in enumerate(states)}
            random_skeleton = tree.encode(randoms, (_RANDOM,), arrays)
            tmp: Path | None = None
            error: BaseException | None = None
            if index == 0:
                try:
                    tmp = storage.prepare(path)
                except OSError as err:
                    error = err
            try:
                failed = workers > 1 and job.any_worker(strategy, error is not None)
            except BaseException:
                if tmp is not None:
                    storage.discard(tmp)
                raise
        if failed and error is None:
            raise RuntimeError(
                f"the chief could not start writing the checkpoint {str(path)!r}; its error "
                "says why"
            )
        if error is not None:
            raise error
        if tmp is None:
            return str(path)
        try:
            staged = self._stager.stage(arrays)
        except BaseException:
            storage.discard(tmp)
            raise
        index_data = {
            "objects": objects,
            "random": random_skeleton,
            "save_counter": int(self.save_counter.numpy()),
            # Tells this save from another one of the same name (another run's ckpt-1).
            "id": uuid.uuid4().hex,
            "job": {"workers": workers, "num_replicas_in_sync": strategy.num_replicas_in_sync},
        }

        def write() -> None:
            storage.write(tmp, path, index_data, staged)
            if after is not None:
                after()

        self._writer.submit(write, str(path))
        return str(path)

    # --- restoring ------------------------------------------------------------------------
    def restore(self, save_path: PathLike | None, options: Any = None) -> Any:
        """Restore every tracked object (and `save_counter`) from a checkpoint.

        Every value is checked against its object before anything is loaded. Values for
        objects not tracked yet are loaded when they are assigned (`ckpt.name = obj`).

        Args:
            save_path: a path `save` or a manager returned; None restores nothing.
            options: accepted for TF compatibility and ignored.

        Returns:
            A `CheckpointLoadStatus` (`assert_consumed()` and friends); for None an
            `InitializationOnlyStatus`, whose assertions fail.

        Every worker of a multi-worker job must call it (with None too), with the same
        checkpoint: the workers check that they agree before anything is loaded.

        A restore that raises has changed nothing, on no worker: no tracked object, no
        random state, not `save_counter` (what it had loaded is put back).

        Raises:
            FileNotFoundError: no checkpoint at `save_path`.
            ValueError: the checkpoint is incomplete or truncated, or a value does not
                fit its object (names the key, shapes and dtypes).
            RuntimeError: the workers would restore different checkpoints (or some none),
                or another worker could not restore (names each worker's checkpoint), or
                loading an object failed after the checks (names it; chained to its error).
        """
        del options
        check_between_steps("restore()")
        if save_path is None:
            self._agree(None, None, None)
            return InitializationOnlyStatus()
        return self._restore(Path(os.fspath(save_path)))

    def read(self, save_path: PathLike, options: Any = None) -> CheckpointLoadStatus:
        """Restore from a checkpoint `write` made (see `restore`)."""
        del options
        check_between_steps("read()")
        return self._restore(Path(os.fspath(save_path)))

    def _restore(self, path: Path) -> CheckpointLoadStatus:
        self._writer.wait()
        wait_for_path(str(path))
        existed = path.is_dir()
        try:
            index = storage.read_index(path)
            arrays = storage.read_arrays(path, index, index.get("arrays", {}))
            saved = {
                name: tree.decode(skeleton, arrays, _to_library)
                for name, skeleton in index.get("objects", {}).items()
            }
            present = [name for name in self._objects if name in saved]
            for name in present:
                trackable.validate(self._objects[name], saved[name], name)
            randoms = self._random_state(tree.decode(index.get("random", {}), arrays, _to_library))
        except Exception as err:
            unchanged = f"The checkpoint {str(path)!r} was not restored: nothing was changed."
            if existed and not path.is_dir():  # retention deleted it under the read
                deleted = _deleted_while_read(path, err)
                deleted.add_note(unchanged)
                self._agree(path, None, deleted)
                raise deleted from err
            err.add_note(unchanged)
            self._agree(path, None, err)
            raise
        self._agree(path, index, None)
        loads = {name: (self._objects[name], saved[name]) for name in present}
        counter = np.int64(index.get("save_counter", 0))
        self._load(f"the checkpoint {str(path)!r}", loads, randoms, counter, agree=True)
        matched = set(present)
        self.__dict__["_matched"] = matched
        self.__dict__["_pending"] = {k: v for k, v in saved.items() if k not in matched}
        return CheckpointLoadStatus(str(path), lambda: set(self._objects), set(saved), matched)

    def _agree(
        self, path: Path | None, index: dict[str, Any] | None, error: BaseException | None
    ) -> None:
        """With several workers: raise unless every worker restores what this one does.

        One collective, on every worker alike (also when this one failed, so that no peer
        waits for it); none in a one-worker job.
        """
        strategy = self._strategy()
        workers, worker = job.worker_position(strategy)
        if workers == 1:
            return
        if error is not None:
            what = "failed"
        elif path is None or index is None:
            what = "no checkpoint (None)"
        else:
            saved_id = f", save id {index['id']}" if "id" in index else ""  # older: no id
            what = f"{path.name} (save_counter {index.get('save_counter')!r}{saved_id})"
        call = "restore(None)" if path is None else f"restore() of {str(path)!r}"
        with job.collective_call(call, "restore()"):
            rows = [
                row.partition("\n") for row in job.gather_texts(strategy, f"{what}\n{path or ''}")
            ]
        if error is not None:
            return  # the caller raises this worker's own error
        failed = [w for w, (key, _, _) in enumerate(rows) if key == "failed"]
        if failed:
            raise RuntimeError(
                f"worker(s) {failed} could not restore the checkpoint (their errors say why), "
                f"so worker {worker} restored nothing either: the workers must restore the "
                "same state"
            )
        if len({key for key, _, _ in rows}) > 1:
            seen = "; ".join(
                f"worker {w}: {key}" + (f" at {where!r}" if where else "")
                for w, (key, _, where) in enumerate(rows)
            )
            raise RuntimeError(
                "the workers would restore different checkpoints and train on from different "
                f"states ({seen}); nothing was restored. Every worker must restore the same "
                "checkpoint: keep the checkpoint directory on a file system every worker sees "
                "(a shared file system), and pass every worker the same path"
            )

    def _load(
        self,
        what: str,
        loads: dict[str, tuple[Any, Any]],
        random: Any,
        counter: np.int64 | None,
        *,
        agree: bool,
    ) -> None:
        """Load each `(object, state)` of `loads`, the random state and `save_counter`: all or none.

        What a load overwrites is kept first (`rollback.snapshot`); should a load fail, on
        this worker or (`agree`: one collective) on another, what was loaded is put back,
        and the error says so.
        """
        undos: list[tuple[str, Callable[[], Any]]] = []
        failed: tuple[str, Exception] | None = None
        name = ""
        try:
            for name, (obj, state) in loads.items():
                undos.append((name, rollback.snapshot(obj)))
                trackable.apply(obj, state)
            if random is not None:
                name = "the global random state"
                undos.append(
                    (name, functools.partial(global_random.restore, global_random.capture()))
                )
                global_random.restore(random)
            if counter is not None:
                name, count = "save_counter", self.save_counter
                undos.append(
                    (name, functools.partial(count.assign, count.numpy(), read_value=False))
                )
                count.assign(counter, read_value=False)
        except Exception as err:
            failed = (name, err)
        except BaseException:  # KeyboardInterrupt: put back, and no collective
            _undo(undos, what, None)
            raise
        try:
            peers = self._loaded_everywhere(what, failed is not None) if agree else []
        except BaseException:  # a peer died or stalled: it may not have loaded
            _undo(undos, what, failed)
            raise
        if failed is None and not peers:
            return
        _undo(undos, what, failed)
        if failed is None:
            raise RuntimeError(
                f"{what} was not restored: worker(s) {peers} could not load it (their errors "
                "say why), so this worker put back everything it had loaded: nothing was "
                "changed, on any worker (the workers must hold the same state)"
            )
        name, error = failed
        raise RuntimeError(
            f"{what} was not restored: loading {name!r} failed ({type(error).__name__}: {error}) "
            "after every value had passed the checks against its object. It and everything "
            "loaded before it were put back as they were: nothing was changed. Track there an "
            "object as it was when the checkpoint was written, or restore another checkpoint"
        ) from error

    def _loaded_everywhere(self, what: str, failed: bool) -> list[int]:
        """The workers whose load failed (one collective; none in a one-worker job)."""
        strategy = self._strategy()
        if job.worker_position(strategy)[0] == 1:
            return []
        with job.collective_call(f"restore() of {what}", "restore()"):
            rows = job.gather_texts(strategy, "failed" if failed else "loaded")
        return [w for w, row in enumerate(rows) if row == "failed"]

    def _random_state(self, randoms: dict[str, Any]) -> Any:
        """This worker's random state in a checkpoint's (None if it holds none)."""
        if not randoms:
            return None
        workers, worker = job.worker_position(self._strategy())
        if len(randoms) != workers:
            _LOG.info(
                "the checkpoint was written by %d workers and this job has %d: every worker "
                "takes worker 0's random state",
                len(randoms),
                workers,
            )
            worker = 0
        if f"worker_{worker}" not in randoms:
            raise ValueError(
                f"the checkpoint's random states are {sorted(randoms)!r}, expected "
                f"'worker_{worker}' among them: the checkpoint is damaged; restore another"
            )
        return randoms[f"worker_{worker}"]

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._objects)})"


def _deleted_while_read(path: Path, error: Exception) -> FileNotFoundError:
    """The error of a read whose checkpoint vanished under it (not a damaged checkpoint)."""
    try:
        newer = latest_checkpoint(path.parent)
    except ValueError:  # a damaged `checkpoint` file: the advice below still holds
        newer = None
    now = f"latest_checkpoint() now names {newer!r}" if newer else "see latest_checkpoint()"
    return FileNotFoundError(
        f"the checkpoint {str(path)!r} was deleted while it was being read (expected it to "
        f"stay until read; the read failed with {type(error).__name__}): a CheckpointManager "
        "that saves into that directory deletes checkpoints beyond max_to_keep. Restore a "
        f"newer checkpoint ({now}), or read while no job saves there"
    )


def _undo(undos: list[tuple[str, Callable[[], Any]]], what: str, failed: Any) -> None:
    """Run `undos`, last first; if one fails, run the rest and raise: the state is then mixed."""
    broken: list[tuple[str, Exception]] = []
    for name, undo in reversed(undos):
        try:
            undo()
        except Exception as err:
            broken.append((name, err))
    if broken:
        name, error = broken[0]
        cause = f"loading {failed[0]!r} failed ({failed[1]})" if failed else "a worker failed"
        raise RuntimeError(
            f"{what} was not restored: {cause}, and putting back {name!r} failed too "
            f"({type(error).__name__}: {error}), so {[n for n, _ in broken]!r} may be left part "
            "restored. Rebuild those objects (or restart the program) before training on"
        ) from error


def _record(path: Path) -> None:
    """Name `path` the latest in its directory's `checkpoint` file (what TF's save does)."""
    directory = path.parent
    state = read_state(directory) or CheckpointState()
    target = str(path)
    state.paths = [p for p in state.paths if p != target] + [target]
    state.timestamps = [*state.timestamps, os.path.getmtime(path)][-len(state.paths) :]
    state.latest = target
    write_state(directory, state)
