"""One collective in flight, and how its waits are sliced: shared by the communicator parts."""

from __future__ import annotations

import dataclasses
import time
from typing import Final

import torch

from crossdevice._comm.workers.health import PeerFailure

__all__ = ["MIN_WAIT_SECONDS", "POLL_SECONDS", "Call", "PeersFailedError"]

#: How long one wait on a process group's work (or a shared-memory round) lasts before
#: the store is consulted about failed and dead peers. Work that completes in time pays
#: nothing extra.
POLL_SECONDS: Final = 0.25

#: Shortest wait asked of a work: c10d counts whole milliseconds, and 0 ms means "the
#: group's own timeout" (measured: a 0.27 ms wait blocked until Gloo's timeout).
MIN_WAIT_SECONDS: Final = 0.005


@dataclasses.dataclass
class Call:
    """One numbered collective in flight."""

    name: str
    seq: int
    timeout: float
    started: float
    speculated: bool = False  # its data went with the fingerprints (speculation.py)
    #: The results, when the data went through shared memory (one per non-empty buffer).
    outputs: list[torch.Tensor] | None = None

    @property
    def label(self) -> str:
        """`all_reduce #7`."""
        return f"{self.name} #{self.seq}"

    def remaining(self) -> float:
        """Seconds left before the collective's timeout."""
        return self.started + self.timeout - time.monotonic()


class PeersFailedError(Exception):
    """Internal: the store says peers failed while we waited."""

    def __init__(self, failures: list[PeerFailure]) -> None:
        super().__init__(", ".join(f.reason for f in failures))
        self.failures = failures
