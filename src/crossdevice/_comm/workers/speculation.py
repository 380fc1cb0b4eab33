"""Inline fingerprints: an all-reduce checks itself in its own data, in one round trip.

A fingerprint exchange (`fingerprint.py`) before the data costs one more round trip per
collective: 0.4 to 0.6 ms with Gloo on a loaded 2-core host, 40% of a 1 MiB all-reduce.
Issuing it concurrently with the data does not help there (measured +35% at 1 MiB: the
host is CPU-bound, and every Gloo op costs its own wake-ups). So a repeated all-reduce
carries its fingerprint *inside* its data, as `INLINE_SLOTS` extra elements at the end
of its first buffer:

    every worker w puts its 56-bit fingerprint digest as 7 bytes h_w[i] and the squares
    h_w[i]**2 behind its data; after the sum, each worker checks, with its own h,
        sum_w h_w[i] == N * h[i]   and   sum_w h_w[i]**2 == N * h[i]**2   for every i.
    Then sum_w (h_w[i] - h[i])**2 == 0: every digest equals this worker's (Cauchy-
    Schwarz), and every worker reaches the same verdict from the same sums. The sums are
    integers below 2**24, exact in float32 and wider, in any order of addition.

Gloo must never see mismatched sizes (it aborts the process when it does), so the data
can only travel before the headers are compared when every worker already knows the
sizes. Training loops repeat the same collectives step after step: every worker
*predicts* the next all-reduce's layout (wire dtypes and element counts, in order) from
the collectives they already agreed on, and every worker sends exactly that layout:

    predicted layout L (same on every worker: a function of agreed history)
    send mine + inline header if my call has layout L, else zeros of L + inline header
    inline check passes, mine fit     -> the sum is the result: one round trip
    inline check passes, mine did not -> nobody's did (equal fingerprints, equal
                                         layouts): the data follows, as without a guess
    inline check fails                -> the full header exchange, which raises
                                         CollectiveMismatchError naming both sides (or
                                         WorkerFailedError for an aborted peer)

A worker running another kind of collective (a barrier while its peers all-reduce), or
aborting, sends the predicted zeros too, so the ops pair one for one. With no prediction
(a collective seen for the first time after its predecessor) the headers go first and
the data after, as before. A wrong guess costs one all-reduce of zeros of the guessed
size.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import torch

from crossdevice._arrays.buffer_pool import BufferPool
from crossdevice._comm.workers.fingerprint import SEQ_FIELD, STATE_FIELD, STRUCTURE_FIELD
from crossdevice._comm.workers.transport import Layout
from crossdevice._core import tuning
from crossdevice._sync.call import digest

__all__ = [
    "INLINE_DTYPES",
    "INLINE_SLOTS",
    "MAX_ENTRIES",
    "MAX_INLINE_WORKERS",
    "MAX_RUN",
    "ROOMS_PER_SIZE",
    "Filler",
    "Op",
    "Predictor",
    "RoomPool",
    "header_apart",
    "header_room",
    "inline_agrees",
    "inline_header",
    "layout_digest",
    "numpy_dtype",
    "speculative_ops",
]

#: Histories remembered. A training step has a handful of distinct collectives; the
#: table stops learning (every worker alike, it is the same history) once full.
MAX_ENTRIES: Final = 1024
#: Longest run of one collective whose positions each have a context (`Predictor`):
#: past it, a position is a run's known end, or the run going on.
MAX_RUN: Final = 64
#: A `Predictor` context: (the collective before the run, K, the run up to MAX_RUN).
_Context = tuple[bytes | None, bytes, int]
#: Not in a table (None is a layout: nothing predicted).
_NONE: Final = object()
#: Seven digest bytes and their squares.
_LIMBS: Final = 7
INLINE_SLOTS: Final = 2 * _LIMBS
_SQUARES: Final = [b * b for b in range(256)]
#: Dtypes whose sums of `MAX_INLINE_WORKERS` values up to 255**2 are exact integers
#: (float32: below 2**24).
INLINE_DTYPES: Final = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})
MAX_INLINE_WORKERS: Final = 256


class Predictor:
    """What the next all-reduce's host data will look like, learnt from agreed history.

    A table "in this context came an all-reduce of layout L" (or None: nothing to send
    early), where the context is the last agreed collective K (its headers), how many
    times in a row K came (its run), and the collective before that run. A training
    step whose buckets share one layout and signature (identical layers) repeats K: from
    K alone, what follows the run's last K overwrote what follows the others, and two
    guesses a step were wrong, each an all-reduce of zeros of a whole bucket (64 MiB MLP,
    4 x 2048^2: 81 MiB sent a step against DDP's 64). A context seen for the first time
    is predicted from K and its run alone, else from K alone (what followed K last), so
    a sequence is predicted from its second occurrence on, and a run from its third call.

    Runs are told apart position by position up to `MAX_RUN`, and a context's
    occurrences by their count since the last anchor (a collective of no layout: the
    epoch's has-data agreement): what follows a context is its usual, except at an
    occurrence where something else followed (`_odd`), which is predicted there next
    time. An epoch of 10 steps of 4 buckets ends after the 10th occurrence of the
    step's last bucket, followed by the next epoch's agreement, not the first bucket;
    an epoch of 128 steps of one bucket (8 examples) is a run past `MAX_RUN`, whose
    context (capped at `MAX_RUN`) ends at its 65th occurrence. A context followed by
    something else twice in a row takes that as its new usual (a program that changed).

    K is the header without its sequence number, its state and its structure digest (the
    call site and nest structure, and a `purpose` tag): the gradients' tag is the step
    count modulo 4, so with it a step's buckets were four different K in turn, and
    an epoch of 8 steps (or 10) ended after a K that also came mid-epoch: its end was
    guessed wrong every epoch (a 16 MiB bucket of zeros on the 64 MiB MLP: 8 MiB more
    written by each worker an epoch), and the mid-epoch one not guessed. The call sites
    still differ between workers where they do: every field is compared before any
    result is used.

    Every worker updates the tables from the same agreed header tables in the same
    order, so every worker predicts the same layout for the same collective. `guesses`
    and `misses` count the predictions made and those that were not the call made.
    """

    def __init__(self) -> None:
        self._last: bytes | None = None
        self._run = 0
        #: The collective before the current run of `_last`.
        self._before: bytes | None = None
        self._long: dict[tuple[bytes | None, bytes, int], Layout | None] = {}
        self._short: dict[tuple[bytes, int], Layout | None] = {}
        self._first: dict[bytes, Layout | None] = {}
        #: Occurrences of each context since the last anchor (a collective of no layout).
        self._seen: dict[_Context, int] = {}
        #: (context, occurrence): what followed it there, where that was not the usual.
        self._odd: dict[tuple[_Context, int], Layout | None] = {}
        #: Contexts whose last occurrence was followed by something not the usual.
        self._changed: set[_Context] = set()
        self._zeros: dict[Layout, list[torch.Tensor]] = {}
        self.guesses = 0
        self.misses = 0

    def predict(self) -> Layout | None:
        """The layout every worker sends with its inline header now (None: none)."""
        last = self._last
        if last is None:
            return None
        run = min(self._run, MAX_RUN)
        context = (self._before, last, run)
        if self._odd:
            at = (context, self._seen.get(context, 0) + 1)
            if at in self._odd:
                return self._odd[at]
        if context in self._long:
            return self._long[context]
        short = (last, run)
        if short in self._short:
            return self._short[short]
        return self._first.get(last)

    def learn(
        self, rows: list[np.ndarray], layout: Layout | None, key: bytes | None = None
    ) -> None:
        """Record an agreed collective: every worker's header row, and its layout.

        `layout` is the all_reduce's host layout, None for other kinds, CUDA values and
        layouts that cannot carry an inline header. Only call this once every header
        matched, so that every worker records the same thing. `key`: `history(rows)`,
        worked out beforehand (a caller that knows the rows before they are agreed).
        """
        if layout is not None and (not layout or layout[0][0] not in INLINE_DTYPES):
            layout = None
        last = self._last
        key = self.history(rows) if key is None else key
        if last is not None:
            run = min(self._run, MAX_RUN)
            self._follow((self._before, last, run), layout)
            _remember(self._short, (last, run), layout)
            _remember(self._first, last, layout)
        if layout is None:  # an anchor: occurrences count from here (see the class doc)
            self._seen.clear()
        if key == last:
            self._run += 1
        else:
            self._before, self._last, self._run = last, key, 1

    def _follow(self, context: _Context, layout: Layout | None) -> None:
        """Record that `layout` followed `context`: its usual, or an odd one out."""
        seen = self._seen
        n = seen.get(context, 0) + 1
        if context in seen or len(seen) < MAX_ENTRIES:
            seen[context] = n
        odd = self._odd.pop((context, n), _NONE) if self._odd else _NONE
        if odd is not _NONE and odd == layout:  # an odd one out that came again
            self._odd[(context, n)] = layout
            return
        # (An odd one out that did not come again is forgotten: with an anchor every
        # step, the count is 1 at every occurrence, and it would be guessed every step.)
        usual = self._long.get(context, _NONE)
        if usual is _NONE or usual == layout:
            self._changed.discard(context)
            _remember(self._long, context, layout)
        elif context in self._changed:  # twice in a row: the new usual
            self._changed.discard(context)
            self._long[context] = layout
        else:  # an odd one out at this occurrence (an epoch's end): kept apart
            if len(self._changed) < MAX_ENTRIES:
                self._changed.add(context)
            _remember(self._odd, (context, n), layout)

    def counted(self, predicted: Layout, made: Layout | None) -> str:
        """Count a prediction, and whether `made` (the call's layout) missed it.

        Returns "right" or "wrong" (`Call.guess`).
        """
        self.guesses += 1
        if predicted != made:
            self.misses += 1
            return "wrong"
        return "right"

    @staticmethod
    def history(rows: list[np.ndarray]) -> bytes:
        """What `learn` remembers of agreed header `rows` (the class doc says what not)."""
        first = rows[0]
        if len(set(map(id, rows))) == 1:  # every worker's header is this one
            return _key(first) * len(rows)
        return b"".join(_key(row) for row in rows)

    def zeros(self, layout: Layout) -> list[torch.Tensor]:
        """Zero buffers of `layout` (the first with room for the inline header).

        Sent by a worker whose call does not fit the prediction. Zeros, not uninitialised
        memory: the peers' (discarded) sums must not carry this process's memory. They are
        summed in place, so they are zeroed again before each use.
        """
        buffers = self._zeros.get(layout)
        if buffers is None:
            if len(self._zeros) >= 4:
                self._zeros.clear()
            room = 0 if header_apart(layout) else INLINE_SLOTS
            buffers = [
                torch.zeros(n + (room if i == 0 else 0), dtype=dtype)
                for i, (dtype, n) in enumerate(layout)
            ]
            self._zeros[layout] = buffers
        else:
            for b in buffers:
                b.zero_()
        return buffers


def header_apart(layout: Layout, cut: tuning.Tuning | None = None) -> bool:
    """Whether `layout`'s inline header travels apart, not behind its first buffer.

    A first buffer of `TUNING.header_apart_min_bytes` or more keeps no header behind
    it: its header travels in a small float64 all-reduce of its own, issued just before
    the data, so that a donated buffer is reduced where it lies instead of being copied
    next to room for the header. `cut`: the tuning in force (None: `TUNING`).
    """
    dtype, numel = layout[0]
    return numel * dtype.itemsize >= (cut or tuning.TUNING).header_apart_min_bytes


def header_room(layout: Layout) -> bool:
    """Whether `layout`'s inline header travels behind its first buffer (not apart).

    `not header_apart(layout)`, remembered per layout and tuning as `speculative_ops`'
    chunks are.
    """
    return not _op_spans(layout)[0]


#: One op of the predicted all-reduce: the tensor to send and the data range it holds,
#: (buffer, start, stop), or None for the header's own op.
Op = tuple[torch.Tensor, tuple[int, int, int] | None]


def speculative_ops(
    layout: Layout, tensors: list[torch.Tensor], header: np.ndarray | None
) -> tuple[list[Op], torch.Tensor | None, list[int] | None]:
    """What to all-reduce, in order, for `layout`: (ops, the header's slots, its values).

    `tensors` are the data buffers (the first with room behind it unless the header
    travels apart); `header` is this worker's encoded fingerprint (None: no inline
    header, the fingerprints were agreed before). Buffers of
    `TUNING.pipeline_min_bytes` or more leave in chunks of `TUNING.chunk_bytes`, each
    sent as soon as it is filled. The split into ops is a function of `layout` alone, so
    every worker sends the same ops.
    """
    ops: list[Op] = []
    mine: list[int] | None = None
    slots: torch.Tensor | None = None
    apart, spans = _op_spans(layout)
    if header is not None:
        mine = inline_header(header)
        if apart:
            slots = torch.tensor(mine, dtype=torch.float64)
            ops.append((slots, None))
        else:
            slots = tensors[0][-INLINE_SLOTS:]
            if slots.device.type == "cpu":
                slots.numpy()[:] = mine
            else:  # pragma: no cover - host layouts only carry inline headers
                slots.copy_(torch.tensor(mine, dtype=slots.dtype))
    for index, start, stop, last, span in spans:
        tensor = tensors[index]
        if last and not start:  # the whole buffer, any room behind it included
            ops.append((tensor, span))
        else:  # the last chunk takes any room
            ops.append((tensor[start : tensor.numel() if last else stop], span))
    return ops, slots, mine


#: (buffer, start, stop, whether it is the buffer's last chunk, the op's data range).
_Span = tuple[int, int, int, bool, tuple[int, int, int]]


def _op_spans(layout: Layout) -> tuple[bool, tuple[_Span, ...]]:
    """(`header_apart(layout)`, the chunks `speculative_ops` sends) under the tuning in force.

    Worked out once per layout and tuning (a training step repeats its layouts).
    """
    cut = tuning.TUNING
    if _SPANS.under is not cut or len(_SPANS.spans) >= 256:
        _SPANS.spans.clear()
        _SPANS.under = cut
    found = _SPANS.spans.get(layout)
    if found is not None:
        return found
    spans: list[_Span] = []
    for index, (dtype, numel) in enumerate(layout):
        step = numel
        if numel * dtype.itemsize >= cut.pipeline_min_bytes:
            step = cut.chunk_bytes // dtype.itemsize
        for start in range(0, numel, step):
            stop = min(start + step, numel)
            spans.append((index, start, stop, stop == numel, (index, start, stop)))
    found = header_apart(layout, cut), tuple(spans)
    if _SPANS.under is cut:  # not if another thread changed the tuning meanwhile
        _SPANS.spans[layout] = found
    return found


class _Spans:
    """`_op_spans`' table, and the tuning it was worked out under."""

    def __init__(self) -> None:
        self.under: tuning.Tuning | None = None
        self.spans: dict[Layout, tuple[bool, tuple[_Span, ...]]] = {}


_SPANS: Final = _Spans()


@functools.lru_cache(maxsize=256)
def layout_digest(layout: Layout | None) -> int:
    """`fingerprint.digest` of `layout` (0 for None), cached: layouts repeat every step."""
    return 0 if layout is None else digest(layout)


def inline_header(header: np.ndarray) -> list[int]:
    """The `INLINE_SLOTS` values standing for an encoded fingerprint (seq included)."""
    data = hashlib.blake2b(header.tobytes(), digest_size=_LIMBS).digest()
    return [*data, *map(_SQUARES.__getitem__, data)]


def inline_agrees(summed: torch.Tensor | np.ndarray, mine: list[int], world_size: int) -> bool:
    """Whether every worker's inline header equals `mine`, from their element-wise sum."""
    # Python compares a float sum with an int exactly (2.0 == 2, 2.5 != 2, nan != 2).
    return bool(summed.tolist() == [world_size * m for m in mine])


@functools.lru_cache(maxsize=64)
def numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """NumPy's dtype for a torch dtype, None when NumPy has none (bfloat16)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None


#: Recycled buffers kept per size (within `TUNING.buffer_pool_max_bytes`): a step's
#: buckets of one size are all alive at its end (their outputs are the gradients), each
#: beside its pack while in flight. With 2, an MLP's 4 buckets of 64 MiB took fresh
#: memory for most outputs every step, which the kernel zero-filled as Gloo received
#: into it: Gloo's I/O thread spent 172-182 ms of system CPU a step against 80-82 with 8
#: (2 runs each; `python -m benchmarks.multi_worker_mlp --width 4096`). 16 leaves room
#: for models with more buckets of one size.
ROOMS_PER_SIZE: Final = 16


def _key(row: np.ndarray) -> bytes:
    """A header as history: without its sequence number, structure digest and state.

    The sequence number differs from call to call; the structure digest: see
    `Predictor`; the state (the gradients' hyperparameters) may change every step and
    says nothing of the layout that follows.
    """
    seq, structure, state = SEQ_FIELD, STRUCTURE_FIELD, STATE_FIELD
    return b"".join(
        (
            row[:seq].tobytes(),
            row[seq + 1 : structure].tobytes(),
            row[structure + 1 : state].tobytes(),
            row[state + 1 :].tobytes(),
        )
    )


def _remember(table: dict[Any, Layout | None], context: Any, layout: Layout | None) -> None:
    """`table[context] = layout`, unless the table is full (every worker alike)."""
    if context in table or len(table) < MAX_ENTRIES:
        table[context] = layout


class RoomPool:
    """Recycled flat host buffers with room for the inline header behind their data.

    A buffer handed out by `take` is recognised later by its address (`room_of`), so a
    pack the caller filled is reduced in place, header and all, with no copy.
    """

    def __init__(self) -> None:
        self._pool = BufferPool(per_key=ROOMS_PER_SIZE)
        self._rooms: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()

    def take(self, dtype: np.dtype, numel: int) -> np.ndarray:
        """`numel` elements (contents undefined), with `INLINE_SLOTS` more behind them."""
        room = self._pool.take(dtype, numel + INLINE_SLOTS)
        address = room.ctypes.data
        if self._rooms.get(address) is not room:  # a recycled buffer is known already
            self._rooms[address] = room
        return room[:numel]

    def room(self, dtype: np.dtype, numel: int) -> np.ndarray:
        """`take`'s whole buffer: `numel` + `INLINE_SLOTS` elements (contents undefined)."""
        base = self.take(dtype, numel).base
        assert isinstance(base, np.ndarray)
        return base

    def buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A flat tensor of `numel` + `INLINE_SLOTS` elements, recycled when NumPy has it.

        `room_of` recognises it later.
        """
        np_dtype = numpy_dtype(dtype)
        if np_dtype is None:
            return torch.empty(numel + INLINE_SLOTS, dtype=dtype)
        return torch.from_numpy(self.room(np_dtype, numel))

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of host `tensor`, flat, in a buffer with `INLINE_SLOTS` more behind it.

        The copy goes through NumPy where it can: a 1 MiB `np.copyto` took 53 us against
        torch's `copy_` 88 us in one thread on the 2-core CI machine (a plain memcpy
        against a vectorised loop).
        """
        numel = tensor.numel()
        np_dtype = numpy_dtype(tensor.dtype)
        if np_dtype is None:
            room = torch.empty(numel + INLINE_SLOTS, dtype=tensor.dtype)
            room[:numel].copy_(tensor.reshape(-1))
            return room
        buf = self._pool.take(np_dtype, numel + INLINE_SLOTS)
        try:
            source = tensor.numpy()  # raises for a conjugate or negative bit, or off the host
        except (RuntimeError, TypeError):
            torch.from_numpy(buf[:numel]).copy_(tensor.reshape(-1))
        else:
            np.copyto(buf[:numel].reshape(source.shape), source)
        return torch.from_numpy(buf)

    def room_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The buffer from `take` that `tensor` fills, header room included, or None."""
        room = self._rooms.get(tensor.data_ptr()) if tensor.device.type == "cpu" else None
        if room is None or not tensor.is_contiguous():
            return None
        whole = torch.from_numpy(room)
        if whole.dtype != tensor.dtype or whole.numel() < tensor.numel() + INLINE_SLOTS:
            return None
        return whole[: tensor.numel() + INLINE_SLOTS]

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """`torch.cat(tensors)` into a recycled buffer with room (host tensors)."""
        if tensors[0].device.type != "cpu":
            return torch.cat(tensors)
        total = sum(t.numel() for t in tensors)
        return torch.cat(tensors, out=self.buffer(tensors[0].dtype, total)[:total])


class Filler:
    """Runs a caller's `fill(i, start, stop)` once per range: by chunks, or all at once.

    Args:
        fill: writes elements `start:stop` of buffer `i` (or, given `out=`, into that
            flat array of `stop - start` elements instead) and returns whether it wrote;
            None: nothing to write.
        sizes: every buffer's element count (empty buffers are not sent, so the ops'
            buffer numbers count the non-empty ones only).
    """

    def __init__(self, fill: Callable[..., bool] | None, sizes: list[int]) -> None:
        self._fill = fill
        self._done = fill is None
        self._sizes = sizes
        self._live = [k for k, n in enumerate(sizes) if n]

    def all(self) -> None:
        """Fill every buffer whole, unless done already."""
        if self._fill is not None and not self._done:
            self._done = True
            for k in self._live:
                self._fill(k, 0, self._sizes[k])

    def live(self, j: int, start: int, stop: int, out: np.ndarray | None = None) -> bool:
        """Fill a range of the `j`-th non-empty buffer (one op's data), unless all done.

        With `out`, the range is written there instead of into the buffer (shared
        memory's slots). Returns whether anything was written (the caller's `fill` says:
        a buffer that holds its data already, as a caller's own array does, is not).
        """
        if self._fill is None or self._done:
            return False
        if out is None:
            return bool(self._fill(self._live[j], start, stop))
        return bool(self._fill(self._live[j], start, stop, out=out))
