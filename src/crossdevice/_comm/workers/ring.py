"""`RingTransport`: host all-reduces out of place, over Gloo's pairs (large ones, or few workers).

Gloo's all-reduce works in place, so an all-reduce that must leave its input unchanged
(TF's semantics, and a strategy's local sums that are the user's own arrays) first
copies the input: on the 2-core host that copy cost 17-33% of a raw Gloo all-reduce
from 1 MiB up. This transport does not copy (from 1 MiB; see `folded` below it): it
sends straight from the input and writes the sums straight into a fresh output, in two
phases of point-to-point messages on the communicator's Gloo group (the same traffic as
Gloo's own ring):

    every buffer is cut into `world_size` chunks; chunk r is rank r's, in pieces
    # reduce-scatter: every rank sends chunk q of its input to rank q, and receives
    #   chunk r of every peer's input; it sums chunk r in rank order into its output,
    #   piece by piece as the pieces come
    # all-gather: every rank sends each summed piece to every peer as soon as it is
    #   summed, and receives theirs straight into its output

Each chunk is summed once, by its owner, adding the workers' values in rank order
(`x_0 + x_1 + ...`, the same chain as the shared-memory transport), and every worker
receives those same bits: results are bitwise equal on every worker and run to run.

With few workers (`direct`: 2 by default, below `TUNING.direct_max_bytes`) the buffer is
exchanged whole instead: every rank's chunk is all of it, so every worker sends its
input to every peer, receives every peer's and sums the same chain itself, in one phase
(no all-gather). On 2 workers that sends the ring's bytes with half its wake-ups: raw
point-to-point, 1 MiB, it took 0.5-0.8x Gloo's own in-place all-reduce. Every receive is
posted before the sends; with one peer its pieces land in the output itself, and the sum
completes them in place (`x_0 + x_1` in rank order either way).

The inline fingerprint (`Job.header`) travels to every peer with the reduce-scatter and
is compared before anything is summed: a worker whose call differs (or that aborts)
sends zeros with its own header, every worker sees a difference, and none sums or goes
on to the all-gather (sizes always match: every worker sends the predicted layout). It
travels as a message of its own, sent behind the first piece (the encoded header,
compared byte for byte), or, in a whole exchange whose first buffer is one piece
(`folded`), as `INLINE_SLOTS` elements behind that buffer (its 56-bit digest, as in
Gloo's in-place all-reduce): one message per peer instead of two. Gloo's point-to-point
messages each cost a handshake and a wake-up; on the training path (476 KiB, 2 workers)
the fold saved 3-4% of a call (4 runs of 5; the fifth was even). The buffer that
carries it needs room behind its data: a strategy's packs and this transport's zeros
have it (`RoomPool`), anything else is copied into one that has (so it folds below
`TUNING.header_fold_max_bytes`, where that copy costs less than a message).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Final

import numpy as np
import torch

from crossdevice._arrays import host_kernels
from crossdevice._arrays.buffer_pool import BufferPool
from crossdevice._comm.workers.calls import Call, WaitFailedError
from crossdevice._comm.workers.groups import Groups
from crossdevice._comm.workers.health import HealthBoard
from crossdevice._comm.workers.speculation import INLINE_SLOTS, RoomPool, inline_header, numpy_dtype
from crossdevice._comm.workers.transport import Job, Layout, Reduced
from crossdevice._core import tuning

__all__ = ["SUMMED_DTYPES", "Plan", "RingTransport", "chunk_bounds", "direct", "folded", "plan"]

#: Dtypes whose sums NumPy and Gloo compute alike (integers wrap, floats round once per
#: add); bool, float16, bfloat16 and complex stay on Gloo's own all-reduce.
SUMMED_DTYPES: Final = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})

#: Tags of the messages: the header, then per piece its reduce-scatter and all-gather.
_HEADER_TAG: Final = 1
_TAG_BASE: Final = 2
#: Pieces one buffer's chunk may have (a bound on the tags of one buffer).
_MAX_PIECES: Final = 1 << 16


def direct(layout: Layout, world_size: int) -> bool:
    """Whether `layout` is exchanged whole (every rank sums it all: no all-gather).

    With `TUNING.direct_max_workers` workers or fewer and under
    `TUNING.direct_max_bytes`, every worker sends its whole input to every peer and sums
    every worker's in rank order itself: on 2 workers the ring's bytes in one phase
    instead of two (fewer wake-ups), each worker summing twice the ring's elements.
    """
    return plan(layout, world_size)[1]


def folded(layout: Layout, world_size: int) -> bool:
    """Whether an exchanged `layout`'s inline header rides behind its first buffer.

    Exchanged whole (`direct`) with a first buffer of one piece below
    `TUNING.header_fold_max_bytes`: the header's `INLINE_SLOTS` elements travel in that
    piece's message, so each peer gets one message, not a header and then the data. A
    function of the layout and the agreed tuning alone: every worker sends alike.
    """
    return plan(layout, world_size)[2]


def _nbytes(layout: Layout) -> int:
    return sum(dtype.itemsize * n for dtype, n in layout)


#: Every rank's pieces (tag, buffer, start, stop), whether exchanged whole, whether folded.
Plan = tuple[list[list[tuple[int, int, int, int]]], bool, bool]


def plan(layout: Layout, world_size: int) -> Plan:
    """(every rank's pieces, `direct`, `folded`) of `layout` under the tuning in force.

    Rank r's chunk of each buffer is cut into pieces of at most `TUNING.ring_piece_bytes`,
    so that summing one piece overlaps the transfer of the next (a function of the layout
    and the agreed tuning alone: every worker cuts alike). Per rank, its pieces are
    (tag, buffer, start, stop); each has two tags, `tag` for its reduce-scatter and
    `tag + 1` for its all-gather. In a direct exchange (`direct`) every rank's chunk is
    the whole buffer: every rank's list is the same. Worked out once per layout.
    """
    cut = tuning.TUNING
    return _plan(
        layout,
        world_size,
        cut.ring_piece_bytes,
        cut.direct_max_workers,
        cut.direct_max_bytes,
        cut.header_fold_max_bytes,
    )


@functools.lru_cache(maxsize=64)
def _plan(
    layout: Layout,
    world_size: int,
    piece_bytes: int,
    max_workers: int,
    max_bytes: int,
    fold_max_bytes: int,
) -> Plan:
    whole = world_size <= max_workers and _nbytes(layout) < max_bytes
    split = _pieces(layout, world_size, piece_bytes, whole)
    first = [piece for piece in split[0] if piece[1] == 0]
    dtype, numel = layout[0]
    fold = whole and len(first) == 1 and dtype.itemsize * numel < fold_max_bytes
    return split, whole, fold


def _pieces(
    layout: Layout, world_size: int, piece_bytes: int, whole: bool
) -> list[list[tuple[int, int, int, int]]]:
    out: list[list[tuple[int, int, int, int]]] = [[] for _ in range(world_size)]
    for j, (dtype, numel) in enumerate(layout):
        bounds = chunk_bounds(numel, world_size)
        step = max(1, piece_bytes // dtype.itemsize)
        for r in range(world_size):
            first, end = (0, numel) if whole else (bounds[r], bounds[r + 1])
            for k, lo in enumerate(range(first, end, step)):
                tag = _TAG_BASE + 2 * (j * _MAX_PIECES + k)
                out[r].append((tag, j, lo, min(lo + step, end)))
    return out


def _part(tensor: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements `lo:hi` of flat `tensor`: itself when that is all of it.

    A torch slice is a dispatcher call, which the per-call path pays several times over
    with its caches cold from the data it moved: a whole buffer's one piece (the
    exchange between 2 workers) is the buffer itself, the outputs are sliced by NumPy,
    and headers apart are compared as bytes. With these, the user path took 0.81-1.02x
    (median 0.92x) the time at 1 MiB and 0.90-1.02x (0.98x) at 4 MiB of the code
    before (18 runs of 200 rounds, each right after the other equally often), where
    the same code against itself gave 0.98x and 1.00x (8 runs).
    """
    return tensor if lo == 0 and hi == tensor.shape[0] else tensor[lo:hi]


def _numpy(dtype: torch.dtype) -> np.dtype:
    """NumPy's dtype of one of `SUMMED_DTYPES` (all of them have one)."""
    np_dtype = numpy_dtype(dtype)
    assert np_dtype is not None
    return np_dtype


def chunk_bounds(numel: int, parts: int) -> list[int]:
    """Where each rank's chunk of a buffer of `numel` elements starts (and the end)."""
    return [numel * k // parts for k in range(parts)] + [numel]


class RingTransport:
    """Out-of-place host all-reduces over the Gloo group's pairs (see the module doc).

    Args:
        groups: the communicator's process groups (the host one carries the messages).
        health: the health board whose wait loop every wait goes through.
        rank: this worker's rank.
        world_size: number of workers.
        rooms: where outputs come from (recycled once nobody holds a result).
    """

    name = "ring"

    def __init__(
        self, groups: Groups, health: HealthBoard, rank: int, world_size: int, rooms: RoomPool
    ) -> None:
        self._groups = groups
        self._health = health
        self._rank = rank
        self._world = world_size
        self._rooms = rooms
        self._scratch = BufferPool(per_key=2)
        self._zeros: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def enabled(self, layout: Layout) -> bool:
        """Host layouts of summed dtypes on 2+ workers, of at least `TUNING.ring_min_bytes`.

        Of at least `TUNING.direct_min_bytes` with `TUNING.direct_max_workers` workers or
        fewer, where they are exchanged whole (`direct`).
        """
        cut = tuning.TUNING
        least = (
            cut.direct_min_bytes if self._world <= cut.direct_max_workers else cut.ring_min_bytes
        )
        return (
            self._world > 1
            and all(dtype in SUMMED_DTYPES for dtype, _ in layout)
            and _nbytes(layout) >= least
        )

    def start(self, call: Call, job: Job) -> _RingFlight:
        """Post the header and the reduce-scatter; `finish` checks, sums and all-gathers."""
        groups, rank, world = self._groups, self._rank, self._world
        peers = [q for q in range(world) if q != rank]
        split, whole, fold = plan(job.layout, world)
        flight = _RingFlight(self, call, job, split, whole)
        # Every receive (the header's, then the data's) is posted before the first send,
        # so each message lands where it goes, and a header apart follows the first piece
        # to each peer (the sums can still start with the first piece). Against posting
        # the header's pair first, then the data's (user path, 2 workers, the two taking
        # turns in the same processes, each right after the other equally often; 8 runs
        # of 200 rounds): 1 MiB 0.92-1.06x the time (median 0.99x), 4 MiB 0.96-1.04x
        # (0.98x), where the same code against itself gave 0.96-1.06x (0.98x) and
        # 0.94-1.11x (1.00x): no gain shown beyond the noise. (Timed right after the old
        # order in 2 rounds of 3, it had seemed 0.955x: the call before counts.) Raw
        # point-to-point, 1 MiB: 0.84-0.92 ms against 0.94-1.05 ms with the sends first.
        # Posting the receives earlier still, as soon as the previous collective ended
        # (for the predicted layout; the next call takes them over), saved 0.26-0.52 ms a
        # call with 2 ms of spinning between calls, but nothing on the training epoch (+4
        # to +25 ms an epoch of 1.0-1.1 s, 4 interleaved runs of 21-31 rounds); and a
        # Gloo group cannot be freed with a receive pending. Not kept.
        inline = header = None
        if job.header is not None:
            if fold:  # behind the first buffer's one piece (`folded`)
                inline = flight.inline = inline_header(job.header)
            else:  # a message of its own, sent behind each peer's first piece
                header = self._expect_headers(flight, job.header, peers)
        fill = job.fill if job.buffers is not None else None
        sources = [self._source(job, j, dtype, n) for j, (dtype, n) in enumerate(job.layout)]
        # Where the sums go, taken here: not in the background (each with the header's
        # room behind the data: `RoomPool.room`). Sliced by NumPy, not by torch (see `_part`).
        rooms: list[np.ndarray] = []
        outputs: list[torch.Tensor] = []
        if job.buffers is not None:
            rooms = [self._rooms.room(_numpy(dtype), n) for dtype, n in job.layout]
            outputs = [
                torch.from_numpy(room[:n]) for room, (_, n) in zip(rooms, job.layout, strict=True)
            ]
            flight.outputs = outputs
        # reduce-scatter: every peer's part of this worker's chunk will come, piece by
        # piece (a lone peer's straight into the output, where the sum completes it)...
        for tag, j, lo, hi in flight.pieces[rank]:
            end = hi + INLINE_SLOTS if inline is not None and j == 0 else hi  # header behind
            if rooms and len(peers) == 1:
                whole_output = lo == 0 and end == job.layout[j][1]
                got = [outputs[j] if whole_output else torch.from_numpy(rooms[j][lo:end])]
            else:
                np_dtype = _numpy(job.layout[j][0])
                got = [torch.from_numpy(self._scratch.take(np_dtype, end - lo)) for _ in peers]
            works = [groups.recv(into, q, tag) for q, into in zip(peers, got, strict=True)]
            flight.mine.append((works, got))
        # ...and this worker's part of every peer's chunk leaves, filled first (exchanged
        # whole, every piece goes to every peer, filled before it goes to the first), a
        # header apart behind the first piece (or alone: a chunk too small for a piece).
        for q in peers:
            for k, (tag, j, lo, hi) in enumerate(flight.pieces[q]):
                first = q == peers[0]
                if fill is not None and (first or not whole):
                    fill(j, lo, hi)
                if inline is not None and j == 0:
                    if first:
                        flight.carrier = self._carrier(job, sources[0], hi, inline)
                    sent = flight.carrier
                else:
                    sent = _part(sources[j], lo, hi)
                flight.works.append(groups.send(sent, q, tag))
                if k == 0 and header is not None:
                    flight.said.append(groups.send(header, q, _HEADER_TAG))
            if header is not None and not flight.pieces[q]:
                flight.said.append(groups.send(header, q, _HEADER_TAG))
        if fill is not None and not whole:  # this worker's own part of its chunk
            for _, j, lo, hi in flight.pieces[rank]:
                fill(j, lo, hi)
        flight.sources = sources
        if job.overlap and not whole:  # exchanged whole, everything is on its way now
            flight.background()
        return flight

    def _expect_headers(
        self, flight: _RingFlight, header: np.ndarray, peers: list[int]
    ) -> torch.Tensor:
        """Post the receives of every peer's header apart; this worker's, as it is sent."""
        flight.headers = [np.empty_like(header) for _ in peers]
        headers = zip(peers, flight.headers, strict=True)
        recv = self._groups.recv
        flight.said = [recv(torch.from_numpy(into), q, _HEADER_TAG) for q, into in headers]
        return torch.from_numpy(header)

    def _carrier(
        self, job: Job, source: torch.Tensor, numel: int, inline: list[int]
    ) -> torch.Tensor:
        """The first buffer (one piece) with the inline header behind it, as it is sent.

        A buffer with room behind it (`RoomPool`: a strategy's packs, this transport's
        zeros) takes the header there; any other is copied into one that has.
        """
        room = None
        if job.buffers is None:
            room = self._zeros.get((source.dtype, numel))  # made with room by `_source`
        elif job.donated and job.donated[0]:
            room = self._rooms.room_of(source)
        if room is None:
            room = self._rooms.copy(source)
        room = room[: numel + INLINE_SLOTS]
        room.numpy()[numel:] = inline
        return room

    def _finish(self, flight: _RingFlight) -> Reduced:
        job, call, rank, world = flight.job, flight.call, self._rank, self._world
        groups, health = self._groups, self._health
        header = job.header
        if header is not None:  # the peers' first messages: watched while they come
            if flight.inline is not None:
                agree = self._arrived_inline(flight)
            else:
                health.wait_arrival(call, flight.said)
                mine = header.tobytes()
                agree = all(h.tobytes() == mine for h in flight.headers)
            if not agree:
                health.wait_messages(call, flight.works)  # every op pairs up, then the check
                for works, _ in flight.mine:
                    health.wait_messages(call, works)
                return None, False
        if job.buffers is None:  # every header agrees, so nobody's call fit: no sums
            health.wait_messages(call, flight.works)
            for works, _ in flight.mine:
                health.wait_messages(call, works)
            return None, True
        outputs = flight.outputs
        # all-gather: every peer's summed pieces come straight into the outputs (none
        # when exchanged whole: this worker sums every piece itself)...
        later: list[Any] = []
        gather = [] if flight.direct else [q for q in range(world) if q != rank]
        for q in gather:
            for tag, j, lo, hi in flight.pieces[q]:
                later.append(groups.recv(outputs[j][lo:hi], q, tag + 1))
        # ...as this worker sums its own pieces in rank order, each sent on once summed.
        for (tag, j, lo, hi), (works, got) in zip(flight.pieces[rank], flight.mine, strict=True):
            health.wait_messages(call, works)
            out = _part(outputs[j], lo, hi)
            if world == 2:  # the peer's piece is in `out`: x_0 + x_1, in place
                sums, own = out.numpy(), _part(flight.sources[j], lo, hi).numpy()
                # NumPy's own add: 1 MiB in place took 57 us against 171 us for
                # `sum_n` into a third buffer. Rank order keeps NaN payloads alike.
                np.add(*((own, sums) if rank == 0 else (sums, own)), out=sums)
            else:
                received = iter(got)
                parts = [
                    flight.sources[j][lo:hi].numpy()
                    if q == rank
                    else next(received).numpy()[: hi - lo]  # any header behind it left out
                    for q in range(world)
                ]
                host_kernels.sum_n(parts, out=out.numpy(), parallel=False)
            later.extend(groups.send(out, q, tag + 1) for q in gather)
        health.wait_messages(call, flight.works)
        health.wait_messages(call, later)
        flight.mine, flight.sources, flight.outputs, flight.carrier = [], [], [], None
        return outputs, True

    def _arrived_inline(self, flight: _RingFlight) -> bool:
        """Wait, watched, for the first piece from every peer; whether their headers match ours.

        The header rode behind that piece (`folded`); its receives are waited on here,
        once (a second wait would block for a message that never comes).
        """
        works, got = flight.mine[0]
        self._health.wait_arrival(flight.call, works)
        flight.mine[0] = ([], got)
        inline = flight.inline
        return all(into[-INLINE_SLOTS:].tolist() == inline for into in got)

    def abandon(self, job: Job) -> list[Any]:
        """Post the reduce-scatter of zeros with the abort header, without waiting.

        Each peer's sends to this worker pair with its receives here, and the header it
        gets differs from its own: it stops before the all-gather and exchanges headers.
        """
        groups, rank, world = self._groups, self._rank, self._world
        kept: list[Any] = []
        split, _, fold = plan(job.layout, world)
        inline = None
        if job.header is not None and fold:  # as `start` folds it
            inline = inline_header(job.header)
        elif job.header is not None:
            mine = torch.from_numpy(job.header)
            for q in (q for q in range(world) if q != rank):
                into = torch.empty_like(mine)
                kept += [groups.send(mine, q, _HEADER_TAG), mine]
                kept += [groups.recv(into, q, _HEADER_TAG), into]
        for q in (q for q in range(world) if q != rank):
            for tag, j, lo, hi in split[q]:
                room = INLINE_SLOTS if inline is not None and j == 0 else 0
                zeros = torch.zeros(hi - lo + room, dtype=job.layout[j][0])
                if inline is not None and room:
                    zeros.numpy()[hi - lo :] = inline
                kept += [groups.send(zeros, q, tag), zeros]
            for tag, j, lo, hi in split[rank]:
                room = INLINE_SLOTS if inline is not None and j == 0 else 0
                into = torch.empty(hi - lo + room, dtype=job.layout[j][0])
                kept += [groups.recv(into, q, tag), into]
        return kept

    def _source(self, job: Job, j: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Buffer `j` as it is sent: this worker's own, or zeros (its call did not fit)."""
        if job.buffers is not None:
            buffer = job.buffers[j]
            return buffer if buffer.dim() == 1 else buffer.reshape(-1)
        key = (dtype, numel)
        zeros = self._zeros.get(key)
        if zeros is None:
            if len(self._zeros) >= 4:
                self._zeros.clear()
            # Room behind for an inline header (`_carrier`), never part of the data.
            zeros = self._zeros[key] = torch.zeros(numel + INLINE_SLOTS, dtype=dtype)
        return zeros[:numel]


class _RingFlight:
    """A ring all-reduce whose reduce-scatter (and header) is in flight."""

    __slots__ = (
        "call",
        "carrier",
        "direct",
        "done",
        "error",
        "headers",
        "inline",
        "job",
        "mine",
        "outputs",
        "pieces",
        "result",
        "said",
        "sources",
        "transport",
        "works",
    )

    def __init__(
        self,
        transport: RingTransport,
        call: Call,
        job: Job,
        split: list[list[tuple[int, int, int, int]]],
        whole: bool,
    ) -> None:
        self.transport = transport
        self.call = call
        self.job = job
        self.pieces = split
        #: exchanged whole (`direct`): every worker sums all of it, no all-gather.
        self.direct = whole
        #: the header's sends and receives (a Gloo message is waited on once: a second
        #: wait blocks for a message that never comes).
        self.said: list[Any] = []
        #: this worker's sends of the reduce-scatter.
        self.works: list[Any] = []
        #: the peers' headers apart, as they come (NumPy: compared as bytes).
        self.headers: list[np.ndarray] = []
        #: this worker's inline header, when it rides behind the first piece (`folded`).
        self.inline: list[int] | None = None
        #: the first buffer with that header behind it, as sent (kept while it travels).
        self.carrier: Any = None
        #: per piece of this worker's chunk: its receives, and what they fill.
        self.mine: list[tuple[list[Any], list[torch.Tensor]]] = []
        self.sources: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        #: set when a background thread finished it (`background`), with its outcome.
        self.done: threading.Event | None = None
        self.result: Reduced = (None, False)
        self.error: BaseException | None = None

    def background(self) -> None:
        """Finish it on a thread of its own while the caller computes (`Job.overlap`).

        The sums and the all-gather otherwise wait for `finish`: only the reduce-scatter
        would travel meanwhile (measured, 16 MiB on 2 workers: an 8 ms computation
        between issue and wait hid 1-4 ms of the ring, all 8 ms of Gloo's all-reduce).
        """
        self.done = threading.Event()
        threading.Thread(target=self._run, name="crossdevice-ring", daemon=True).start()

    def _run(self) -> None:
        assert self.done is not None
        try:
            self.result = self.transport._finish(self)
        except BaseException as err:  # raised by `finish`, in the caller's thread
            self.error = err
        finally:
            self.done.set()

    def finish(self) -> Reduced:
        """Wait for the headers, check them, sum each piece as it comes, all-gather."""
        if self.done is None:
            return self.transport._finish(self)
        # Every wait of the thread is bounded by the call's timeout; so is this one.
        if not self.done.wait(self.call.remaining() + tuning.TUNING.backstop_slack_seconds):
            raise WaitFailedError(TimeoutError(f"no reply within {self.call.timeout:g} s"))
        if self.error is not None:
            raise self.error
        return self.result
