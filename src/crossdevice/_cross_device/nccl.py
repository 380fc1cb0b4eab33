"""`NcclAllReduce`: NCCL all-reduce between the GPUs of this process, via torch.

When every device is a local CUDA GPU of its own and torch has NCCL, each piece is
all-reduced with `torch.cuda.nccl.all_reduce` (single process, many GPUs). Logical GPUs
that share a card (`config.set_logical_gpu_devices`) cannot be NCCL ranks (NCCL refuses
two ranks on one device): their pieces are summed in replica order on the card instead.
Anywhere else (logical CPU devices, no CUDA, torch built without NCCL, Windows) it falls
back to `ReductionToOneDevice`. Either way it logs one warning per instance, as TF does
when no NCCL kernel is registered (tensorflow/tensorflow#21470).

Dtypes are checked per piece (`nccl_calls.sum_route`): NCCL sums bool and float8 as
uint8 bit patterns and cannot send complex, int16 or unsigned 16/32/64-bit values, so
those go through exact views or upcasts, or the in-order sum; never a wrong sum.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Sequence
from typing import Any, ClassVar, Final, final

from crossdevice._arrays import backend_for
from crossdevice._arrays.handout import hand_out_each
from crossdevice._comm.devices import algorithms, nccl_calls
from crossdevice._core.devices import DeviceSpec, get_logical_gpu_devices, num_gpus
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._cross_device.all_reduce import AllReduceCrossDeviceOps

__all__ = ["NcclAllReduce", "nccl_mode", "nccl_status"]

_LOG = logging.getLogger("crossdevice")

#: `nccl_mode` results: NCCL runs; logical GPUs share a card (in-order sum on the card);
#: NCCL cannot run at all (`ReductionToOneDevice`).
NCCL: Final = "nccl"
SHARED_CARD: Final = "shared_card"
FALLBACK: Final = "fallback"


def nccl_status(devices: tuple[str, ...]) -> tuple[bool, str]:
    """Whether NCCL can all-reduce between `devices` in this process, and why not.

    Args:
        devices: canonical device strings.

    Returns:
        `(True, "")`, or `(False, reason)`.
    """
    mode, reason = nccl_mode(devices)
    return mode == NCCL, reason


def nccl_mode(devices: tuple[str, ...]) -> tuple[str, str]:
    """How `NcclAllReduce` all-reduces between `devices`: `"nccl"`, `"shared_card"` or `"fallback"`.

    Args:
        devices: canonical device strings.

    Returns:
        `(mode, reason)`; the reason is empty for `"nccl"`.
    """
    # The logical-GPU configuration decides which CUDA device backs GPU:k: part of the key.
    return _nccl_mode(tuple(devices), get_logical_gpu_devices())


@functools.lru_cache(maxsize=256)
def _nccl_mode(devices: tuple[str, ...], logical_gpus: int | None) -> tuple[str, str]:
    specs = [DeviceSpec.from_string(d) for d in devices]
    if not specs:
        return FALLBACK, "no devices were given"
    if any(s.device_type != "GPU" for s in specs):
        return FALLBACK, "not every device is a GPU"
    if any(s.job not in (None, "localhost") or (s.task or 0) != 0 for s in specs):
        return FALLBACK, "some devices belong to other workers"
    indices = [s.device_index or 0 for s in specs]
    if len(set(indices)) != len(indices):
        return FALLBACK, "a GPU appears twice (NCCL needs one tensor per GPU)"
    if importlib.util.find_spec("torch") is None:
        return FALLBACK, "torch is not installed (pip install torch)"
    import torch

    if not torch.cuda.is_available():
        return FALLBACK, "torch has no CUDA device"
    visible = num_gpus() if logical_gpus is not None else torch.cuda.device_count()
    if max(indices) >= visible:
        if logical_gpus is not None:
            return FALLBACK, f"only {visible} logical GPUs are configured"
        return FALLBACK, f"only {visible} CUDA devices are visible"
    if not nccl_calls.nccl_available():
        return FALLBACK, "torch was built without NCCL"
    physical = [nccl_calls.cuda_device_of(d) for d in devices]
    shared = sorted({p or 0 for p in physical if physical.count(p) > 1})
    if shared:
        names = [f"GPU:{i}" for i, p in zip(indices, physical, strict=True) if p in shared]
        return SHARED_CARD, (
            f"logical GPUs {names} share CUDA device(s) {shared} and NCCL refuses two "
            "ranks on one device"
        )
    return NCCL, ""


#: `nccl_status.cache_clear()` forgets the cached answers (for tests that change what
#: torch sees, as an `lru_cache` function would).
nccl_status.cache_clear = _nccl_mode.cache_clear  # type: ignore[attr-defined]


def _in_order_all_reduce(
    pieces: list[Any], devices: tuple[str, ...], reduce_op: ReduceOp
) -> list[Any]:
    """`pieces` summed in replica order on the first device; one distinct result per device.

    Used where NCCL cannot sum: logical GPUs sharing a card, and dtypes NCCL lacks. It is
    `ReductionToOneDevice`'s arithmetic, so results are bitwise those of the CPU path.
    """
    total = algorithms.reduce_to_one(pieces, devices[0], reduce_op)
    return hand_out_each(algorithms.broadcast(total, devices))


def _nccl_all_reduce(
    pieces: list[Any],
    devices: tuple[str, ...],
    user_owned: bool,
    reduce_op: ReduceOp = ReduceOp.SUM,
) -> list[Any]:
    """All-reduce `pieces[j]` (one array per GPU) with NCCL; returns new tensors (or ours, reused).

    The user's tensors are never written: NCCL reads them and writes new buffers (out of
    place); pack buffers of ours are reduced in place.

    Floating MEAN is ncclAvg (NCCL >= 2.10) or an in-place division of the buffer NCCL
    wrote: no second tensor per device. Integer (and bool) MEAN is the sum divided into
    the default float dtype, as on the CPU path (TF's `true_divide` semantics).

    Args:
        pieces: one array per device (torch tensors, or NumPy arrays to be moved).
        devices: the GPU of each piece.
        user_owned: the pieces are (views of) the user's arrays: never write them.
        reduce_op: SUM or MEAN.
    """
    import torch

    moved = [backend_for(p).to_device(p, d) for p, d in zip(pieces, devices, strict=True)]
    route = nccl_calls.sum_route(moved[0].dtype)
    if route.kind == nccl_calls.IN_ORDER:
        return _in_order_all_reduce(moved, devices, reduce_op)
    sources = [t if t.is_contiguous() else t.contiguous() for t in moved]
    if route.kind == nccl_calls.UPCAST:
        # The upcast is a new buffer of ours: reduce it in place.
        wire_in = [route.to_wire(t) for t in sources]
        wire_out, results = wire_in, sources
    elif user_owned or any(s is p for s, p in zip(sources, pieces, strict=True)):
        # Never write the user's tensor: NCCL reads it and writes a new buffer (out of
        # place, as nccl-tests' out-of-place mode), which saves a clone pass.
        results = [torch.empty_like(t) for t in sources]
        wire_in = [route.to_wire(t) for t in sources]
        wire_out = [route.to_wire(t) for t in results]
    else:  # our pack buffer (or a fresh upload): in place
        wire_in = wire_out = [route.to_wire(t) for t in sources]
        results = sources
    n = len(devices)
    mean = reduce_op is ReduceOp.MEAN
    average = mean and route.floating and nccl_calls.has_avg()
    if sources[0].numel() > 0:  # an empty pack (num_packs > elements) has nothing to add
        op = nccl_calls.NCCL_AVG if average else route.op
        nccl_calls.all_reduce(wire_in, op, outputs=None if wire_out is wire_in else wire_out)
        if mean and route.floating and not average:
            for w in wire_out:
                w.div_(n)  # the buffer is ours: divide in place
    out = [route.from_wire(w, t) for w, t in zip(wire_out, results, strict=True)]
    if mean and not route.floating:
        out = [backend_for(t).divide(t, n) for t in out]
    return out


@final
class NcclAllReduce(AllReduceCrossDeviceOps):
    """NCCL all-reduce between local GPUs (`tf.distribute.NcclAllReduce`).

    Where NCCL cannot run (CPU devices, no CUDA, torch without NCCL) it falls back to
    `ReductionToOneDevice` and logs one warning (logger `"crossdevice"`) per instance.
    Logical GPUs that share a card are summed in replica order on the card (one warning
    too), each replica getting a tensor of its own. Reduces that are not all-reduces also
    go to `ReductionToOneDevice`.

    Sums through NCCL are in NCCL's own order (ring, tree or NVLS: fixed for a given
    configuration, not the in-order `x0 + x1 + ...` of the CPU path), and floating MEAN
    is NCCL's average (each input scaled by 1/n, then summed). Dtypes NCCL lacks or
    mis-sums (bool, float8, complex, int16, unsigned 16/32/64-bit) are summed exactly
    through views or upcasts; the rest take the in-order sum.

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
        mode, reason = nccl_mode(tuple(devices))
        if mode == NCCL:
            return True
        with self._warn_lock:
            warn, self._fallback_warned = not self._fallback_warned, True
        if warn and mode == SHARED_CARD:
            _LOG.warning(
                "NcclAllReduce cannot run NCCL on devices %s: %s. All-reducing with an "
                "in-order sum on the card instead (logged once per NcclAllReduce instance).",
                list(devices),
                reason,
            )
        elif warn:
            _LOG.warning(
                "NcclAllReduce cannot run on devices %s: %s. Falling back to "
                "ReductionToOneDevice (logged once per NcclAllReduce instance).",
                list(devices),
                reason,
            )
        return mode == SHARED_CARD

    def _all_reduce_pieces(
        self,
        reduce_op: ReduceOp,
        pieces: list[list[Any]],
        devices: tuple[str, ...],
        borrowed: Sequence[bool],
    ) -> list[list[Any]]:
        """One NCCL all-reduce per piece (MEAN included), or the in-order sum on shared cards."""
        shared_card = nccl_mode(tuple(devices))[0] != NCCL
        out: list[list[Any]] = [[] for _ in devices]
        for k in range(len(pieces[0])):
            column = [device_pieces[k] for device_pieces in pieces]
            if shared_card:
                moved = [
                    backend_for(p).to_device(p, d) for p, d in zip(column, devices, strict=True)
                ]
                reduced = _in_order_all_reduce(moved, devices, reduce_op)
            else:
                reduced = _nccl_all_reduce(column, devices, borrowed[k], reduce_op)
            for device_out, total in zip(out, reduced, strict=True):
                device_out.append(total)
        return out
