"""`HierarchicalCopyAllReduce`: TF's DGX-1 hierarchical copy, correct for every N."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, final

from crossdevice._comm.devices import algorithms
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._cross_device.all_reduce import AllReduceCrossDeviceOps

__all__ = ["HierarchicalCopyAllReduce"]


@final
class HierarchicalCopyAllReduce(AllReduceCrossDeviceOps):
    """Hierarchical copy all-reduce (`tf.distribute.HierarchicalCopyAllReduce`).

    It reduces to one device along the edges of a hierarchy and broadcasts back along
    the same path: the devices split into two halves, each half is summed on its root,
    the roots exchange, and every device copies from its half's root. The roots rotate
    from one tensor (or pack) to the next to spread the load.

    It is a DGX-1 algorithm: the hierarchy matches the DGX-1's partial NVLink mesh (GPUs
    0-3 and 4-7 fully connected, i <-> i+4 links between them). On NVSwitch machines
    (DGX-2, HGX A100/H100), where every GPU reaches every other at full bandwidth, it
    brings no benefit: it concentrates the traffic on two roots where `NcclAllReduce`
    spreads it over every GPU (with copies between GPUs, the GPU review's model put it at
    about 7x raw NCCL's time on 8 H100s). Prefer `NcclAllReduce` on GPUs.

    On distinct CUDA devices, each half is reduced onto its root with one
    `torch.cuda.nccl.reduce` and the total broadcast back with `torch.cuda.nccl.broadcast`
    (as `torch.nn.parallel.comm` does), for dtypes NCCL sums natively; the halves are
    then summed in NCCL's order, not bit for bit in replica order as on the host.

    Unlike TF, which silently drops the last device's value for an odd number of
    devices, every device is summed for any N. Reduces that are not all-reduces (the
    destinations are not the value's devices) fall back to `ReductionToOneDevice`.

    Args:
        num_packs: a non-negative int: the number of flat buffers per dtype that a batch
            is packed into; 0 means one all-reduce per array.

    Raises:
        ValueError: `num_packs` is negative.

    Example:
        >>> import numpy as np
        >>> from crossdevice._values.values import PerReplica
        >>> value = PerReplica([np.array([1, 2]), np.array([3, 4])])  # on CPU:0 and CPU:1
        >>> HierarchicalCopyAllReduce().reduce("sum", value, value).values[1].tolist()
        [4, 6]
    """

    _NUM_PACKS_ERROR: ClassVar[str] = (
        "HierarchicalCopy requires num_packs >= 0, but {} is specified"
    )
    _ALGORITHM: ClassVar[str] = "hierarchical_copy"

    def _all_reduce_pieces(
        self,
        reduce_op: ReduceOp,
        pieces: list[list[Any]],
        devices: tuple[str, ...],
        borrowed: Sequence[bool],
    ) -> list[list[Any]]:
        """Hierarchical copy of each piece, rotating the roots with the piece index."""
        del borrowed  # the algorithm never writes its inputs
        out: list[list[Any]] = [[] for _ in devices]
        for k in range(len(pieces[0])):
            reduced = algorithms.hierarchical_copy_all_reduce(
                [device_pieces[k] for device_pieces in pieces], devices, reduce_op, index=k
            )
            for device_out, value in zip(out, reduced, strict=True):
                device_out.append(value)
        return out
