"""The straggler report: which replica or worker keeps everyone waiting, and by how much.

Every collective has a last arriver, and its peers wait for it. For each collective the
trace notes who came last and by how much (its *lateness*: how long after the next
latest it arrived). Every `report_every` steps it looks at the window: when one replica
(or worker) came last in at least `CONSISTENT_FRACTION` of the window's collectives, by a
median of at least `MIN_LATENESS_S`, one line goes to the `crossdevice` logger:

    crossdevice straggler: replica 2 (MirroredStrategy) arrived last at 50 of 50
    collectives in steps 51-100, late by median 20.1 ms, p95 20.9 ms: its peers waited
    for it

Otherwise it stays quiet: with every replica equally fast, who comes last is chance
(1 in N each), far below the fraction.

Across workers, arrival times on different hosts do not share a clock, so the measure is
each worker's own: the time between its previous collective's end and its next
collective's start (its *gap*: its compute, its input, its local replicas' waits). The
worker with the longest gap arrived last, later than the next one by the difference;
peers' collectives end together, so no clock offset enters. Each worker puts its gaps
for the window into the job's store and reads its peers' for the window before (one set
and one read per peer every `report_every` steps), so a worker is named within two
windows.
"""

from __future__ import annotations

import collections
import json
import logging
import statistics
from collections.abc import Sequence
from typing import Any, Final

__all__ = [
    "CONSISTENT_FRACTION",
    "MIN_LATENESS_S",
    "Stragglers",
    "WorkerGaps",
    "straggler_line",
]

LOG: Final = logging.getLogger("crossdevice")

#: Came last in this share of a window's collectives: consistently, not by chance (with
#: N equally fast peers each comes last 1/N of the time; N >= 2).
CONSISTENT_FRACTION: Final = 0.6
#: Late by less than this (median) is not worth a line: a thread wake-up is 10-100 us.
MIN_LATENESS_S: Final = 0.001
#: Fewer collectives than this in a window say nothing.
MIN_COLLECTIVES: Final = 5
#: Gaps kept per window and worker (the store value stays small).
_MAX_GAPS: Final = 4096


def straggler_line(lasts: Sequence[tuple[str, float]], where: str, steps: str) -> str | None:
    """The report for one window of `(who came last, how late)`, or None if nobody stands out."""
    if len(lasts) < MIN_COLLECTIVES:
        return None
    counts = collections.Counter(who for who, _ in lasts)
    who, count = counts.most_common(1)[0]
    if count < CONSISTENT_FRACTION * len(lasts):
        return None
    late = sorted(lag for w, lag in lasts if w == who)
    median = statistics.median(late)
    if median < MIN_LATENESS_S:
        return None
    p95 = late[min(len(late) - 1, int(0.95 * len(late)))]
    return (
        f"crossdevice straggler: {who} ({where}) arrived last at {count} of {len(lasts)} "
        f"collectives {steps}, late by median {median * 1e3:.1f} ms, "
        f"p95 {p95 * 1e3:.1f} ms: its peers waited for it"
    )


class Stragglers:
    """The in-process side: each rendezvous' last arrivers of the current window."""

    def __init__(self) -> None:
        self._lasts: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)

    def last(self, where: str, replica_id: int, lateness: float) -> None:
        """Replica `replica_id` of `where` came last to a collective, `lateness` s late."""
        lasts = self._lasts[where]
        if len(lasts) < _MAX_GAPS:
            lasts.append((f"replica {replica_id}", lateness))

    def report(self, steps: str) -> list[str]:
        """Log (and return) the window's lines, and start a new window.

        Args:
            steps: which steps the window held, for the line ("in steps 1-50").
        """
        windows, self._lasts = self._lasts, collections.defaultdict(list)
        lines = []
        for where, lasts in windows.items():
            line = straggler_line(lasts, where, steps)
            if line is not None:
                LOG.warning(line)
                lines.append(line)
        return lines


class WorkerGaps:
    """One worker communicator's gaps (see the module doc) and their exchange in the store.

    Args:
        rank: this worker's rank.
        world_size: number of workers.
        store: the communicator's store (a c10d store client of its own prefix), or None.
    """

    def __init__(self, rank: int, world_size: int, store: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self._gaps: dict[int, float] = {}
        self._last_end: float | None = None
        self._window = 0

    def issued(self, seq: int, now: float) -> None:
        """This worker starts collective `seq` at `now`."""
        if self._last_end is not None and len(self._gaps) < _MAX_GAPS:
            self._gaps[seq] = now - self._last_end

    def ended(self, now: float) -> None:
        """This worker's current collective ended (or was waited for) at `now`."""
        self._last_end = now

    def window(self, window: int, steps: str) -> str | None:
        """Publish the gaps of `window`, read the peers' of the window before; the line, if any.

        Called by the thread that issues the collectives, at the first collective of the
        last step of each window (every worker alike). A peer published its gaps of the
        window before at the same point of that window, before the collectives this
        worker has run with it since: the read never waits.

        Args:
            window: the window that ends (1, 2, ...).
            steps: which steps the window before held, for the line.
        """
        if window == self._window or self._store is None or self.world_size < 2:
            return None
        self._window = window
        gaps, self._gaps = self._gaps, {}
        previous = window - 1
        try:
            mine = f"trace-gaps-{window}-{self.rank}"
            self._store.set(mine, json.dumps(gaps))
            if previous < 1:
                # A `set` gets no reply: a peer could read before the server applied it.
                # A call that gets one, on this connection, comes after it (later windows
                # read the store below, on this connection, before going on).
                self._store.check([mine])
                return None
            tables = []
            for rank in range(self.world_size):
                key = f"trace-gaps-{previous}-{rank}"
                if not self._store.check([key]):
                    return None
                tables.append({int(k): v for k, v in json.loads(self._store.get(key)).items()})
            if previous >= 2:  # nobody reads it any more
                self._store.delete_key(f"trace-gaps-{previous - 1}-{self.rank}")
        except Exception:  # the store is gone: the collectives will say so
            return None
        lasts = []
        for seq in set(tables[0]).intersection(*tables[1:]):
            order = sorted(range(self.world_size), key=lambda r: tables[r][seq])
            lasts.append((f"worker {order[-1]}", tables[order[-1]][seq] - tables[order[-2]][seq]))
        line = straggler_line(lasts, "workers", steps)
        if line is not None:
            LOG.warning(line)
        return line
