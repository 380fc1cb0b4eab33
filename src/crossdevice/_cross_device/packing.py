"""Packing a batch of arrays into `num_packs` flat buffers per dtype, and back.

TF's `num_packs` policy over the one packer (`crossdevice._arrays.packing`):
TF's `_ConcatAndSplitPacker` concatenates every tensor of a device into one 1-D buffer
and splits it into `num_packs` pieces of sizes `[s] * (k - 1) + [total - s * (k - 1)]`
with `s = total // k`; `k > total` gives empty pieces, which still reduce correctly.
TF needs all tensors to share one dtype (concat fails otherwise); we group the tensors
by dtype, in order of first appearance, and pack each group separately. `num_packs=0`
means no packing: each array is its own piece.

A `PackPlan` depends only on the shapes and dtypes, so it is computed once for a
batch and used on every device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from crossdevice._arrays import backend_for
from crossdevice._arrays.packing import Pack, split_sizes
from crossdevice._arrays.packing import plan as plan_by_key

__all__ = ["PackPlan", "pack", "plan_packs", "split_sizes", "unpack"]


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """How a batch of arrays is packed.

    Attributes:
        num_packs: pieces per dtype group; 0 means every array is its own piece.
        shapes: the shape of each array of the batch, in order.
        packs: per dtype group (of one array library), its arrays one after the other in
            one flat buffer (the one packer's `Pack`; empty when `num_packs` is 0).
        piece_sizes: per dtype group, the element count of each piece of that buffer.
    """

    num_packs: int
    shapes: tuple[tuple[int, ...], ...]
    packs: tuple[Pack, ...]
    piece_sizes: tuple[tuple[int, ...], ...]

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Per dtype group, the indices of its arrays in the batch."""
        return tuple(p.members for p in self.packs)

    @property
    def borrows(self) -> bool:
        """Whether some pieces are views of the caller's arrays (never write into them).

        With `num_packs=0` every piece is an input; a dtype group of one array is packed as
        a flat view of it instead of a copy (large single tensors are not copied twice).
        """
        return self.num_packs == 0 or any(len(p.members) == 1 for p in self.packs)

    def borrowed_pieces(self) -> list[bool]:
        """For each piece, whether it is (a view of) one of the caller's arrays."""
        if self.num_packs == 0:
            return [True] * len(self.shapes)
        return [
            len(p.members) == 1
            for p, sizes in zip(self.packs, self.piece_sizes, strict=True)
            for _ in sizes
        ]

    @property
    def num_pieces(self) -> int:
        """How many buffers one device sends."""
        if self.num_packs == 0:
            return len(self.shapes)
        return sum(len(sizes) for sizes in self.piece_sizes)


def plan_packs(arrays: Sequence[Any], num_packs: int) -> PackPlan:
    """The plan to pack `arrays` (one device's batch) into `num_packs` pieces per dtype.

    Args:
        arrays: the batch of one device, in order.
        num_packs: pieces per dtype group, >= 0.

    Returns:
        The plan; use it for every device of the batch.
    """
    if num_packs < 0:
        raise ValueError(f"num_packs must be >= 0, got {num_packs}")
    shapes = tuple(backend_for(a).shape(a) for a in arrays)
    if num_packs == 0:
        return PackPlan(0, shapes, (), ())
    # Group by array library as well as dtype: a NumPy float32 (what a Python float
    # becomes) and a torch float32 tensor cannot be concatenated into one buffer.
    keys = [(type(backend_for(a)).__name__, backend_for(a).dtype_name(a)) for a in arrays]
    # One pack per key (no size policy: bytes_per_pack=0), so element sizes do not matter.
    packs = tuple(plan_by_key(keys, shapes, [1] * len(arrays)))
    sizes = tuple(split_sizes(p.size, num_packs) for p in packs)
    return PackPlan(num_packs, shapes, packs, sizes)


def pack(plan: PackPlan, arrays: Sequence[Any]) -> list[Any]:
    """One device's arrays as the plan's pieces; `arrays` are not modified.

    Pieces of several arrays are new buffers; see `PackPlan.borrowed_pieces` for the
    ones that are views of `arrays` (with `num_packs=0`, the arrays themselves).
    """
    if plan.num_packs == 0:
        return list(arrays)
    pieces: list[Any] = []
    for group, sizes in zip(plan.packs, plan.piece_sizes, strict=True):
        members = [arrays[i] for i in group.members]
        # One array needs no concatenation: its flat view (a copy only if not contiguous).
        # Several: one eager concatenation in their library (torch, CUDA included;
        # `Pack.fill` writes NumPy buffers only).
        flat = (
            members[0].reshape(-1) if len(members) == 1 else backend_for(members[0]).pack(members)
        )
        if len(sizes) == 1:
            pieces.append(flat)
        else:
            pieces.extend(Pack.of([(n,) for n in sizes]).unpack(flat))
    return pieces


def unpack(plan: PackPlan, pieces: Sequence[Any]) -> list[Any]:
    """The arrays of the batch, in order and shape, from the plan's (reduced) pieces.

    Results may be views into one buffer per dtype group.
    """
    if len(pieces) != plan.num_pieces:
        raise ValueError(
            f"unpack expected {plan.num_pieces} pieces for this plan, got {len(pieces)}"
        )
    if plan.num_packs == 0:
        return list(pieces)
    out: list[Any] = [None] * len(plan.shapes)
    start = 0
    for group, sizes in zip(plan.packs, plan.piece_sizes, strict=True):
        members = pieces[start : start + len(sizes)]
        start += len(sizes)
        flat = members[0] if len(members) == 1 else backend_for(members[0]).concat(members, 0)
        for i, array in zip(group.members, group.unpack(flat), strict=True):
            out[i] = array
    return out
