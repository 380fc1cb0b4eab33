"""`NcclAllReduce`: NCCL all-reduce between the GPUs of this process, via torch.

When every device is a local CUDA GPU and torch has NCCL, each piece is all-reduced
with `torch.cuda.nccl.all_reduce` (single process, many GPUs). Anywhere else (logical
CPU devices, no CUDA, torch built without NCCL, Windows) it falls back to
`ReductionToOneDevice` and logs one warning per instance, as TF does when no NCCL
kernel is registered (tensorflow/tensorflow#21470).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Sequence
from typing import Any, ClassVar, final

from crossdevice._arrays import backend_for
from crossdevice._core.devices import DeviceSpec
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._cross_device.all_reduce import AllReduceCrossDeviceOps

__all__ = ["NcclAllReduce", "nccl_status"]

_LOG = logging.getLogger("crossdevice")


@functools.lru_cache(maxsize=256)
def nccl_status(devices: tuple[str, ...]) -> tuple[bool, str]:
    """Whether NCCL can all-reduce between `devices` in this process, and why not.

    Args:
        devices: canonical device strings.

    Returns:
        `(True, "")`, or `(False, reason)`.
    """
    specs = [DeviceSpec.from_string(d) for d in devices]
    if not specs:
        return False, "no devices were given"
    if any(s.device_type != "GPU" for s in specs):
        return False, "not every device is a GPU"
    if any(s.job not in (None, "localhost") or (s.task or 0) != 0 for s in specs):
        return False, "some devices belong to other workers"
    indices = [s.device_index or 0 for s in specs]
    if len(set(indices)) != len(indices):
        return False, "a GPU appears twice (NCCL needs one tensor per GPU)"
    if importlib.util.find_spec("torch") is None:
        return False, "torch is not installed (pip install torch)"
    import torch

    if not torch.cuda.is_available():
        return False, "torch has no CUDA device"
    if max(indices) >= torch.cuda.device_count():
        return False, f"only {torch.cuda.device_count()} CUDA devices are visible"
    if not hasattr(torch._C, "_nccl_all_reduce"):
        return False, "torch was built without NCCL"
    return True, ""


def _nccl_all_reduce(pieces: list[Any], devices: tuple[str, ...], user_owned: bool) -> list[Any]:
    """Sum `pieces[j]` (one array per GPU) with NCCL; returns new tensors (or ours, reused).

    Args:
        pieces: one array per device (torch tensors, or NumPy arrays to be moved).
        devices: the GPU of each piece.
        user_owned: the pieces are (views of) the user's arrays: never write them.
    """
    import torch
    import torch.cuda.nccl

    tensors = []
    for piece, device in zip(pieces, devices, strict=True):
        moved = backend_for(piece).to_device(piece, device)
        if (user_owned and moved is piece) or not moved.is_contiguous():
            # NCCL writes in place: never into the user's tensor, always contiguous.
            moved = moved.clone(memory_format=torch.contiguous_format)
        tensors.append(moved)
    if tensors[0].numel() > 0:  # an empty pack (num_packs > elements) has nothing to add
        torch.cuda.nccl.all_reduce(tensors)  # type: ignore[no-untyped-call]
    return tensors


@final
class NcclAllReduce(AllReduceCrossDeviceOps):
    """NCCL all-reduce between local GPUs (`tf.distribute.NcclAllReduce`).

    Where NCCL cannot run (CPU devices, no CUDA, torch without NCCL) it falls back to
    `ReductionToOneDevice` and logs one warning (logger `"crossdevice"`) per instance.
    Reduces that are not all-reduces also go to `ReductionToOneDevice`.

    Args:
        num_packs: a non-negative int: the number of flat buffers per dtype that a batch
            is packed into; 0 means one all-reduce per array.

    Raises:
        ValueError: `num_packs` is negative.

    Example:
        >>> ops = NcclAllReduce(num_packs=2)
        >>> ops.num_packs
        2
    """

    _NUM_PACKS_ERROR: ClassVar[str] = "NCCL all-reduce requires num_packs >= 0, but {} is specified"
    _ALGORITHM: ClassVar[str] = "nccl"

    def __init__(self, num_packs: int = 1) -> None:
        super().__init__(num_packs)
        self._fallback_warned = False

    def _can_all_reduce(self, devices: tuple[str, ...]) -> bool:
        ok, reason = nccl_status(tuple(devices))
        if not ok:
            with self._warn_lock:
                warn, self._fallback_warned = not self._fallback_warned, True
            if warn:
                _LOG.warning(
                    "NcclAllReduce cannot run on devices %s: %s. Falling back to "
                    "ReductionToOneDevice (logged once per NcclAllReduce instance).",
                    list(devices),
                    reason,
                )
        return ok

    def _all_reduce_pieces(
        self,
        reduce_op: ReduceOp,
        pieces: list[list[Any]],
        devices: tuple[str, ...],
        borrowed: Sequence[bool],
    ) -> list[list[Any]]:
        """One NCCL all-reduce per piece; MEAN divides on every device."""
        out: list[list[Any]] = [[] for _ in devices]
        for k in range(len(pieces[0])):
            summed = _nccl_all_reduce(
                [device_pieces[k] for device_pieces in pieces], devices, borrowed[k]
            )
            if reduce_op is ReduceOp.MEAN:
                summed = [backend_for(t).divide(t, len(devices)) for t in summed]
            for device_out, total in zip(out, summed, strict=True):
                device_out.append(total)
        return out
