"""Which workers arrived, which are alive, which failed: marks in the c10d store.

Each worker's `HealthBoard` keeps three kinds of keys in the store (under a prefix of
its communicator):

* `r<rank>`: the number of the last collective the worker reached (arrival marks);
* `h<rank>`: a heartbeat counter, bumped every `HEARTBEAT_SECONDS` by a daemon thread.
  It keeps beating while the worker's main thread is busy or asleep in user code, so a
  *stalled* worker looks alive and a *dead* one (killed, crashed, connection gone)
  stops: its peers report it after `DEAD_AFTER_SECONDS` whatever the timeout says;
* `a<rank>`: why the worker gave up (its step raised `ValueError: ...`), plus a shared
  counter `aborts` so a peer learns of any abort in one store round trip.

A waiting worker polls `check()` only when its collective did not finish within a
poll interval, so the fast path costs nothing but the publisher thread's integer reads.
When the store itself is unreachable, the process serving it is gone: that is rank 0
(it serves the store unless torchrun's agent does), and the error says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, Final

__all__ = ["DEAD_AFTER_SECONDS", "HEARTBEAT_SECONDS", "HealthBoard", "PeerFailure"]

#: How often the publisher thread looks for a new arrival mark to publish. Publishing
#: before every collective cost 30 us a call on the 2-core dev host (a store `set` wakes
#: the store's server thread); a thread makes it one integer write per collective.
_PUBLISH_SECONDS: Final = 0.05
#: How often a worker's heartbeat advances.
HEARTBEAT_SECONDS: Final = 0.5
#: A heartbeat that has not moved for this long means a dead worker. Ten missed beats:
#: a loaded 2-core host delayed a beat by up to 1.2 s in the fault campaign.
DEAD_AFTER_SECONDS: Final = 5.0
#: A heartbeat this stale when the store goes down marks a peer that died first.
_SILENT_SECONDS: Final = 3 * HEARTBEAT_SECONDS
#: Longest text of an abort reason kept (a peer's store value is untrusted input).
_MAX_REASON: Final = 300


@dataclasses.dataclass(frozen=True)
class PeerFailure:
    """A worker that failed: its rank and what we know about why."""

    rank: int
    reason: str  # "raised ValueError: ..." or "stopped sending heartbeats ..."
    died: bool  # dead (no heartbeat, store gone) rather than aborted by an exception


class HealthBoard:
    """This worker's marks in the store, and what the store says about its peers.

    Args:
        connect: makes a new store client; the board takes two (one for its thread).
        rank: this worker's rank.
        world_size: number of workers.
        store_host: the rank whose process serves the store, if a worker does.
    """

    def __init__(
        self, connect: Callable[[], Any], rank: int, world_size: int, store_host: int | None
    ) -> None:
        self.reached = 0
        self._rank = rank
        self._world_size = world_size
        self._store_host = store_host
        self._pub_store = connect()
        self._store = connect()
        self._published = -1
        self._beat = 0
        self._stop = threading.Event()
        self._seen: dict[int, tuple[bytes | None, float]] = {}
        self._pub_store.set(f"h{rank}", "0")
        self._thread = threading.Thread(
            target=self._publish_loop, name=f"crossdevice-health-r{rank}", daemon=True
        )
        self._thread.start()

    # -- this worker -------------------------------------------------------------------

    def _publish(self) -> None:
        reached = self.reached
        if reached != self._published:
            self._pub_store.set(f"r{self._rank}", str(reached))
            self._published = reached

    def _publish_loop(self) -> None:
        next_beat = time.monotonic()
        while not self._stop.wait(_PUBLISH_SECONDS):
            try:
                self._publish()
                if time.monotonic() >= next_beat:
                    self._beat += 1
                    self._pub_store.set(f"h{self._rank}", str(self._beat))
                    next_beat = time.monotonic() + HEARTBEAT_SECONDS
            except Exception:  # the store is gone: a waiting collective will report it
                return

    def post_abort(self, reason: str) -> None:
        """Tell every peer that this worker gave up, and why (best effort)."""
        try:
            self._store.set(f"a{self._rank}", reason[:_MAX_REASON])
            self._store.add("aborts", 1)
        except Exception:
            pass

    def stop(self) -> None:
        """Stop publishing (waits for the thread at most about one interval)."""
        self._stop.set()
        self._thread.join(timeout=2 * _PUBLISH_SECONDS + 1.0)

    # -- peers -------------------------------------------------------------------------

    def check(self) -> list[PeerFailure]:
        """Peers known to have failed: aborted, dead (stale heartbeat), or the store host."""
        now = time.monotonic()
        try:
            failures = self._aborted()
            if failures:
                return failures
            for rank in range(self._world_size):
                if rank == self._rank:
                    continue
                key = f"h{rank}"
                beat = self._store.get(key) if self._store.check([key]) else None
                last, since = self._seen.get(rank, (None, now))
                if rank not in self._seen or beat != last:
                    self._seen[rank] = (beat, now)
                elif now - since >= DEAD_AFTER_SECONDS:
                    failures.append(
                        PeerFailure(
                            rank,
                            f"stopped sending heartbeats {now - since:.1f} s ago: its process "
                            "died or lost its connection",
                            died=True,
                        )
                    )
            return failures
        except Exception as err:
            host = self._store_host
            who = f"rank {host}, which serves it," if host is not None else "torchrun's agent"
            # Peers already silent when the store went down come first: the store's host
            # may only have exited after seeing them die (it diagnosed sooner than we did).
            silent = [
                PeerFailure(
                    rank,
                    f"had stopped sending heartbeats {now - since:.1f} s before the store "
                    "went down: its process died or lost its connection",
                    died=True,
                )
                for rank, (_, since) in sorted(self._seen.items())
                if rank != host and now - since >= _SILENT_SECONDS
            ]
            return [
                *silent,
                PeerFailure(
                    -1 if host is None else host,
                    f"is unreachable: the c10d store does not answer ({type(err).__name__}: "
                    f"{err}), so {who} has probably died",
                    died=True,
                ),
            ]

    def _aborted(self) -> list[PeerFailure]:
        if int(self._store.add("aborts", 0)) == 0:
            return []
        failures = []
        for rank in range(self._world_size):
            key = f"a{rank}"
            if rank != self._rank and self._store.check([key]):
                raw = self._store.get(key)[:_MAX_REASON]
                text = "".join(
                    c if c.isprintable() else "?" for c in raw.decode("utf-8", "replace")
                )
                failures.append(PeerFailure(rank, f"raised {text}", died=False))
        return failures

    def _below(self, seq: int) -> list[int]:
        out = []
        for rank in range(self._world_size):
            key = f"r{rank}"
            if not self._store.check([key]) or int(self._store.get(key)) < seq:
                out.append(rank)
        return out

    def missing(self, seq: int) -> list[int] | None:
        """Ranks whose arrival mark is below `seq`; None if the store cannot be read."""
        try:
            self._store.set(f"r{self._rank}", str(self.reached))
            # Read at once (the store's host may be about to exit after its own failure),
            # then again once peers' marks, up to one interval stale, have caught up.
            missing = self._below(seq)
        except Exception:
            return None
        time.sleep(3 * _PUBLISH_SECONDS)
        with contextlib.suppress(Exception):  # keep the first reading if the store is gone
            missing = self._below(seq)
        return missing
