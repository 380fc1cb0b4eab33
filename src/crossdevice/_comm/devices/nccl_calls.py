"""Launching `torch.cuda.nccl` collectives: one process-wide lock, and dtypes NCCL sums right.

Two things torch leaves to its callers:

* **Serialisation.** `torch/csrc/cuda/nccl.cpp` keeps its communicators in one process-wide
  map keyed by the device list (`_communicators`), documented as "accesses to this object
  have to be guarded" — and nothing guards it. Two strategies on overlapping GPUs, driven
  from two threads, could race on that map or interleave their grouped launches. Every
  launch here holds `_LAUNCH_LOCK` (launches are asynchronous: the lock is held for the
  enqueue, not for the transfer).
* **Dtypes.** `to_nccl_data_type` maps bool and the float8 types to `ncclUint8`, so their
  sums are sums of bit patterns (silently wrong), and raises "Unconvertible NCCL type" for
  complex, int16 and the unsigned 16/32/64-bit types. `sum_route` says how each dtype is
  all-reduced exactly: natively, as a zero-copy view, upcast and cast back, or not by NCCL.

Everything reads `torch.cuda.nccl` at call time, so tests (and a fake-CUDA harness) can
replace its functions.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence
from typing import Any, Final

from crossdevice._core.devices import DeviceSpec, physical_gpu_index

__all__ = [
    "NCCL_AVG",
    "NCCL_MAX",
    "NCCL_SUM",
    "SumRoute",
    "all_reduce",
    "broadcast",
    "cuda_device_of",
    "has_avg",
    "nccl_available",
    "nccl_version",
    "reduce",
    "sum_route",
]

#: `ncclRedOp_t` values (nccl.h): `torch.cuda.nccl` passes `op` through unchanged.
NCCL_SUM: Final = 0
NCCL_MAX: Final = 2
#: ncclAvg, NCCL >= 2.10: the mean in one pass (floats: each input pre-multiplied by 1/n).
NCCL_AVG: Final = 4
_AVG_SINCE: Final = (2, 10, 0)

#: Held around every `torch.cuda.nccl` launch in this process (see the module docstring).
_LAUNCH_LOCK: Final = threading.Lock()

# Route kinds.
NATIVE: Final = "native"  # NCCL sums this dtype itself
VIEW: Final = "view"  # a zero-copy view of another dtype sums to the same bits
UPCAST: Final = "upcast"  # summed exactly in a wider dtype, then cast back
IN_ORDER: Final = "in_order"  # not through NCCL: the in-order sum on one device


@dataclasses.dataclass(frozen=True)
class SumRoute:
    """How one dtype is all-reduced through NCCL without a wrong answer.

    Attributes:
        kind: `"native"`, `"view"`, `"upcast"` or `"in_order"` (NCCL cannot sum it).
        wire: the torch dtype NCCL sees (None for `"in_order"`).
        op: the NCCL op that computes the sum (`NCCL_MAX` for bool: torch's bool sum is OR).
        floating: MEAN divides in this dtype (ncclAvg or an in-place division); otherwise
            MEAN is the sum divided into the default float dtype, as on the CPU path.
    """

    kind: str
    wire: Any = None
    op: int = NCCL_SUM
    floating: bool = False

    def to_wire(self, tensor: Any) -> Any:
        """What NCCL reduces: `tensor` itself, a view of it, or a new upcast tensor."""
        import torch

        if self.kind == VIEW:
            if tensor.is_complex():
                return torch.view_as_real(tensor)
            return tensor.view(self.wire)
        if self.kind == UPCAST:
            return tensor.to(self.wire, memory_format=torch.contiguous_format)
        return tensor

    def from_wire(self, wire: Any, tensor: Any) -> Any:
        """The reduced value in `tensor`'s dtype (views wrote `tensor` in place)."""
        if self.kind == UPCAST:
            return wire.to(tensor.dtype)
        return tensor


def nccl_version() -> tuple[int, ...]:
    """`torch.cuda.nccl.version()` as `(major, minor, patch)`; `(0, 0, 0)` when unknown."""
    try:
        import torch.cuda.nccl

        version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    except Exception:  # a CPU build has no `torch._C._nccl_version`
        return (0, 0, 0)
    return tuple(int(v) for v in version[:3])


def has_avg() -> bool:
    """Whether NCCL has ncclAvg (2.10 and later)."""
    return nccl_version() >= _AVG_SINCE


def nccl_available() -> bool:
    """Whether this torch build has the `torch.cuda.nccl` kernels."""
    import torch

    return hasattr(torch._C, "_nccl_all_reduce")


def sum_route(dtype: Any) -> SumRoute:
    """How NCCL all-reduces `dtype` exactly (see `SumRoute`).

    Args:
        dtype: a torch dtype.

    Returns:
        The route. Anything not listed (float8_e8m0fnu, float4, quantized, bit types)
        takes the in-order sum, which raises where torch itself cannot add the dtype.
    """
    return _sum_route(dtype)


@functools.lru_cache(maxsize=64)
def _sum_route(dtype: Any) -> SumRoute:
    import torch

    if dtype in (torch.float16, torch.bfloat16):
        # Summed in float32 and rounded once, as the host path sums them: NCCL's own
        # half-precision sum stores every partial sum in the dtype, one rounding per hop
        # (what DDP does). The wire carries twice the bytes.
        return SumRoute(UPCAST, torch.float32, floating=True)
    if dtype in (torch.float32, torch.float64):
        return SumRoute(NATIVE, dtype, floating=True)
    if dtype in (torch.int8, torch.uint8, torch.int32, torch.int64):
        return SumRoute(NATIVE, dtype)
    if dtype == torch.bool:
        # torch sends bool as ncclUint8: SUM would count (2 for True + True). torch's own
        # bool sum (and NumPy's) is a logical or, which is MAX on 0/1 bytes.
        return SumRoute(NATIVE, dtype, op=NCCL_MAX)
    complex_parts = {
        torch.complex32: torch.float16,
        torch.complex64: torch.float32,
        torch.complex128: torch.float64,
    }
    if dtype in complex_parts:
        # A complex sum is the sum of its real and imaginary parts: view_as_real pairs.
        return SumRoute(VIEW, complex_parts[dtype], floating=True)
    if dtype in (torch.uint32, torch.uint64):
        # Unsigned and two's-complement addition give the same bits modulo 2**width.
        signed = torch.int32 if dtype == torch.uint32 else torch.int64
        return SumRoute(VIEW, signed)
    if dtype in (torch.int16, torch.uint16):
        # Summed in int32, cast back: modulo 2**16 this is the wrapping 16-bit sum.
        return SumRoute(UPCAST, torch.int32)
    float8 = (
        torch.float8_e4m3fn,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2,
        torch.float8_e5m2fnuz,
    )
    if dtype in float8:
        # Every float8 value is an integer multiple of 2**-17 below 2**16: float64 holds
        # the sum of up to 2**20 of them exactly, whatever order NCCL adds in, so the
        # result is the exact sum rounded once to float8 (deterministic). float32 would
        # round e5m2 sums twice.
        return SumRoute(UPCAST, torch.float64, floating=True)
    return SumRoute(IN_ORDER)


def cuda_device_of(device: str) -> int | None:
    """The CUDA device index behind a local `GPU:k` device string; None for anything else."""
    spec = DeviceSpec.from_string(device)
    if spec.device_type != "GPU" or spec.job not in (None, "localhost") or (spec.task or 0):
        return None
    return physical_gpu_index(spec.device_index or 0)


def on_distinct_gpus(tensors: Sequence[Any]) -> bool:
    """Whether `tensors` are torch CUDA tensors, one per CUDA device, and NCCL is built in."""
    from crossdevice._arrays import is_torch

    if not tensors or not all(is_torch(t) and t.device.type == "cuda" for t in tensors):
        return False
    indices = [t.device.index for t in tensors]
    return len(set(indices)) == len(indices) and nccl_available()


def all_reduce(
    tensors: Sequence[Any], op: int = NCCL_SUM, outputs: Sequence[Any] | None = None
) -> None:
    """`torch.cuda.nccl.all_reduce` under the process-wide lock.

    Args:
        tensors: one contiguous CUDA tensor per device.
        op: an `ncclRedOp_t` (`NCCL_SUM`, `NCCL_MAX`, `NCCL_AVG`).
        outputs: where to write (one per device); None reduces `tensors` in place.
    """
    import torch.cuda.nccl

    with _LAUNCH_LOCK:
        if outputs is None:
            torch.cuda.nccl.all_reduce(list(tensors), op=op)  # type: ignore[no-untyped-call]
        else:
            torch.cuda.nccl.all_reduce(  # type: ignore[no-untyped-call]
                list(tensors), outputs=list(outputs), op=op
            )


def reduce(inputs: Sequence[Any], output: Any, root: int, op: int = NCCL_SUM) -> None:
    """`torch.cuda.nccl.reduce` of `inputs` into `output` on `inputs[root]`'s device."""
    import torch.cuda.nccl

    with _LAUNCH_LOCK:
        torch.cuda.nccl.reduce(list(inputs), output=output, root=root, op=op)


def broadcast(tensors: Sequence[Any], root: int) -> None:
    """`torch.cuda.nccl.broadcast(tensors, root)` in place, under the process-wide lock."""
    import torch.cuda.nccl

    with _LAUNCH_LOCK:
        torch.cuda.nccl.broadcast(list(tensors), root=root)
