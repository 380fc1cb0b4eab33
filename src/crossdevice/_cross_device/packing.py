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
import math
from collections.abc import Sequence
from typing import Any

from crossdevice._arrays import backend_for
from crossdevice._arrays.packing import group_by_key, split_sizes

__all__ = ["PackPlan", "pack", "plan_packs", "split_sizes", "unpack"]


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """How a batch of arrays is packed.

    Attributes:
        num_packs: pieces per dtype group; 0 means every array is its own piece.
        shapes: the shape of each array of the batch, in order.
        groups: per dtype group (of one array library), the indices of its arrays in the
            batch (empty when `num_packs` is 0).
        piece_sizes: per dtype group, the element count of each piece.
    """

    num_packs: int
    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[int, ...], ...]
    piece_sizes: tuple[tuple[int, ...], ...]

    @property
    def borrows(self) -> bool:
        """Whether some pieces are views of the caller's arrays (never write into them).

        With `num_packs=0` every piece is an input; a dtype group of one array is packed as
        a flat view of it instead of a copy (large single tensors are not copied twice).
        """
        return self.num_packs == 0 or any(len(group) == 1 for group in self.groups)

    def borrowed_pieces(self) -> list[bool]:
        """For each piece, whether it is (a view of) one of the caller's arrays."""
        if self.num_packs == 0:
            return [True] * len(self.shapes)
        return [
            len(group) == 1
            for group, sizes in zip(self.groups, self.piece_sizes, strict=True)
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
    groups = tuple(tuple(indices) for indices in group_by_key(keys))
    sizes = tuple(
        split_sizes(sum(math.prod(shapes[i]) for i in group), num_packs) for group in groups
    )
    return PackPlan(num_packs, shapes, groups, sizes)


def pack(plan: PackPlan, arrays: Sequence[Any]) -> list[Any]:
    """One device's arrays as the plan's pieces; `arrays` are not modified.

    Pieces of several arrays are new buffers; see `PackPlan.borrowed_pieces` for the
    ones that are views of `arrays` (with `num_packs=0`, the arrays themselves).
    """
    if plan.num_packs == 0:
        return list(arrays)
    pieces: list[Any] = []
    for group, sizes in zip(plan.groups, plan.piece_sizes, strict=True):
        members = [arrays[i] for i in group]
        backend = backend_for(members[0])
        # One array needs no concatenation: its flat view (a copy only if not contiguous).
        flat = members[0].reshape(-1) if len(members) == 1 else backend.pack(members)
        if len(sizes) == 1:
            pieces.append(flat)
        else:
            pieces.extend(backend.unpack(flat, [(n,) for n in sizes]))
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
    for group, sizes in zip(plan.groups, plan.piece_sizes, strict=True):
        members = pieces[start : start + len(sizes)]
        start += len(sizes)
        backend = backend_for(members[0])
        flat = members[0] if len(members) == 1 else backend.concat(members, 0)
        for i, array in zip(
            group, backend.unpack(flat, [plan.shapes[i] for i in group]), strict=True
        ):
            out[i] = array
    return out
