"""How `strategy.run` executes replicas: replica threads, cooperative replicas, or "auto".

A mode changes speed, never meaning (docs/design.md §3): every replica meets its peers in one
rendezvous (`crossdevice._sync.rendezvous`), which detects every disagreement the
same way on threads and cooperatively, so a program has the same results and the same
exceptions in every mode. What only replica threads honour is a replica waiting for a peer
*outside* the library (a user's `threading.Barrier` or `Event` between replicas):
cooperative replicas take turns on one thread, so such a wait never ends there, as in
TF, which also runs a step's replicas one after another. That is why the default is
`"threads"`, and why `"auto"`, which may pick cooperative replicas for a step function
measured to be faster that way, is opt-in (Horovod's autotuner is opt-in for the same
reason): its choice is made once per step function, logged at INFO on the `crossdevice`
logger, and reported by `ReplicaRunner.execution_choices` (a strategy's
`extended.replica_execution_choices()`).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from typing import Any, Final, Literal

from crossdevice._core import tuning
from crossdevice._core.coerce import coerce_enum
from crossdevice._sync import waiting

__all__ = [
    "EXECUTION_MODES",
    "Tuner",
    "get_replica_execution",
    "set_replica_execution",
    "tuning_key",
]

_LOG: Final = logging.getLogger("crossdevice")


#: `set_replica_execution` choices: replica threads only (the default), cooperative
#: replicas (greenlets on the caller's thread) only, or pick per step function by timing
#: both once.
class ExecutionMode(enum.StrEnum):
    """How `strategy.run` executes in-process host replicas (see `set_replica_execution`)."""

    THREADS = "threads"
    COOPERATIVE = "cooperative"
    AUTO = "auto"


EXECUTION_MODES: Final = tuple(m.value for m in ExecutionMode)

_execution: list[str] = ["threads"]


def set_replica_execution(mode: Literal["auto", "threads", "cooperative"]) -> None:
    """Choose how `strategy.run` executes the replicas of in-process host strategies.

    * `"threads"` (default): one long-lived thread per replica; replicas compute in
      parallel wherever NumPy or torch release the GIL.
    * `"cooperative"`: every replica is a greenlet on the caller's thread and runs until
      it waits in a collective, then the next one runs. No thread hand-offs (a small step
      costs a fraction of the threaded one) and no parallel compute. The context, the
      device scope and torch's grad mode are kept per replica; torch's inference mode
      and autocast are the caller's, as on threads. A replica must not wait for a peer
      outside the library's collectives (TF's rule): that wait would never end.
    * `"auto"`: replica threads, except for step functions measured (over their first
      runs) to be faster as cooperative replicas; the choice is made once per step
      function and logged at INFO on the `crossdevice` logger.

    It applies to MirroredStrategy and CentralStorageStrategy on CPU devices;
    MultiWorkerMirroredStrategy and GPU replicas always use threads. Results and
    exceptions are the same in every mode.

    Args:
        mode: one of `EXECUTION_MODES`.

    Raises:
        ValueError: an unknown mode, or a cooperative mode without greenlet installed.
    """
    mode = coerce_enum(
        mode, ExecutionMode, message="replica execution must be one of {choices}, received {value}"
    ).value
    if mode != "threads" and not waiting.available():
        raise ValueError(
            f"replica execution {mode!r} needs the greenlet package, which is not "
            "installed: pip install greenlet (or choose 'threads')"
        )
    _execution[0] = mode


def get_replica_execution() -> str:
    """The mode set by `set_replica_execution` ("threads" unless changed)."""
    return _execution[0]


class Tuner:
    """Per step function: run it on threads and cooperatively, then keep the faster mode.

    A new function runs on threads. If that took under `TUNING.auto_try_below_seconds`,
    it is tried cooperatively `SAMPLES` times, and threads `SAMPLES` times; then the mode with the
    smaller median is chosen for good (logged once). Medians, not averages: one run
    stalled by the machine (a GC pause, another process) must not decide. The choice is
    never revisited: a mode that flips back and forth with the machine's load would make
    a step's behaviour depend on it.
    """

    SAMPLES: Final = 3
    MAX_FUNCTIONS: Final = 256

    def __init__(self, name: str) -> None:
        self._name = name
        self._stats: dict[Any, _StepTimes] = {}

    def choose(self, key: Any) -> bool:
        """Whether the next run of `key` should be cooperative."""
        stats = self._stats.get(key)
        if stats is None:
            return False
        if stats.choice is not None:
            return stats.choice == "cooperative"
        threads, coop = stats.times
        if threads and min(threads) >= tuning.TUNING.auto_try_below_seconds:
            self._decide(key, stats, "threads")
            return False
        if len(coop) < self.SAMPLES:
            return True
        if len(threads) < self.SAMPLES:
            return False
        faster = "cooperative" if _median(coop) < _median(threads) else "threads"
        self._decide(key, stats, faster)
        return faster == "cooperative"

    def record(self, key: Any, coop: bool, seconds: float) -> None:
        """Add one run's wall time to `key`'s times in its mode (until it is decided)."""
        stats = self._stats.get(key)
        if stats is None:
            if len(self._stats) >= self.MAX_FUNCTIONS:
                self._stats.clear()
            stats = self._stats[key] = _StepTimes()
        if stats.choice is None:
            stats.times[1 if coop else 0].append(seconds)

    def choices(self) -> dict[str, str]:
        """The mode chosen for each step function decided so far, by its name."""
        return {
            _name_of(key): stats.choice
            for key, stats in self._stats.items()
            if stats.choice is not None
        }

    def _decide(self, key: Any, stats: _StepTimes, choice: str) -> None:
        stats.choice = choice
        threads, coop = (_median(t) * 1e6 for t in stats.times)
        _LOG.info(
            "%s: replica execution 'auto' chose %s for step function %s "
            "(median run: threads %.0f us, cooperative %.0f us)",
            self._name,
            choice,
            _name_of(key),
            threads,
            coop,
        )


class _StepTimes:
    """Run times of one step function, [threads, cooperative], and its choice once made."""

    __slots__ = ("choice", "times")

    def __init__(self) -> None:
        self.times: tuple[list[float], list[float]] = ([], [])
        self.choice: str | None = None


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2] if times else math.inf


def _name_of(key: Any) -> str:
    name = getattr(key, "co_qualname", None) or getattr(key, "__qualname__", None)
    return str(name) if name else repr(key)


def tuning_key(fn: Callable[..., Any]) -> Any:
    """What identifies a step function across calls (a new lambda each step shares code)."""
    code = getattr(fn, "__code__", None)
    if code is not None:
        return code
    try:
        hash(fn)
    except TypeError:
        return None
    return fn
