"""`trace(path)`: record a timeline of every step, and report stragglers, while inside.

One trace at a time per process. It starts at `trace.__enter__` (or at `import
crossdevice` when `CROSSDEVICE_TRACE` names a file, until the process exits) and writes
its file when it ends: `path` itself in a single process; in a job of several workers
one file per worker, `path` with `.worker<rank>` before its suffix (or with `{rank}`
replaced, when `path` holds it). `crossdevice trace merge` puts the workers' files on one
timeline.

The straggler report's window, `report_every` steps (default `DEFAULT_REPORT_EVERY`), is
an argument of `trace` and the environment variable `CROSSDEVICE_TRACE_REPORT_EVERY`
(which `trace` also reads when the argument is not given).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import time
from collections.abc import Iterator
from typing import Any, Final

from crossdevice._core import environment
from crossdevice._trace import state
from crossdevice._trace.recorder import DEFAULT_MAX_BYTES, DEFAULT_STEPS, WORKER_LANE, Recorder
from crossdevice._trace.stragglers import Stragglers, WorkerGaps

__all__ = [
    "DEFAULT_REPORT_EVERY",
    "ENV_REPORT_EVERY",
    "ENV_TRACE",
    "Session",
    "start_from_environment",
    "trace",
    "worker_path",
]

#: Steps per straggler report window, unless told otherwise.
DEFAULT_REPORT_EVERY: Final = 100
#: A file to trace the whole process into.
ENV_TRACE: Final = "CROSSDEVICE_TRACE"
#: The straggler report's window, in steps.
ENV_REPORT_EVERY: Final = "CROSSDEVICE_TRACE_REPORT_EVERY"


class Session:
    """One trace being recorded (see the module doc).

    Args:
        path: the file to write at the end (None: report stragglers, write nothing).
        steps: steps the ring keeps.
        report_every: steps per straggler report window.
        max_bytes: the written file's bound.
    """

    def __init__(self, path: str | None, steps: int, report_every: int, max_bytes: int) -> None:
        if isinstance(report_every, bool) or not isinstance(report_every, int) or report_every < 1:
            raise ValueError(
                f"report_every must be an int >= 1 (steps per straggler report), received "
                f"{report_every!r}"
            )
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a file name (str) or None, received {path!r}")
        self.path = None if path is None else os.fspath(path)
        self.recorder = Recorder(steps, max_bytes)
        self.stragglers = Stragglers()
        self.report_every = report_every
        self.origin = time.monotonic()
        self.wall_origin = time.time()
        self.written: list[str] = []
        #: per worker communicator (its sequencer's id): its gaps, its collective open.
        self._workers: dict[int, _WorkerLane] = {}

    # -- hooks (crossdevice._trace.state) --------------------------------------------

    def step(self, now: float) -> None:
        """A step begins; every `report_every` steps, the in-process straggler report."""
        recorder = self.recorder
        recorder.step(now)
        n = recorder.step_count
        k = self.report_every
        if n > 1 and (n - 1) % k == 0:
            self.stragglers.report(f"in steps {n - k}-{n - 1}")

    def worker_issued(self, sequencer: Any, call: Any, site: str) -> None:
        """A worker communicator issues `call` (from the user's line `site`)."""
        lane = self._workers.get(id(sequencer))
        if lane is None:
            standing = sequencer._standing
            store = getattr(sequencer._health, "_store", None)
            lane = self._workers[id(sequencer)] = _WorkerLane(
                WorkerGaps(standing.rank, standing.world_size, store)
            )
        lane.flush(self.recorder)
        lane.gaps.issued(call.seq, call.started)
        lane.open, lane.site = call, site
        n, k = self.recorder.step_count, self.report_every
        if n and n % k == 0:
            w = n // k
            lane.gaps.window(w, f"in steps {max(1, (w - 2) * k)}-{(w - 1) * k}")

    def worker_ended(self, sequencer: Any, call: Any) -> None:
        """Part of `call` ended at `call.ended` (the last part ends it)."""
        lane = self._workers.get(id(sequencer))
        if lane is not None:
            lane.gaps.ended(call.ended)

    # -- the end ---------------------------------------------------------------------

    def rank(self) -> tuple[int, int] | None:
        """(rank, world size) of this worker, once a worker communicator took part."""
        for lane in self._workers.values():
            return lane.gaps.rank, lane.gaps.world_size
        return None

    def write(self) -> str | None:
        """Write the trace file (see the module doc); its path, or None without one."""
        for lane in self._workers.values():
            lane.flush(self.recorder)
        if self.path is None:
            return None
        placed = self.rank()
        rank, world = placed if placed is not None else (0, 1)
        path = worker_path(self.path, rank, world)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        meta = {
            "crossdevice_trace": 1,
            "rank": rank,
            "world_size": world,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "wall_clock_at_zero": self.wall_origin,
            "steps_recorded": self.recorder.step_count,
            "steps_kept": min(self.recorder.step_count, self.recorder.steps),
            "max_bytes": self.recorder.max_bytes,
        }
        label = f"worker {rank}" if world > 1 else f"crossdevice (pid {os.getpid()})"
        self.recorder.write(path, self.origin, rank, label, meta)
        self.written.append(path)
        return path


class _WorkerLane:
    """A worker communicator's gaps, and its collective whose span is not recorded yet."""

    __slots__ = ("gaps", "open", "site")

    def __init__(self, gaps: WorkerGaps) -> None:
        self.gaps = gaps
        self.open: Any = None
        self.site = ""

    def flush(self, recorder: Recorder) -> None:
        """Record the open collective's span (it ended: the next one is issued)."""
        call, self.open = self.open, None
        if call is None or not call.ended:
            return
        details: dict[str, Any] = {"site": self.site, "rank": self.gaps.rank}
        nbytes = _fingerprint_bytes(call.fingerprint)
        if nbytes is not None:
            details["bytes"] = nbytes
        if call.purpose:
            details["purpose"] = call.purpose
        if call.guess:  # its layout predicted: "right", or "wrong" (zeros went first)
            details["guess"] = call.guess
        recorder.add(
            WORKER_LANE, "collective", call.started, call.ended, (call.name, call.seq, details)
        )


def _fingerprint_bytes(fingerprint: Any) -> int | None:
    if fingerprint is None:
        return None
    nbytes = getattr(fingerprint, "nbytes", None)
    if isinstance(nbytes, int) and not hasattr(fingerprint, "dtype"):
        return nbytes  # a Fingerprint
    try:
        return int(fingerprint[6])  # an encoded header: nbytes is its 7th value
    except (TypeError, IndexError, ValueError):
        return None


def worker_path(path: str, rank: int, world_size: int) -> str:
    """The file worker `rank` writes: `path` alone, else `.worker<rank>` before the suffix."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if world_size <= 1:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.worker{rank}{suffix or '.json'}"


def _start(session: Session) -> None:
    with state._LOCK:
        if state.session is not None:
            raise RuntimeError(
                "crossdevice is already tracing (crossdevice.experimental.trace or "
                f"{ENV_TRACE}); expected one trace at a time, received a second: end the "
                "first one before starting another"
            )
        state.session = session
        state.on = True


def _stop(session: Session) -> str | None:
    with state._LOCK:
        if state.session is not session:
            return None
        state.on = False
        state.session = None
    return session.write()


def _report_every(report_every: int | None) -> int:
    if report_every is not None:
        return report_every
    steps = environment.env_int(ENV_REPORT_EVERY, minimum=1, what="a whole number of steps")
    return DEFAULT_REPORT_EVERY if steps is None else steps


@contextlib.contextmanager
def trace(
    path: str | os.PathLike[str] | None,
    *,
    steps: int = DEFAULT_STEPS,
    report_every: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Iterator[Session]:
    """Record a timeline of the steps run inside, and report stragglers meanwhile.

    The file (Chrome/Perfetto trace-event JSON: open it in https://ui.perfetto.dev or
    chrome://tracing) shows for each replica its compute between collectives, its
    wait at each collective, and the reduction; for a worker, each cross-worker
    collective with its sequence number, kind, bytes and call site. It keeps the last
    `steps` steps and never exceeds `max_bytes`. Across workers each writes its own
    file (`.worker<rank>` before the suffix); `crossdevice trace merge` joins them.

    Every `report_every` steps, a replica (or worker) that arrived last at most
    collectives of the window, by a median of 1 ms or more, is named on the
    `crossdevice` logger with its median and p95 lateness. Quiet otherwise.

    Args:
        path: the trace file to write when the block ends (None: only the straggler
            report).
        steps: how many of the latest steps the trace keeps (default 1000).
        report_every: steps per straggler report (default: `CROSSDEVICE_TRACE_REPORT_EVERY`,
            else 100).
        max_bytes: the file's bound (default 64 MiB).

    Yields:
        The recording (its `written` lists the file once the block has ended).

    Raises:
        RuntimeError: a trace is already being recorded in this process.

    Example:
        >>> import numpy as np, crossdevice
        >>> strategy = crossdevice.MirroredStrategy(["CPU:0"])
        >>> with crossdevice.experimental.trace(None, report_every=50):
        ...     _ = strategy.run(lambda: np.float32(1.0))
    """
    session = Session(
        None if path is None else os.fspath(path), steps, _report_every(report_every), max_bytes
    )
    _start(session)
    try:
        yield session
    finally:
        _stop(session)


def start_from_environment() -> Session | None:
    """At `import crossdevice`: trace the whole process into `CROSSDEVICE_TRACE`, if set."""
    path = os.environ.get(ENV_TRACE, "")
    if not path or state.session is not None:
        return None
    session = Session(path, DEFAULT_STEPS, _report_every(None), DEFAULT_MAX_BYTES)
    _start(session)
    atexit.register(_stop, session)
    return session
