"""`Integrity`: every cross-worker collective checked before its result is used, on any transport.

It wraps the transports the way torch's `ProcessGroupWrapper` wraps a process group: the
transports move data (`transport.py`), this part knows what each worker is about to do.
Each collective's fingerprint (`fingerprint.py`) is compared on every worker:

* a repeated all-reduce carries its header with its data, on whatever transport carries
  the data, in one round trip (`speculation.py`: every worker sends the layout it
  predicts from the collectives they already agreed on);
* anything else, and an all-reduce whose inline check failed, exchanges the headers
  first (one all-gather on the Gloo group), which raises `CollectiveMismatchError` on
  every worker naming both sides, or `WorkerFailedError` for a peer that aborted.

The communicator's `Standing` (rank, replica counts, broken) is shared with it: a
disagreement that leaves the workers' collectives out of step breaks the communicator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from crossdevice._comm.workers import fingerprint as fp
from crossdevice._comm.workers.calls import Call, Standing
from crossdevice._comm.workers.groups import FAILED, Groups
from crossdevice._comm.workers.health import HealthBoard
from crossdevice._comm.workers.speculation import MAX_INLINE_WORKERS, Predictor
from crossdevice._comm.workers.transport import Flight, Job, Layout, Transport
from crossdevice._comm.workers.wire import DTYPE_CODES
from crossdevice._core import tuning
from crossdevice._core.errors import CollectiveMismatchError, WorkerFailedError

__all__ = ["Checked", "Integrity"]


class Integrity:
    """Fingerprints, agreement and inline speculation for one communicator.

    Args:
        standing: the communicator's shared state (rank, replica counts, broken).
        groups: its process groups (headers travel on the Gloo one).
        health: the health board whose wait loop every wait goes through.
        transports: the transports, in order of preference; the last takes any layout.
    """

    def __init__(
        self,
        standing: Standing,
        groups: Groups,
        health: HealthBoard,
        transports: list[Transport],
    ) -> None:
        self._standing = standing
        self._groups = groups
        self._health = health
        self.transports = transports
        self.predictor = Predictor()
        #: The all-reduce started with a guessed header and not finished (`abandon`).
        self._guessed: Checked | None = None
        #: An all-reduce whose start failed midway (a caller's lazy fill raised after
        #: some of its data left): `abandon` then sends nothing (see there).
        self._midway = False
        self._chosen: dict[Layout, Transport] = {}
        self._chosen_under = tuning.TUNING

    def transport_for(self, layout: Layout) -> Transport:
        """The first transport enabled for `layout` (the same on every worker).

        Remembered per layout (a step repeats its layouts) for the thresholds in force.
        """
        if self._chosen_under is not tuning.TUNING:
            self._chosen.clear()
            self._chosen_under = tuning.TUNING
        chosen = self._chosen.get(layout)
        if chosen is None:
            chosen = next(t for t in self.transports if t.enabled(layout))  # the last takes any
            if len(self._chosen) >= 256:
                self._chosen.clear()
            self._chosen[layout] = chosen
        return chosen

    # -- all-reduce ---------------------------------------------------------------------

    def start(
        self,
        call: Call,
        header: np.ndarray,
        layout: Layout | None,
        job: Callable[[Layout | None], Job],
        detail: Callable[[], str],
        history: bytes | None = None,
    ) -> Checked:
        """Start an all-reduce of encoded fingerprint `header`; `Checked.finish` has the sums.

        Predicted: the data leaves at once with the header inside it (one round trip).
        Else the headers are exchanged and checked first, then the data leaves. `layout`
        is this call's host layout (None: CUDA values); `job(sent)` makes the transport's
        job for the layout sent, with this worker's buffers (None: its own layout).
        `history`: `Predictor.history` of `header` on every worker, if known already.
        """
        call.fingerprint = header  # for the flight recorder
        predicted = self._predict()
        if predicted:
            call.guess = self.predictor.counted(predicted, layout)
            sent = job(predicted) if predicted == layout else Job(predicted, None)
            sent.header = header
            flight = self._start(self.transport_for(predicted), call, sent)
            checked = Checked(self, call, header, layout, job, detail, sent, flight)
            # What the predictor learns if every header agrees, worked out while the data
            # travels (after the wait, this process's caches are Gloo's).
            if history is None:
                history = self.predictor.history([header] * self._standing.world_size)
            checked.history = history
            self._guessed = checked
            return checked
        self._exchange(call, header, detail, learn=layout)
        data = self._data(call, layout, job)
        return Checked(self, call, header, layout, job, detail, None, data)

    def _data(self, call: Call, layout: Layout | None, job: Callable[..., Job]) -> Flight:
        """The data of an agreed all-reduce, on the transport its layout takes."""
        data = job(layout)
        transport = self.transports[-1] if layout is None else self.transport_for(layout)
        return self._start(transport, call, data)

    def _start(self, transport: Transport, call: Call, job: Job) -> Flight:
        """`transport.start(call, job)`; one that raises may have sent part of the data."""
        self._midway = True
        flight = transport.start(call, job)
        self._midway = False
        return flight

    def _finish(self, checked: Checked) -> list[torch.Tensor]:
        if self._guessed is checked:
            self._guessed = None
        call, layout, sent = checked.call, checked.layout, checked.sent
        outputs, agrees = checked.flight.finish()
        if sent is None:  # the headers were agreed first
            assert outputs is not None
            return outputs
        if agrees:
            assert sent.header is not None
            self.predictor.learn([sent.header] * self._standing.world_size, layout, checked.history)
            if outputs is not None:
                return outputs
            # Equal fingerprints mean equal layouts: nobody's call fit either; the data
            # follows as without a guess.
        else:
            self._exchange(call, checked.header, checked.detail, learn=layout)
            if sent.buffers is not None:
                # This worker's buffers were summed with other data: never hand them out
                # (and the exchanged headers agreed: see the message).
                self._standing.broken = (
                    f"{call.label}: the inline fingerprints disagreed, the headers not"
                )
                raise CollectiveMismatchError(
                    f"{call.label} on rank {self._standing.rank}: the fingerprints inside "
                    "the data disagreed but the exchanged headers agree; expected both to "
                    "agree. This is a crossdevice bug (or a peer running another version): "
                    "report it, and build a new strategy on every worker"
                )
        outputs, _ = self._data(call, layout, checked.job).finish()
        assert outputs is not None
        return outputs

    def _predict(self) -> Layout | None:
        if self._standing.world_size > MAX_INLINE_WORKERS:
            return None
        return self.predictor.predict()

    # -- header exchange ----------------------------------------------------------------

    def agree(
        self, call: Call, mine: fp.Fingerprint, detail: Callable[[], str] | None = None
    ) -> list[fp.Fingerprint]:
        """Every worker's fingerprint, once they all match; else the error on every worker.

        When an all-reduce is predicted, this worker takes part in it with zeros and its
        header, as every worker does whose call is not that all-reduce: the ops pair one
        for one, and if every header matches (they all make this same call), that was
        the whole check.
        """
        header = mine.encode()
        header[fp.STATE_FIELD] = call.state
        call.fingerprint = mine  # for the flight recorder
        predicted = self._predict()
        if predicted:
            call.guess = self.predictor.counted(predicted, None)
            sent = Job(predicted, None, header=header)
            _, agrees = self.transport_for(predicted).start(call, sent).finish()
            if agrees:
                self.predictor.learn([header] * self._standing.world_size, None)
                return [mine] * self._standing.world_size
        return self._exchange(call, header, detail, learn=None)

    def agree_later(self, call: Call, mine: fp.Fingerprint) -> Callable[[], list[fp.Fingerprint]]:
        """`agree`, its header exchange issued now: the returned function completes it.

        For a collective whose caller needs no answer yet (`any_has_data_async`): the
        exchange runs in the process group's threads while the caller computes. A
        predicted all-reduce is taken part in at once, as `agree` does (its ops must
        pair one for one with the peers' all-reduce).
        """
        if self._predict():
            prints = self.agree(call, mine)
            return lambda: prints
        header = mine.encode()
        header[fp.STATE_FIELD] = call.state
        table, work = self._gather_small_async(torch.from_numpy(header))

        def finish() -> list[fp.Fingerprint]:
            self._health.wait_works(call, [work])
            return self._check_rows(call, header, table.numpy(), None, learn=None)

        return finish

    def _exchange(
        self,
        call: Call,
        header: np.ndarray,
        detail: Callable[[], str] | None,
        learn: Layout | None,
    ) -> list[fp.Fingerprint]:
        rows = self.gather_small(call, torch.from_numpy(header))
        return self._check_rows(call, header, rows, detail, learn)

    def _check_rows(
        self,
        call: Call,
        header: np.ndarray,
        rows: np.ndarray,
        detail: Callable[[], str] | None,
        learn: Layout | None,
    ) -> list[fp.Fingerprint]:
        """Every worker's header row, checked against ours (`_exchange`)."""
        fields: list[str] = []
        if (rows == header).all():
            # Every row is ours (valid by construction): decoded once.
            mine = fp.Fingerprint.decode(
                header, rank=self._standing.rank, num_dtypes=len(DTYPE_CODES)
            )
            prints = [mine] * self._standing.world_size
        else:
            prints = self._decode(call, rows)
            fields = fp.mismatched_fields(prints)
        if fields:
            # Every worker saw the same table, so every worker is here: one more fixed-size
            # exchange, on the error path only, brings each worker's readable detail.
            text = detail() if detail is not None else ""
            if "state" in fields and call.state_text is not None:
                text = f"{call.state_text()}; {text}" if text else call.state_text()
            if call.purpose:  # what this worker was doing, for every worker to read
                text = f"{call.purpose}; {text}" if text else call.purpose
            got = self.gather_small(call, torch.from_numpy(fp.encode_detail(text)))
            details = [fp.decode_detail(row) for row in got]
            if "seq" in fields:
                # The workers' counts went apart: nothing later can pair up again.
                self._standing.broken = f"{call.label}: collective sequence numbers differ"
            raise CollectiveMismatchError(
                f"{call.label} on rank {self._standing.rank}: "
                + fp.mismatch_message(prints, details, fields)
            )
        self.predictor.learn(list(rows), learn)
        return prints

    def gather_small(self, call: Call, mine: torch.Tensor) -> np.ndarray:
        """Every worker's small host tensor `mine`, stacked in rank order, waited on as `call`."""
        table, work = self._gather_small_async(mine)
        self._health.wait_works(call, [work])
        return table.numpy()

    def _gather_small_async(self, mine: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(the rank-order table every worker's `mine` lands in, the gather's work)."""
        table = torch.empty((self._standing.world_size, *mine.shape), dtype=mine.dtype)
        outs = list(table.unbind(0))
        work = dist.all_gather(outs, mine, group=self._groups.host, async_op=True)
        return table, work

    def _decode(self, call: Call, rows: np.ndarray) -> list[fp.Fingerprint]:
        """Every worker's header, checked; WorkerFailedError if a peer sent an abort."""
        standing = self._standing
        try:
            prints = [
                fp.Fingerprint.decode(rows[r], rank=r, num_dtypes=len(DTYPE_CODES))
                for r in range(standing.world_size)
            ]
        except ValueError as err:
            standing.broken = f"{call.label}: {err}"
            raise CollectiveMismatchError(f"{call.label}: {err}") from None
        aborted = [(r, p) for r, p in enumerate(prints) if p.kind == "abort"]
        if aborted:
            standing.broken = f"{call.label}: a peer aborted"
            self._groups.destroy(keep_alive=True)
            named = "; ".join(
                f"rank {r}{standing.replica_ids([r])} raised "
                f"{self._health.abort_text(r) or fp.abort_reason(p)}"
                for r, p in aborted
            )
            raise WorkerFailedError(
                f"{call.label} on rank {standing.rank} of {standing.world_size}: a peer "
                f"failed: {named}. Fix that worker's failure (see its log); every worker "
                "must then build a new strategy (or communicator)."
            )
        return prints

    # -- giving up ----------------------------------------------------------------------

    def abandon(self, seq: int, error_type: str) -> None:
        """Tell the peers, through the collective they are waiting in, that this worker quit.

        Fire and forget (the peers may never come): the predicted all-reduce of zeros
        with an abort header, so that their ops pair one for one, then the abort header
        in a header exchange. The work is kept alive with the groups (`groups.FAILED`).
        """
        header = fp.abort_print(seq, error_type, self._standing.local_count()).encode()
        predicted = self._predict()
        guessed, self._guessed = self._guessed, None
        if self._midway:
            # Part of an all-reduce's data left (a lazy fill raised midway: a backward
            # pass that raised after its first buckets left): the peers wait for the
            # rest, which nothing can send in their sizes and order, and zeros of any
            # layout would meet receives of another size. Nothing, then: the store's
            # mark names this worker to them.
            predicted = None
        elif guessed is not None and guessed.sent is not None:
            # An all-reduce left in flight with a guessed header: the peers that complete
            # it learn it before their next guess, so the zeros take the guess after it
            # (a message of another size than a peer's receive ends that process: Gloo's
            # size check). Learnt as if agreed: nothing predicts after an abort. Where
            # its guess was wrong, agreeing peers follow it with its data in its own
            # layout, which cannot be known to come: no zeros, the store's mark says it.
            if guessed.sent.buffers is None:
                predicted = None
            else:
                rows = [guessed.header] * self._standing.world_size
                self.predictor.learn(rows, guessed.layout, guessed.history)
                predicted = self._predict()
        if predicted:
            sent = Job(predicted, None, header=header)
            FAILED.extend(self.transport_for(predicted).abandon(sent))
        mine = torch.from_numpy(header)
        outs = [torch.empty_like(mine) for _ in range(self._standing.world_size)]
        work: Any = dist.all_gather(outs, mine, group=self._groups.host, async_op=True)
        FAILED.append((work, mine, outs))


class Checked:
    """An all-reduce `Integrity.start`ed: `finish` checks it and returns the results."""

    __slots__ = (
        "call",
        "detail",
        "flight",
        "header",
        "history",
        "integrity",
        "job",
        "layout",
        "sent",
    )

    def __init__(
        self,
        integrity: Integrity,
        call: Call,
        header: np.ndarray,
        layout: Layout | None,
        job: Callable[[Layout | None], Job],
        detail: Callable[[], str],
        sent: Job | None,
        flight: Flight,
    ) -> None:
        self.integrity = integrity
        self.call = call
        self.header = header
        self.layout = layout
        self.job = job
        self.detail = detail
        #: what went with the inline header (None: the headers were exchanged first).
        self.sent = sent
        self.flight = flight
        #: What the predictor learns when the inline headers agree (None: work it out).
        self.history: bytes | None = None

    def finish(self) -> list[torch.Tensor]:
        """This worker's results, once every worker's fingerprint matched."""
        return self.integrity._finish(self)
