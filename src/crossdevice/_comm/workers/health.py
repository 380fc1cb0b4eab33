"""Which workers arrived, which are alive, which failed; and the one loop every wait runs.

Each worker's `HealthBoard` keeps three kinds of keys in the store (under a prefix of
its communicator):

* `r<rank>`: the number of the last collective the worker reached (arrival marks),
  published once it stood still for `TUNING.publish_seconds` (a worker waiting in a
  collective): peers read them only to say who did not arrive when one times out;
* `h<rank>`: a heartbeat counter, bumped every `TUNING.heartbeat_seconds` by a daemon thread.
  It keeps beating while the worker's main thread is busy or asleep in user code, so a
  *stalled* worker looks alive and a *dead* one (killed, crashed, connection gone)
  stops: its peers report it after `TUNING.dead_after_seconds` whatever the timeout says.
  A worker that closes its communicator (`stop`: at the end of its program too) leaves
  `closed <its last collective>` there instead, so its peers, which read the key anyway,
  report at once that it exited, rather than that it died seconds later;
* `a<rank>`: why the worker gave up (its step raised `ValueError: ...`), plus a shared
  counter `aborts` so a peer learns of any abort in one store round trip. A worker whose
  collective failed because peers died (`give_up`) leaves `gave up on rank(s) [1] in ...`
  there: a peer it took for dead that was only frozen or too slow (SIGSTOP, a debugger,
  an overloaded host) learns on resuming, within a poll, that it was declared dead,
  instead of waiting out its collective's timeout for workers that left it. One whose
  own collective timed out leaves `timed out after ...`: no failure to a peer waiting
  alike, but the cause of a late peer's broken link (`diagnose`).

A waiting worker polls `check()` only when its collective did not finish within a
poll interval, so the fast path costs nothing but the publisher thread's integer reads.
When the store itself is unreachable, or does not answer a read within
`TUNING.dead_after_seconds` (`bounded_store.py`: a frozen server never does), the process
serving it is gone or stopped: that is rank 0 (it serves the store unless torchrun's
agent does), and the error says so.

Every wait of a worker communicator goes through `HealthBoard.wait`: process-group work
(`wait_works`), shared-memory rounds, and the first messages of a point-to-point exchange
(`wait_arrival`: a helper thread makes the blocking wait) alike. It bounds the wait by
the collective's timeout and consults the board every `TUNING.poll_seconds`, so a failed
or dead peer is named within seconds whatever the transport (in a point-to-point
exchange, one that dies after its first messages came with its connection left open is
named at the timeout: `wait_messages`). `diagnose` turns what ended a wait into the
error the caller gets: naming the failed ranks, or the ranks that did not arrive
(looking for who died after a broken connection is a `wait` too, on nothing but the
board).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from crossdevice._comm.workers.bounded_store import BoundedStore
from crossdevice._comm.workers.calls import (
    GAVE_UP,
    TIMED_OUT,
    Call,
    PeerFailure,
    PeersFailedError,
    Standing,
    WaitFailedError,
    told,
)
from crossdevice._comm.workers.serial import SerialThread
from crossdevice._comm.workers.store_logging import quiet_store
from crossdevice._core import tuning
from crossdevice._core.errors import CollectiveTimeoutError, WorkerFailedError

__all__ = ["HealthBoard", "PeerFailure"]

#: Heartbeats this many beats stale when the store goes down mark a peer that died first.
_SILENT_BEATS: Final = 3
#: Longest text of an abort reason kept (a peer's store value is untrusted input).
_MAX_REASON: Final = 300
#: A heartbeat key's last value, once its worker closed its communicator (`stop`).
_CLOSED: Final = b"closed"
#: How `check` describes a peer that closed its communicator (an exit, not a death).
_EXITED: Final = "exited (closed its communicator)"


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
        # Calls that fail once the store's host is gone must not print C++ frames.
        self._pub_store = quiet_store(connect())
        # Reads wait for the store's reply at most as long as a peer may stay silent:
        # a frozen store host never replies (`bounded_store.py`).
        self._store = BoundedStore(
            quiet_store(connect()), lambda: tuning.TUNING.dead_after_seconds, f"r{rank}"
        )
        self._published = -1
        self._still = -1  # the mark at the publisher's last look
        self._beat = 0
        self._stop = threading.Event()
        self._seen: dict[int, tuple[bytes | None, float]] = {}
        #: This worker's `give_up` record, until the publisher thread posted it.
        self._gave_up: str | None = None
        #: Peers' `give_up` records naming other workers than this one, by rank.
        self._given_up: dict[int, str] = {}
        #: Peers' `timed_out` records, by rank: no failure to a worker waiting alike (its
        #: own timeout names who did not come), but what a broken link means (`diagnose`).
        self.timed_out: dict[int, str] = {}
        self._pub_store.set(f"h{rank}", "0")
        self._thread = threading.Thread(
            target=self._publish_loop, name=f"crossdevice-health-r{rank}", daemon=True
        )
        self._thread.start()
        #: `wait_arrival`'s helper: each request's blocking waits, in order.
        self._arrivals = SerialThread(f"crossdevice-arrivals-r{rank}")

    # -- this worker -------------------------------------------------------------------

    def _publish(self) -> None:
        """Publish the arrival mark once it stood still for a whole interval.

        Peers read the marks only to diagnose a timeout (`missing`), seconds after the
        collective began, when a worker waiting inside it has long stopped moving its
        mark. While collectives follow each other within an interval (a training loop),
        the mark is never published and the store sleeps: every publication was a store
        round trip that woke the store's server thread on rank 0 (on the 2-core host,
        the tutorial CNN at 128 examples per worker published 0.66 times a step, about
        0.1 ms of CPU a step on rank 0 alone).
        """
        reached = self.reached
        if reached == self._still and reached != self._published:
            self._pub_store.set(f"r{self._rank}", str(reached))
            self._published = reached
        self._still = reached

    def _publish_loop(self) -> None:
        next_beat = time.monotonic()
        stopping = False
        while not stopping:
            stopping = self._stop.wait(tuning.TUNING.publish_seconds)
            try:
                self._post_gave_up()  # a record given up just before `stop` too
                if stopping:
                    return
                self._publish()
                if time.monotonic() >= next_beat:
                    self._beat += 1
                    self._pub_store.set(f"h{self._rank}", str(self._beat))
                    next_beat = time.monotonic() + tuning.TUNING.heartbeat_seconds
            except Exception:  # the store is gone: a waiting collective will report it
                return

    def _post_gave_up(self) -> None:
        """Post this worker's `give_up` record, if one waits (on the publisher's thread).

        Not through `post_abort`'s bounded client: when the store's host froze, that
        client is stuck on its unanswered read. This one's `set` waits for no reply and
        its `add` waits until the host resumes, and reads the record.
        """
        record = self._gave_up
        if record is not None:
            self._gave_up = None
            self._pub_store.set(f"a{self._rank}", record)
            self._pub_store.add("aborts", 1)

    def give_up(self, call: Call, failures: Sequence[PeerFailure], standing: Standing) -> None:
        """Tell the peers that this worker gave up on `call` because `failures` died.

        Those taken for dead may only have been frozen or too slow: one that resumes
        reads the record (`_aborted`) and raises at once, saying that it was declared
        dead, instead of waiting for peers that left. Posted by the publisher thread
        within `TUNING.publish_seconds` (best effort); nothing for peers that raised or
        exited (they know), nor when this worker itself was given up on.
        """
        dead = sorted({f.rank for f in failures if f.died and f.rank >= 0})
        if not dead or any(f.gave_up_on_us for f in failures):
            return
        named = "; ".join(
            f"rank {f.rank}{standing.replica_ids([f.rank])} {f.reason}"
            for f in failures
            if f.rank in dead
        )
        record = f"{GAVE_UP}{', '.join(map(str, dead))}] in {call.label}: {named}"
        if len(record) > _MAX_REASON:  # keep the ranks and the end of the label
            record = record[: _MAX_REASON - 3] + "..."
        self._gave_up = record

    def post_abort(self, reason: str) -> None:
        """Tell every peer that this worker gave up, and why (best effort)."""
        try:
            self._store.set(f"a{self._rank}", reason[:_MAX_REASON])
            self._store.add("aborts", 1)
        except Exception:
            pass

    def stop(self) -> None:
        """Stop publishing (waits for the thread at most about one interval).

        Then mark the heartbeat `closed`: a peer still waiting in a collective learns that
        this worker exited (its program ended without that call) instead of taking the
        silence for a death. A `set` waits for no reply (`bounded_store.py`).
        """
        self._stop.set()
        self._arrivals.close()  # the helper ends once its last wait does
        self._store.close()
        self._thread.join(timeout=2 * tuning.TUNING.publish_seconds + 1.0)
        if not self._thread.is_alive():  # else it may still be using `_pub_store`
            with contextlib.suppress(Exception):
                self._pub_store.set(f"h{self._rank}", f"closed {self.reached}")

    # -- peers -------------------------------------------------------------------------

    def check(self, seq: int | None = None) -> list[PeerFailure]:
        """Peers known to have failed: aborted, dead (stale heartbeat), or the store host.

        And peers that closed their communicator before collective `seq` (any, for None):
        one that closed after arriving at `seq` took part in it, and its data may still
        be on the way.
        """
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
                if beat is not None and beat.startswith(_CLOSED):
                    self._seen[rank] = (beat, since)
                    if rank in self._given_up:  # it ended because other peers died
                        reason = f"{self._given_up[rank]}; then it {_exited(beat)}"
                        failures.append(PeerFailure(rank, reason, died=False))
                    elif seq is None or _closed_after(beat) < seq:
                        failures.append(PeerFailure(rank, _exited(beat), died=False))
                elif rank not in self._seen or beat != last:
                    self._seen[rank] = (beat, now)
                elif now - since >= tuning.TUNING.dead_after_seconds:
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
                for rank, (beat, since) in sorted(self._seen.items())
                if rank != host
                and now - since >= _SILENT_BEATS * tuning.TUNING.heartbeat_seconds
                and not (beat or b"").startswith(_CLOSED)  # exited: not silent
            ]
            last = self._seen.get(host, (None, now))[0] if host is not None else None
            if host is not None and last is not None and last.startswith(_CLOSED):
                # It closed its communicator, then exited, taking its store with it.
                return [*silent, PeerFailure(host, _exited(last), died=False)]
            return [
                *silent,
                PeerFailure(
                    -1 if host is None else host,
                    f"is unreachable: the c10d store does not answer ({type(err).__name__}: "
                    f"{err}): {who} died, stopped, or timed out waiting and left",
                    died=True,
                ),
            ]

    def _aborted(self) -> list[PeerFailure]:
        if int(self._store.add("aborts", 0)) == 0:
            return []
        failures = []
        for rank in range(self._world_size):
            text = self._abort_text(rank) if rank != self._rank else None
            if text is None:
                continue
            on = _gave_up_on(text)
            if text.startswith(TIMED_OUT):
                self.timed_out[rank] = text
            elif on is None:
                failures.append(PeerFailure(rank, told(text), died=False))
            elif self._rank in on:
                failures.append(PeerFailure(rank, text, died=False, gave_up_on_us=True))
            else:
                # It took other peers for dead: this worker finds them itself (or their
                # own records), and names this one when it closes (`check`).
                self._given_up[rank] = text
        return failures

    def _abort_text(self, rank: int) -> str | None:
        key = f"a{rank}"
        if not self._store.check([key]):
            return None
        raw = self._store.get(key)[:_MAX_REASON]
        return "".join(c if c.isprintable() else "?" for c in raw.decode("utf-8", "replace"))

    def abort_text(self, rank: int) -> str | None:
        """What peer `rank` said when it gave up (`post_abort`), or None.

        Its exception's type and text; None where the store has none or cannot be read.
        A peer posts it before it sends its abort header (`ProcessGroupCommunicator.abort`),
        and its `add` is answered, so a worker that received the header finds it here.
        """
        try:
            return self._abort_text(rank)
        except Exception:
            return None

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
            # then again once peers' marks, published after standing still one interval
            # (`_publish`: up to two stale), have caught up.
            missing = self._below(seq)
        except Exception:
            return None
        time.sleep(3 * tuning.TUNING.publish_seconds)
        with contextlib.suppress(Exception):  # keep the first reading if the store is gone
            missing = self._below(seq)
        return missing

    # -- waiting -----------------------------------------------------------------------

    def wait(self, call: Call, step: Callable[[float], bool]) -> None:
        """Wait until `step(seconds)` says done, watching the peers' health.

        `step` waits at most `seconds` (a process group's work, a futex) and returns
        whether what it waits for is done; it may raise `PeersFailedError` itself (a
        shared-memory peer's poison mark). Raises TimeoutError once `call` is past its
        timeout, `PeersFailedError` when the board names failed peers (looked at every
        `TUNING.poll_seconds`, however often `step` returns early), each wrapped in
        `WaitFailedError`, as is a failure of the process group's work.
        """
        poll = tuning.TUNING.poll_seconds
        shortest = tuning.TUNING.min_wait_seconds
        next_check = time.monotonic() + poll
        try:
            while True:
                remaining = call.remaining()
                # Done already is done, even past the deadline (an all-reduce waited late).
                if step(max(shortest, min(next_check - time.monotonic(), remaining))):
                    return
                if remaining < shortest:
                    raise TimeoutError(f"no reply within {call.timeout:g} s")
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + poll
                    failures = self.check(call.seq)
                    if failures:
                        raise PeersFailedError(failures)
        except (TimeoutError, PeersFailedError) as err:
            raise WaitFailedError(err) from err

    def wait_works(self, call: Call, works: Sequence[Any]) -> None:
        """`wait` for each of a process group's pending collective works, in order."""
        for work in works:
            # A work that completed needs no watching: its wait returns (or raises) at once.
            if not (work.is_completed() and _work_done(work, tuning.TUNING.min_wait_seconds)):
                self.wait(call, functools.partial(_work_done, work))

    def wait_arrival(self, call: Call, works: Sequence[Any]) -> None:
        """`wait_messages` for the first messages of a point-to-point exchange, watched.

        A point-to-point work cannot be waited on in slices (see `wait_messages`), so a
        helper thread makes its one blocking wait while this thread runs `wait`, the
        loop that reads the board: a peer that dies before its messages come, its
        connection left open (a machine gone, a frozen process), is named within
        `TUNING.dead_after_seconds`, as in a collective, not at the timeout. Only the
        first messages need it: the peer posts the rest of its sends with them.
        Measured on the user's path, 1 MiB exchanged between 2 workers: 1.42-1.46 ms
        with it, 1.33-1.45 ms waiting here (runs apart); the hand-over mostly overlaps
        the data still on its way (for small ones, see `TUNING.direct_min_bytes`).
        """
        # A bare lock, held until the helper's wait ends (256 KiB and 1 MiB, 2 runs of
        # 146 interleaved pairs: 18-63 us a call less than `threading.Event.wait`).
        done, box = self._arrivals.submit(self.wait_messages, call, works)
        self.wait(call, functools.partial(_released, done))
        ok, err = box[0]
        if not ok:
            raise err

    def wait_messages(self, call: Call, works: Sequence[Any]) -> None:
        """Wait for each pending point-to-point work (a send, a receive), in order.

        Gloo's sends and receives cannot be watched like the collectives: a `wait` that
        times out fails the operation (it does not only give up waiting), and
        `is_completed` stays False until a `wait` returns (both measured, torch 2.13). So
        each is waited on once (only once: a second wait blocks for a message that never
        comes), for the rest of the collective's timeout: a peer that
        died closes its connection and fails the wait at once; a live one that does not
        come is reported when the timeout expires (the ring's peers quit it through its
        header, `RingTransport.abandon`).
        """
        shortest = tuning.TUNING.min_wait_seconds
        for work in works:
            remaining = call.remaining()
            try:
                if remaining < shortest:
                    raise TimeoutError(f"no reply within {call.timeout:g} s")
                work.wait(datetime.timedelta(seconds=remaining))
            except (RuntimeError, TimeoutError) as err:
                late = call.remaining() < shortest
                raise WaitFailedError(
                    TimeoutError(f"no reply within {call.timeout:g} s") if late else err
                ) from err

    def _await_failures(self, call: Call) -> list[PeerFailure]:
        """The failures the board finds within a dead worker's heartbeat timeout, or [].

        The one wait loop (`wait`), with nothing to wait for but the board: a peer that
        died when a connection closed shows as a stale heartbeat within
        `TUNING.dead_after_seconds`.
        """
        looking = Call(
            call.name, call.seq, tuning.TUNING.dead_after_seconds + 1.0, time.monotonic()
        )
        try:
            self.wait(looking, _never_done)
        except WaitFailedError as err:
            if isinstance(err.cause, PeersFailedError):
                return err.cause.failures
        return []

    def diagnose(
        self, call: Call, err: Exception, standing: Standing
    ) -> WorkerFailedError | CollectiveTimeoutError | RuntimeError:
        """The error that ended `call`'s wait, naming the failed or missing ranks.

        A failure of the process group itself (a connection closed) is looked into for up
        to a dead worker's heartbeat timeout, to name who died.
        """
        where = f"{call.label} on rank {standing.rank} of {standing.world_size}"
        failures = err.failures if isinstance(err, PeersFailedError) else []
        timed_out = isinstance(err, TimeoutError) and not failures
        if not failures and not timed_out:  # a broken link: who broke it?
            failures = self.check(call.seq) or [
                PeerFailure(r, text, died=False) for r, text in sorted(self.timed_out.items())
            ]
            failures = failures or self._await_failures(call)
        if failures:
            self.give_up(call, failures, standing)
            named = "; ".join(
                f"rank {f.rank}{standing.replica_ids([f.rank])} {f.reason}"
                if f.rank >= 0
                else f"the store {f.reason}"
                for f in failures
            )
            if any(f.gave_up_on_us for f in failures):
                failed = _declared_dead(where, standing, failures)
            elif all(f.reason.startswith(TIMED_OUT) for f in failures):
                failed = WorkerFailedError(
                    f"{where}: a peer gave up waiting in it: {named}. Every worker must run "
                    "the same collectives in the same order, each within the timeout; if the "
                    "workers are only slow, raise CommunicationOptions(timeout_seconds=...). "
                    "Build a new strategy (or communicator) on every worker."
                )
            elif all(f.reason.startswith(_EXITED) for f in failures):
                failed = WorkerFailedError(
                    f"{where}: a peer ended: {named}, while this worker waited in "
                    f"{call.label}. Every worker must make the same collective calls, in the "
                    "same order, before its program ends: one made on some workers only "
                    "waits for peers that never come. Build a new strategy (or communicator) "
                    "on every worker."
                )
            else:
                failed = WorkerFailedError(
                    f"{where}: a peer failed: {named}. Fix that worker's failure (see its "
                    f"log); every worker must then build a new strategy (or communicator)."
                )
            failed.__cause__ = None if isinstance(err, PeersFailedError) else err
            return failed
        if timed_out:
            # The board keeps beating: this worker is alive, and its peers must not take
            # it for dead while they diagnose their own failure.
            missing = self.missing(call.seq)
            if missing:
                who = f"rank(s) {missing}{standing.replica_ids(missing)} did not arrive at it"
            elif missing is None:
                who = "the arrival marks could not be read"
            else:
                who = "every rank arrived at it, but a peer is stuck inside it"
            return CollectiveTimeoutError(
                f"{where} timed out after {call.timeout:g} s: {who}. Every worker must run "
                f"the same collectives in the same order; if the workers are only slow, "
                f"raise CommunicationOptions(timeout_seconds=...) (default "
                f"{tuning.TUNING.default_timeout_seconds:g} s). Build a new strategy on every "
                "worker."
            )
        failed_run = RuntimeError(
            f"{where} failed ({type(err).__name__}: {err}); no peer is known to have died "
            f"or failed. Check the other workers' logs, then build a new strategy (or "
            f"communicator) on every worker."
        )
        failed_run.__cause__ = err
        return failed_run


def _gave_up_on(text: str) -> set[int] | None:
    """The ranks a peer's abort record says it gave up on (`give_up`); None: it raised."""
    if not text.startswith(GAVE_UP):
        return None
    ranks = text[len(GAVE_UP) :].partition("]")[0].split(",")
    return {int(r) for r in ranks if r.strip().isdigit()}


def _declared_dead(
    where: str, standing: Standing, failures: Sequence[PeerFailure]
) -> WorkerFailedError:
    """The error of a worker whose peers declared it dead, then gave up on it (`give_up`)."""
    named = "; ".join(
        f"rank {f.rank}{standing.replica_ids([f.rank])} {f.reason}"
        for f in failures
        if f.gave_up_on_us
    )
    patience = tuning.TUNING.dead_after_seconds
    return WorkerFailedError(
        f"{where}: the other workers gave up on this worker: {named}. They declared this "
        f"worker dead because it was silent (no heartbeat, or no reply from the store it "
        f"serves) for {patience:g} s (TUNING.dead_after_seconds), while it was frozen, "
        "suspended (SIGSTOP, a debugger, a paused VM) or too slow to run (an overloaded or "
        "swapping host); it resumed after they had left. Avoid stalls that long, or give "
        "the workers more patience: CROSSDEVICE_DEAD_AFTER_SECONDS=20 in every worker's "
        "environment; every worker must then build a new strategy (or communicator)."
    )


def _closed_after(beat: bytes) -> int:
    """The last collective of a peer whose heartbeat key says `closed <number>` (or 0)."""
    count = beat[len(_CLOSED) :].strip()
    return int(count) if count.isdigit() else 0


def _exited(beat: bytes) -> str:
    """`check`'s reason for a peer whose heartbeat key says `closed <number>`."""
    return f"{_EXITED} after its collective #{_closed_after(beat)}"


def _released(lock: Any, seconds: float) -> bool:
    """A `HealthBoard.wait` step: whether `lock` was released within `seconds`."""
    return bool(lock.acquire(timeout=seconds))


def _never_done(seconds: float) -> bool:
    """A `HealthBoard.wait` step that only lets time pass: the board's checks end it."""
    time.sleep(seconds)
    return False


def _work_done(work: Any, seconds: float) -> bool:
    """Whether a process group's `work` finished within `seconds` (its failure raises).

    A collective's `wait` that times out raises and leaves the work running. The work may
    complete between that timeout and a look at `is_completed`: a completed work is
    therefore waited on once more, which returns at once, raising only the work's own
    failure (a peer's connection closed...). Taking the timeout itself for a failure once
    failed a healthy broadcast (1 launch in 20 of the epoch benchmark's set-up, 2 workers
    on 2 busy cores).
    """
    delta = datetime.timedelta(seconds=seconds)
    try:
        work.wait(delta)
    except RuntimeError:
        if not work.is_completed():
            return False
        try:
            work.wait(delta)
        except RuntimeError as err:
            raise WaitFailedError(err) from err
    return True
