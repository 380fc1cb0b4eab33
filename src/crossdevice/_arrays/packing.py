"""The one packer: arrays grouped by a key, cut into packs by a size policy, filled, unpacked.

Every place that packs many arrays into few flat buffers does the same four things, with
its own key and size policy:

* group by key, in order of first appearance (`group_by_key`): a pack holds one dtype
  (and one array library, one device);
* cut each group into packs (`group_by_size`: TF's `bytes_per_pack`, or with `cap=True`
  a ceiling, the gradient buckets' `bucket_cap_bytes`; a whole group; or TF's
  `num_packs` pieces of one flat buffer, `split_sizes`);
* fill a pack, range by range, just before it is needed (`Pack.fill`): each member's
  range is the sum of its components in order (one component: a copy), so a pack can
  be written as it leaves, or straight into a transport's slot; or all at once
  (`Pack.fill_all`);
* unpack a reduced pack into its members' shapes, as views (`Pack.unpack`, NumPy arrays
  and torch tensors alike).

Users: the cross-worker all-reduce of a strategy (`_cross_device/collective.py`), the
worker communicator's `batch_all_reduce` (`_comm/workers/packs.py`), the per-device
pieces of TF's `num_packs` (`_cross_device/packing.py`), the replica threads' small
arrays (`_comm/local/host_reduce.py`, `reduction.py`), and the torch layer's gradient
buckets and chief broadcast (`_frameworks/torch/gradients.py`, `buckets.py`,
`module.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

__all__ = ["Pack", "group_by_key", "group_by_size", "plan", "split_sizes"]


def group_by_key(keys: Sequence[Hashable]) -> list[list[int]]:
    """Indices grouped by equal key, groups in order of their first member.

    Example:
        >>> group_by_key(["f", "i", "f"])
        [[0, 2], [1]]
    """
    groups: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    return list(groups.values())


def group_by_size(nbytes: Sequence[int], bytes_per_pack: int, cap: bool = False) -> list[list[int]]:
    """Split value indices into packs of about `bytes_per_pack` bytes, in order.

    TF's `cross_device_utils.group_by_size` (the default): a new pack starts once the
    current one holds more than `bytes_per_pack` bytes, so every pack but the last has at
    least that many and a value is never split. `bytes_per_pack=0` puts everything in one
    pack.

    `cap=True` makes `bytes_per_pack` a ceiling instead (the torch layer's gradient
    buckets, whose `bucket_cap_bytes` is documented as the largest bucket): a new pack
    starts before a value would take the current one over it, so no pack holds more
    unless one value alone does. The rules cut differently (TF's packs end just over
    the size, these just under it), and each user keeps the boundaries it always had.

    Example:
        >>> group_by_size([4, 4, 4, 4, 4], 6)
        [[0, 1], [2, 3], [4]]
        >>> group_by_size([4, 4, 4, 4, 4], 6, cap=True)
        [[0], [1], [2], [3], [4]]
    """
    if bytes_per_pack < 0 or (cap and bytes_per_pack == 0):
        least = 1 if cap else 0
        raise ValueError(f"Argument bytes_per_pack must be >={least}, Received {bytes_per_pack}.")
    if bytes_per_pack == 0:
        return [list(range(len(nbytes)))] if nbytes else []
    packs: list[list[int]] = []
    last_size = 0
    for index, size in enumerate(nbytes):
        full = last_size + size > bytes_per_pack if cap else last_size > bytes_per_pack
        if not packs or full:
            packs.append([])
            last_size = 0
        packs[-1].append(index)
        last_size += size
    return packs


def split_sizes(total: int, num_packs: int) -> tuple[int, ...]:
    """TF's `num_packs` piece sizes: `[s] * (k - 1) + [total - s * (k - 1)]`, `s = total // k`.

    Example:
        >>> split_sizes(10, 3)
        (3, 3, 4)
        >>> split_sizes(2, 4)
        (0, 0, 0, 2)
    """
    if num_packs < 1:
        raise ValueError(f"split_sizes needs num_packs >= 1, got {num_packs}")
    size = total // num_packs
    return (size,) * (num_packs - 1) + (total - size * (num_packs - 1),)


@dataclasses.dataclass(frozen=True, slots=True)
class Pack:
    """Some arrays of a batch, one after the other in one flat buffer.

    Attributes:
        members: the arrays' indices in the batch, in order.
        shapes: each member's shape.
        offsets: where each member starts in the flat buffer (and, last, its size).
    """

    members: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, shapes: Sequence[tuple[int, ...]], members: Sequence[int] | None = None) -> Pack:
        """The pack of arrays of `shapes`, one after the other.

        Args:
            shapes: each member's shape, in order.
            members: the members' indices in the batch (default `0, 1, ...`).

        Example:
            >>> Pack.of([(2, 3), ()], members=[4, 1]).offsets
            (0, 6, 7)
        """
        offsets = [0]
        for shape in shapes:
            offsets.append(offsets[-1] + math.prod(shape))
        indices = range(len(shapes)) if members is None else members
        return cls(tuple(indices), tuple(tuple(s) for s in shapes), tuple(offsets))

    @property
    def size(self) -> int:
        """Elements of the flat buffer."""
        return self.offsets[-1]

    def fill(
        self,
        parts: Callable[[int], Sequence[np.ndarray]],
        start: int,
        stop: int,
        dest: np.ndarray,
        add: Callable[..., Any],
    ) -> None:
        """Write elements `start:stop` of this pack into `dest` (`stop - start` elements).

        `parts(i)` are member i's flat components (one: copied; several: summed in
        order by `add(flats, out=...)`).
        """
        for k, i in enumerate(self.members):
            lo, hi = self.offsets[k], self.offsets[k + 1]
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                flats = [c[a - lo : b - lo] for c in parts(i)]
                out = dest[a - start : b - start]
                if len(flats) == 1:
                    np.copyto(out, flats[0])
                else:
                    add(flats, out=out)

    def fill_all(self, arrays: Sequence[np.ndarray], dest: np.ndarray) -> None:
        """Write the whole pack into `dest` at once, member i from `arrays[i]` (any shape).

        What `fill` over every element writes with one component per member, in one
        NumPy call: the eager fill of packs of many small arrays, where a Python step
        per member would cost more than the copies.
        """
        np.concatenate([arrays[i] for i in self.members], axis=None, out=dest)

    def unpack(self, flat: Any) -> list[Any]:
        """The members, in order, as views of the reduced flat buffer in their shapes."""
        return [
            flat[self.offsets[k] : self.offsets[k + 1]].reshape(shape)
            for k, shape in enumerate(self.shapes)
        ]


def plan(
    keys: Sequence[Hashable],
    shapes: Sequence[tuple[int, ...]],
    itemsizes: Sequence[int],
    bytes_per_pack: int = 0,
    alone: Callable[[int], bool] | None = None,
) -> list[Pack]:
    """The packs of a batch: grouped by key, cut into packs of about `bytes_per_pack`.

    Args:
        keys: per array, what a pack must share (its dtype, library, device).
        shapes: per array, its shape.
        itemsizes: per array, its element size in bytes.
        bytes_per_pack: TF's `bytes_per_pack` (0: one pack per key).
        alone: arrays for which it is true get a pack of their own, first (sent as
            they are, unpacked).

    Returns:
        The packs, those of single arrays first, then by key in order of appearance.
    """
    single = [i for i in range(len(keys)) if alone is not None and alone(i)]
    rest = [i for i in range(len(keys)) if i not in set(single)]
    groups = [[rest[j] for j in g] for g in group_by_key([keys[i] for i in rest])]
    packs: list[list[int]] = [[i] for i in single]
    for members in groups:
        nbytes = [math.prod(shapes[i]) * itemsizes[i] for i in members]
        packs.extend([members[j] for j in p] for p in group_by_size(nbytes, bytes_per_pack))
    return [Pack.of([shapes[i] for i in members], members) for members in packs]
