"""Saving off the training thread: one staged copy, one write in flight.

`Stager.stage` copies every array of a checkpoint into buffers it keeps from one save to
the next, so the training thread pays one in-memory copy of the state and nothing else:
after it returns, training may change the model freely (the staged copy is what gets
written; torch's `async_save` users met the opposite, pytorch/pytorch#144657).

`BackgroundWriter` runs each write on its own thread, at a lower priority than training
(`WRITER_NICENESS`). A second write waits for the first (TF's async checkpoint keeps one
write in flight, too), and an error of a write is raised on the training thread at the
next `submit` or `wait`. Writer threads are not daemons:
the interpreter finishes a pending write before it exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

import numpy as np

from crossdevice._arrays import is_torch
from crossdevice._core import tuning

__all__ = [
    "WRITER_NICENESS",
    "BackgroundWriter",
    "Stager",
    "wait_for_path",
]

_LOG: Final = logging.getLogger("crossdevice")

#: The writer thread runs this much nicer than training (Linux, best effort): the write
#: is background work. With 25M parameters on a loaded 2-core VM, a training step took
#: 1.67x and 1.80x its time while a write ran at the same priority, 1.19x and 1.30x with
#: it 10 nicer (benchmarks/checkpoint_stall.py, A B A B), and the write was no slower.
WRITER_NICENESS: Final = 10


#: Writes in flight in this process, by checkpoint path: a restore of that path waits.
_IN_FLIGHT: dict[str, BackgroundWriter] = {}
_IN_FLIGHT_LOCK: Final = threading.Lock()


def wait_for_path(path: str, *, inside: bool = False) -> None:
    """Wait for writes in flight in this process of `path` (or, `inside`, of paths in it).

    Whichever checkpoint started them; an error is left to that checkpoint's next call.
    """
    with _IN_FLIGHT_LOCK:
        writers = [
            writer
            for what, writer in _IN_FLIGHT.items()
            if what == path or (inside and os.path.dirname(what) == path)
        ]
    for writer in writers:
        thread = writer._thread
        if thread is not None:
            thread.join(tuning.TUNING.checkpoint_write_timeout_seconds)


def _same_layout(buffer: Any, array: Any) -> bool:
    return tuple(buffer.shape) == tuple(array.shape) and buffer.dtype == array.dtype


def _lower_priority() -> None:
    """Make the calling thread `WRITER_NICENESS` nicer (Linux threads are tasks)."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        niceness = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, niceness + WRITER_NICENESS))


class Stager:
    """Private host copies of a checkpoint's arrays, in buffers reused across saves."""

    def __init__(self) -> None:
        self._buffers: dict[str, Any] = {}

    def stage(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
        """Copy every array (device tensors to host memory); the copies are the write's.

        Call it only once the previous write has finished: its buffers are reused.
        """
        staged: dict[str, Any] = {}
        for key, array in arrays.items():
            buffer = self._buffers.get(key)
            if is_torch(array):
                if buffer is None or not is_torch(buffer) or not _same_layout(buffer, array):
                    import torch

                    buffer = torch.empty(tuple(array.shape), dtype=array.dtype, device="cpu")
                buffer.copy_(array)
            else:
                host = np.asarray(array)
                if buffer is None or is_torch(buffer) or not _same_layout(buffer, host):
                    buffer = np.empty(host.shape, dtype=host.dtype)
                np.copyto(buffer, host)
            staged[key] = buffer
        self._buffers = staged
        return staged


class BackgroundWriter:
    """Runs one write at a time on its own thread and reports its error later."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._what = ""

    @property
    def pending(self) -> bool:
        """Whether a write is still running."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], None], what: str) -> None:
        """Wait for the previous write (raising its error), then start `write`."""
        self.wait()
        self._what = what
        thread = threading.Thread(
            target=self._run, args=(write,), name="crossdevice-checkpoint-writer"
        )
        self._thread = thread
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT[what] = self
        thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        _lower_priority()
        try:
            write()
        except BaseException as err:
            self._error = err
            _LOG.error(
                "writing the checkpoint %s failed: %s: %s", self._what, type(err).__name__, err
            )
        finally:
            with _IN_FLIGHT_LOCK:
                if _IN_FLIGHT.get(self._what) is self:
                    del _IN_FLIGHT[self._what]

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the write in flight; raise its error, if it failed.

        Args:
            timeout: seconds; None: `TUNING.checkpoint_write_timeout_seconds`.

        Raises:
            TimeoutError: it has not finished within `timeout` seconds.
        """
        thread = self._thread
        if timeout is None:
            timeout = tuning.TUNING.checkpoint_write_timeout_seconds
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(
                    f"the checkpoint {self._what} is still being written after {timeout:.0f} s; "
                    "is its file system responding?"
                )
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
