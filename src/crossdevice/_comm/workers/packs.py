"""Many values in few flat buffers across workers: `batch_all_reduce_async`, `LazyPacks`.

The values are grouped by kind, device and dtype and cut into packs of about
`bytes_per_pack` bytes by the one packer (`crossdevice._arrays.packing`); every pack is
reduced in one numbered collective, filled range by range as the transport sends it
(`LazyPacks`), and unpacked into views in the values' shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from crossdevice._arrays.packing import Pack, plan
from crossdevice._comm.protocol import Done, Pending, ReduceOptions, Then
from crossdevice._comm.workers.speculation import RoomPool
from crossdevice._comm.workers.wire import Wire, divide
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._sync.call import CallSignature

__all__ = ["LazyPacks", "batch_all_reduce_async"]


class LazyPacks:
    """Flat packs of tensors, each filled only as the communicator sends it.

    Host packs of NumPy dtypes are recycled `RoomPool` buffers whose contents `fill`
    copies from the tensors range by range (`packing.Pack.fill`): into the pack just
    before Gloo sends it, or straight into a shared-memory slot (then the pack itself is
    never written: one copy instead of two). Other packs (CUDA, bfloat16) are
    concatenated at once.

    Args:
        rooms: where the host packs come from.
        groups: the tensors of each pack, flat, in order.
    """

    def __init__(self, rooms: RoomPool, groups: list[list[torch.Tensor]]) -> None:
        self.flats: list[torch.Tensor] = []
        self._packs: list[tuple[Pack, list[np.ndarray]] | None] = []
        for tensors in groups:
            total = sum(t.numel() for t in tensors)
            flat = None
            if all(t.device.type == "cpu" for t in tensors):
                flat = rooms.buffer(tensors[0].dtype, total)[:total]
            if flat is not None and rooms.room_of(flat) is not None:
                self.flats.append(flat)
                parts = [t.reshape(-1).numpy() for t in tensors]
                shapes = [(p.size,) for p in parts]
                pack = Pack.of(shapes)
                self._packs.append((pack, parts))
            else:
                self.flats.append(rooms.pack(tensors))
                self._packs.append(None)

    def fill(self, k: int, start: int, stop: int, out: np.ndarray | None = None) -> bool:
        """Write elements `start:stop` of pack `k` into it (or into `out`); True."""
        lazy = self._packs[k]
        if lazy is None:  # packed already
            if out is not None:  # byte for byte: bfloat16 has no NumPy dtype
                data = self.flats[k][start:stop].view(torch.uint8).numpy()
                np.copyto(out.view(np.uint8), data)
            return True
        pack, parts = lazy
        dest = self.flats[k][start:stop].numpy() if out is None else out
        pack.fill(lambda i: [parts[i]], start, stop, dest, np.add)
        return True


def batch_all_reduce_async(
    all_reduce_async: Callable[..., Pending],
    to_wire: Callable[[Any], Wire],
    rooms: RoomPool,
    values: Sequence[Any],
    options: ReduceOptions | ReduceOp | str,
    bytes_per_pack: int,
    world_size: int,
) -> Then | Done:
    """Pack `values`, issue the all-reduce of the packs (one collective); `wait` unpacks.

    Args:
        all_reduce_async: the communicator's `all_reduce_async` (donated packs, lazily
            filled).
        to_wire: the communicator's conversion of a value to what travels.
        rooms: where the host packs come from.
        values: arrays of any shapes and dtypes, the same on every worker.
        options: the reduction (its signature defaults to the values' shapes and dtypes).
        bytes_per_pack: TF's pack size (0: one pack per group).
        world_size: the number of workers (MEAN's divisor by default).

    Returns:
        A pending collective whose `wait()` returns the reduced values, in the order and
        of the kinds of `values`.
    """
    opts = ReduceOptions.of(options)
    wires = [to_wire(v) for v in values]
    count = opts.divide_by(world_size)
    if opts.signature is None:
        leaves = tuple((w.shape, w.dtype) for w in wires)
        opts = opts.replace(signature=CallSignature("all_reduce", opts.op.name, None, leaves))
    packs = plan(
        [(w.kind, w.tensor.device, w.tensor.dtype) for w in wires],
        [(w.tensor.numel(),) for w in wires],
        [w.tensor.element_size() for w in wires],
        bytes_per_pack,
    )
    if not packs:
        return Done([])
    lazy = LazyPacks(rooms, [[wires[i].tensor.reshape(-1) for i in p.members] for p in packs])
    summed = opts.replace(op=ReduceOp.SUM, divisor=None)

    def unpack(flats: list[torch.Tensor]) -> list[Any]:
        results: list[Any] = [None] * len(wires)
        for pack, flat in zip(packs, flats, strict=True):
            first = wires[pack.members[0]]
            exact = flat.dtype == first.dtype
            if count is not None and exact and (flat.is_floating_point() or flat.is_complex()):
                flat.div_(count)  # one division per pack instead of per value
                exact = False
            for i, piece in zip(pack.members, pack.unpack(flat), strict=True):
                result = wires[i].result(piece.view(wires[i].tensor.shape))
                # Integer MEAN: divide in the value's own backend, as all_reduce does.
                results[i] = divide(result, count) if count is not None and exact else result
        return results

    return Then([all_reduce_async(lazy.flats, summed, donate=True, fill=lazy.fill)], unpack)
