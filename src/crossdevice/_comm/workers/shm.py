"""`SharedMemoryTransport`: all-reduces through `/dev/shm` when every worker shares this host.

The slots, their set-up and the protocol are `shared_memory.py`'s; this transport runs
one all-reduce through them, round by round:

    round 0: this worker's data and its header go into its slots; it arrives; once
        every worker has arrived, every header must equal this one (else: no sums, the
        header exchange follows and names the differences); then each worker sums every
        worker's slots, in rank order, into its own output
    rounds 1..: the same without a header, one barrier each

Every worker takes the same branches: they depend on the layout and on the headers
alone. A lazy `fill` writes this worker's data straight into its slots (one copy where
filling a pack and then the slot would make two). Leaving the rounds midway (a failed
write, an interrupt, a failed wait: its own timeout too) poisons this worker's segment,
so its peers raise naming it instead of summing slots it never wrote, or wrote for a
round it then gave up on (a late peer finds every counter there: it reads the mark
before it sums, `_wait`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from crossdevice._comm.workers.calls import Call, PeerFailure, PeersFailedError, told
from crossdevice._comm.workers.health import HealthBoard
from crossdevice._comm.workers.shared_memory import SharedSlots, plan_rounds
from crossdevice._comm.workers.speculation import RoomPool
from crossdevice._comm.workers.transport import Job, Layout, Reduced

__all__ = ["SharedMemoryTransport"]

#: The header slot's content when the fingerprints were agreed before (none to check).
_NO_HEADER = np.zeros(1, np.int64)


class SharedMemoryTransport:
    """All-reduces through the workers' shared slots (see the module doc).

    Args:
        slots: this worker's slots and its peers', mapped.
        health: the health board whose wait loop every wait goes through.
        rooms: where outputs come from (recycled once nobody holds a result).
        leave: tells the peers why this worker left a collective midway.
    """

    name = "shared memory"

    def __init__(
        self,
        slots: SharedSlots,
        health: HealthBoard,
        rooms: RoomPool,
        leave: Callable[[BaseException], None],
    ) -> None:
        self.slots = slots
        self._health = health
        self._rooms = rooms
        self._leave = leave

    @classmethod
    def connect(
        cls,
        rank: int,
        world_size: int,
        exchange: Callable[[torch.Tensor], np.ndarray],
        health: HealthBoard,
        rooms: RoomPool,
        leave: Callable[[BaseException], None],
    ) -> SharedMemoryTransport | None:
        """Map every worker's slots when they all share this host, else None everywhere.

        `leave(error)` is called when this worker leaves a collective midway for any
        reason but a failed wait (it tells the peers why).
        """
        slots = SharedSlots.connect(rank, world_size, exchange)
        return None if slots is None else cls(slots, health, rooms, leave)

    def enabled(self, layout: Layout) -> bool:
        """Host layouts of the summed dtypes of at least the agreed minimum size."""
        return self.slots.carries(layout)

    def start(self, call: Call, job: Job) -> _SharedFlight:
        """Write round 0 (data and header) and arrive; `finish` waits, checks and sums."""
        slots = self.slots
        header = _NO_HEADER if job.header is None else job.header
        try:
            number, parity = slots.next_round()
            if job.buffers is not None:
                slots.write(parity, plan_rounds(job.layout)[0], job.buffers, job.fill)
            slots.arrive(number, parity, header)
        except BaseException as err:
            self._left(err)
            raise
        return _SharedFlight(self, call, job, number, parity)

    def _finish(self, flight: _SharedFlight) -> Reduced:
        slots, call, job = self.slots, flight.call, flight.job
        rounds = plan_rounds(job.layout)
        sources = job.buffers
        try:
            self._wait(call, flight.number)
            agrees = job.header is None or slots.headers_equal(flight.parity, job.header)
            if sources is None or not agrees:
                return None, agrees
            outputs = [self._rooms.buffer(t.dtype, t.numel())[: t.numel()] for t in sources]
            slots.reduce(flight.parity, rounds[0], outputs)
            for spec in rounds[1:]:
                number, parity = slots.next_round()
                slots.write(parity, spec, sources, job.fill)
                slots.arrive(number, parity)
                self._wait(call, number)
                slots.reduce(parity, spec, outputs)
        except BaseException as err:
            self._left(err)
            raise
        return outputs, True

    def _left(self, error: BaseException) -> None:
        """Leaving the rounds midway: the peers must not go on with this worker's slots.

        Anything but a failed wait is this worker's failure: the communicator tells the
        peers why (the store, this segment), then the segment is poisoned. A failed wait
        poisons it at once; why follows once diagnosed (`Sequencer.guard`).
        """
        self._leave(error)
        self.slots.poison()

    def poison(self, reason: str = "") -> None:
        """Mark this worker gone from the shared rounds (it quit, `reason`) and wake its peers."""
        self.slots.poison(reason)

    def abandon(self, job: Job) -> list[Any]:
        """This worker quits: its poison mark wakes the peers waiting in (or reaching) a round."""
        del job
        self.slots.poison()
        return []

    def close(self) -> None:
        """Unmap every segment."""
        self.slots.close()

    def _wait(self, call: Call, number: int) -> None:
        """Until every worker arrived at round `number`, or a peer left the rounds."""
        slots = self.slots

        def step(seconds: float) -> bool:
            behind = slots.waiting_for(number)
            if behind:
                gone = slots.abandoned(number)
                if gone:
                    raise PeersFailedError(self._gone(gone))
                slots.wait(number, behind[0], seconds)
                if slots.waiting_for(number):
                    return False
            # Every peer is there; the marks after the counters: one that gave up on
            # this round (it timed out) had arrived at it, and its slots are not to be
            # summed by the workers it left.
            gone = slots.abandoned(number)
            if gone:
                raise PeersFailedError(self._gone(gone))
            return True

        self._health.wait(call, step)
        slots.passed = number

    def _gone(self, ranks: list[int]) -> list[PeerFailure]:
        """Why peers `ranks` quit: what each wrote in its segment, else what the store says."""
        said = {r: self.slots.reason(r) for r in ranks}
        failures = [PeerFailure(r, told(text), False) for r, text in said.items() if text]
        silent = [r for r in ranks if not said[r]]
        if silent:  # the store may know: an abort record, a timeout's, a peer found dead
            found = {f.rank: f for f in self._health.check()}
            timeouts = self._health.timed_out  # the records `check` set aside
            found.update((r, PeerFailure(r, timeouts[r], False)) for r in silent if r in timeouts)
            named = {f.rank for f in failures}
            failures += [f for r, f in sorted(found.items()) if r not in named] or [
                PeerFailure(r, "left a shared-memory all-reduce midway", False) for r in silent
            ]
        return failures


class _SharedFlight:
    """A shared-memory all-reduce whose round 0 is written: `finish` does the rest."""

    __slots__ = ("call", "job", "number", "parity", "transport")

    def __init__(
        self, transport: SharedMemoryTransport, call: Call, job: Job, number: int, parity: int
    ) -> None:
        self.transport = transport
        self.call = call
        self.job = job
        self.number = number
        self.parity = parity

    def finish(self) -> Reduced:
        """Wait for round 0's peers, check the headers, sum, run the later rounds."""
        return self.transport._finish(self)
