"""One collective in flight, and what every part of a communicator knows about it.

A `Call` is one numbered collective: its name, number and deadline. A `Standing` is the
communicator's state that its parts share (integrity, health, transports): this worker's
rank, the workers' replica counts, and why the communicator refuses collectives.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

__all__ = [
    "GAVE_UP",
    "TIMED_OUT",
    "Call",
    "PeerFailure",
    "PeersFailedError",
    "Standing",
    "WaitFailedError",
    "timed_out",
    "told",
]

#: How the abort record of a worker that gave up on dead peers begins
#: (`HealthBoard.give_up`).
GAVE_UP: Final = "gave up on rank(s) ["
#: How the abort record of a worker whose own collective timed out begins (`timed_out`).
TIMED_OUT: Final = "timed out after "


@dataclasses.dataclass
class Call:
    """One numbered collective in flight."""

    name: str
    seq: int
    timeout: float
    started: float
    #: What it is for, in the user's words (`crossdevice._core.purpose`), or "".
    purpose: str = ""
    #: The state every worker's call must carry alike (`purpose.agreeing`; 0: none), and
    #: what it stands for in words (called only for a mismatch message).
    state: int = 0
    state_text: Callable[[], str] | None = None
    #: When its work (the last part so far) ended (`time.monotonic()`; 0: not yet).
    ended: float = 0.0
    #: Its fingerprint (an encoded header or a `Fingerprint`), for the flight recorder.
    fingerprint: Any = None
    #: Whether its layout was predicted ("right"), guessed wrong ("wrong": a zero
    #: all-reduce of the guessed layout went first), or not predicted (""): a trace says.
    guess: str = ""

    @property
    def label(self) -> str:
        """`all_reduce #7`, or `all_reduce #7 (reading SyncOnReadVariable 'm:0', ...)`."""
        if self.purpose:
            return f"{self.name} #{self.seq} ({self.purpose})"
        return f"{self.name} #{self.seq}"

    def remaining(self) -> float:
        """Seconds left before the collective's timeout."""
        return self.started + self.timeout - time.monotonic()


@dataclasses.dataclass
class Standing:
    """What every part of one communicator knows: who this worker is, whether it is broken.

    Attributes:
        rank: this worker's rank.
        world_size: number of workers.
        replicas: every rank's local replica count, once agreed (None before).
        broken: why the communicator refuses collectives (None: it does not).
    """

    rank: int
    world_size: int
    replicas: list[int] | None = None
    broken: str | None = None

    def local_count(self) -> int:
        """This worker's local replica count (0 before it was agreed)."""
        return 0 if self.replicas is None else self.replicas[self.rank]

    def replica_ids(self, ranks: Sequence[int]) -> str:
        """` (global replicas [2, 3])` when the replica counts are known."""
        if self.replicas is None:
            return ""
        ids: list[int] = []
        for rank in ranks:
            start = sum(self.replicas[:rank])
            ids.extend(range(start, start + self.replicas[rank]))
        return f" (global replicas {ids})"


def timed_out(call: Call) -> str:
    """The abort record of this worker's own timeout in `call` (`Sequencer.guard`)."""
    return f"{TIMED_OUT}{call.timeout:g} s in {call.label}, waiting for its peers"


def told(text: str) -> str:
    """What a peer did, as its abort record `text` says: a `PeerFailure`'s reason."""
    return text if text.startswith((TIMED_OUT, GAVE_UP)) else f"raised {text}"


@dataclasses.dataclass(frozen=True)
class PeerFailure:
    """A worker that failed: its rank and what we know about why."""

    rank: int
    reason: str  # "raised ValueError: ..." or "stopped sending heartbeats ..."
    died: bool  # dead (no heartbeat, store gone) rather than aborted by an exception
    #: It gave up on *this* worker, which it declared dead (`HealthBoard.give_up`).
    gave_up_on_us: bool = False


class PeersFailedError(Exception):
    """Internal: the store says peers failed while we waited."""

    def __init__(self, failures: list[PeerFailure]) -> None:
        super().__init__(", ".join(f.reason for f in failures))
        self.failures = failures


class WaitFailedError(Exception):
    """Internal: a wait ended without its collective (timeout, failed peers, a broken link).

    `cause` is what ended it: a TimeoutError, a `PeersFailedError`, or the process group's
    own error. The communicator turns it into the error that names the ranks at fault.
    """

    def __init__(self, cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
