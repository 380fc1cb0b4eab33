"""Pure host reductions: how to reduce one input signature, and the in-order piece kernel.

A *plan* depends only on the shapes and dtypes of one replica's arrays (the same in every
replica): arrays are grouped by dtype, small ones are packed into one flat buffer per
group, large ones are reduced in place from the caller's memory. `reduce_pieces` adds the
replicas' inputs in replica order, `((x0 + x1) + x2) + ...` element by element, so results
are bitwise reproducible and equal to the naive in-order chain whatever the thread timing.

No locks and no waiting here: the rendezvous (`crossdevice._sync.rendezvous`) and
the communicator (`crossdevice._comm.local.thread`) decide who runs which piece.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from crossdevice._arrays.host_kernels import sum_slice
from crossdevice._arrays.packing import Pack, group_by_key
from crossdevice._core import tuning

__all__ = [
    "ALIGN_BYTES",
    "Plan",
    "Segment",
    "describe_sig",
    "make_plan",
    "reduce_pieces",
]


#: Cache-line alignment of the replicas' slice boundaries (no false sharing).
ALIGN_BYTES: Final = 64


def describe_sig(sig: tuple[Any, ...]) -> str:
    """`[float32[3], int64[]]`: the (shape, dtype) of each array, as messages show them."""
    return "[" + ", ".join(f"{dtype}{list(shape)}" for shape, dtype in sig) + "]"


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous piece of one dtype group's flat output and where its inputs are."""

    group: int
    offset: int
    length: int
    #: index of the input array reduced directly, or -1 for the group's pack.
    source: int


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """How to reduce one input signature (cached; depends on shapes and dtypes only)."""

    dtypes: tuple[np.dtype, ...]
    #: per dtype group: its arrays in the group's flat output (the one packer's `Pack`),
    #: the small ones first, then the large ones.
    layouts: tuple[Pack, ...]
    #: per dtype group: the pack its small arrays are copied into before the round (the
    #: layout's first members), or None: fewer than two small arrays (one is reduced
    #: from the caller's memory, as the large ones are).
    packs: tuple[Pack | None, ...]
    #: per input array: (its dtype group, its place among the group layout's members).
    where: tuple[tuple[int, int], ...]
    segments: tuple[Segment, ...]
    total_bytes: int
    #: per piece size: the (segment index, lo, hi) pieces of the work.
    splits: dict[int, tuple[tuple[int, int, int], ...]] = dataclasses.field(
        default_factory=dict, compare=False
    )

    def pieces(self, piece_bytes: int) -> tuple[tuple[int, int, int], ...]:
        """The work cut into (segment index, lo, hi) pieces of at most `piece_bytes`.

        Small segments stay whole; boundaries inside a segment fall on cache lines, so
        replicas writing neighbouring pieces never share one.
        """
        cached = self.splits.get(piece_bytes)
        if cached is not None:
            return cached
        pieces: list[tuple[int, int, int]] = []
        for index, seg in enumerate(self.segments):
            itemsize = self.dtypes[seg.group].itemsize
            align = max(1, ALIGN_BYTES // itemsize)
            step = max(align, piece_bytes // itemsize // align * align)
            pieces.extend(
                (index, lo, min(lo + step, seg.length)) for lo in range(0, seg.length, step)
            )
        result = tuple(pieces)
        self.splits[piece_bytes] = result
        return result


def make_plan(sig: tuple[tuple[tuple[int, ...], np.dtype], ...]) -> Plan:
    """The plan of `sig` ((shape, dtype) per array), built on the one packer.

    Grouped by dtype (`group_by_key`); in each group the arrays under
    `TUNING.pack_below_bytes` are packed (their per-call cost dominates), the others are
    reduced where they lie, each a segment of its own after the pack.
    """
    dtypes: list[np.dtype] = []
    layouts: list[Pack] = []
    packs: list[Pack | None] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(sig)
    segments: list[Segment] = []
    total = 0
    for g, indices in enumerate(group_by_key([dtype for _, dtype in sig])):
        dtype = sig[indices[0]][1]
        small: list[int] = []
        large: list[int] = []
        for i in indices:
            nbytes = math.prod(sig[i][0]) * dtype.itemsize
            (small if nbytes < tuning.TUNING.pack_below_bytes else large).append(i)
        layout = Pack.of([sig[i][0] for i in small + large], small + large)
        for k, i in enumerate(layout.members):
            where[i] = (g, k)
        pack_size = layout.offsets[len(small)]
        if len(small) == 1:
            # One small array needs no pack: reduce it from the caller's memory.
            segments.append(Segment(g, 0, pack_size, small[0]))
        elif pack_size:
            segments.append(Segment(g, 0, pack_size, -1))
        for k in range(len(small), len(layout.members)):
            offset = layout.offsets[k]
            segments.append(Segment(g, offset, layout.offsets[k + 1] - offset, layout.members[k]))
        dtypes.append(dtype)
        layouts.append(layout)
        packs.append(Pack.of(layout.shapes[: len(small)], small) if len(small) > 1 else None)
        total += layout.size * dtype.itemsize
    return Plan(
        dtypes=tuple(dtypes),
        layouts=tuple(layouts),
        packs=tuple(packs),
        where=tuple(where),
        segments=tuple(segments),
        total_bytes=total,
    )


def reduce_pieces(
    plan: Plan,
    outputs: Sequence[np.ndarray],
    arrays: Sequence[Sequence[np.ndarray]],
    packs: Sequence[Sequence[np.ndarray | None] | None],
    mean: bool,
    pieces: Sequence[tuple[int, int, int]],
    blocked: bool = False,
) -> None:
    """Reduce `pieces` of `plan`'s segments across replicas into `outputs`, in replica order.

    Args:
        plan: the plan of the replicas' (common) signature.
        outputs: one flat output per dtype group.
        arrays: per replica, its host arrays.
        packs: per replica, its packed small arrays per dtype group (None: no packs).
        mean: divide floating results by the number of replicas (integer means are
            divided when results are handed out, as NumPy's `true_divide` would).
        pieces: (segment index, lo, hi) pieces to reduce.
        blocked: cut each piece into L2-sized blocks (several replicas reduce at once).
    """
    n = len(arrays)
    for index, lo, hi in pieces:
        seg = plan.segments[index]
        out = outputs[seg.group][seg.offset : seg.offset + seg.length]
        if seg.source >= 0:
            src = seg.source
            inputs = [a[src].reshape(-1) for a in arrays]
        else:
            inputs = [p[seg.group] for p in packs]  # type: ignore[index,misc]
        dtype = plan.dtypes[seg.group]
        divide = mean and dtype.kind in "fc"
        # Sharded pieces are cut into L2-sized blocks: with every replica thread
        # reducing a piece at once, whole pieces would crowd each other out of the
        # shared L3 (measured, 198 MB in 4 MiB pieces: 60-84 ms whole, 49 ms blocked).
        block = tuning.TUNING.block_bytes // dtype.itemsize if blocked else None
        stream = outputs[seg.group].nbytes >= tuning.TUNING.stream_min_bytes
        sum_slice(
            inputs,
            out,
            lo,
            hi,
            divisor=n if divide else None,
            block_elements=block,
            stream=stream,
        )
