"""The optional compiled host kernel: a fused, in-order n-ary sum (`_hostsum.c`).

NumPy can only add two arrays per call, so a blocked NumPy sum keeps the accumulator in
cache and still writes every output cache line through the cache, which first reads it
from memory (read-for-ownership). The compiled kernel adds all inputs per element in one
pass and, for results much larger than the caches, writes them with non-temporal stores
that skip that read: 4 x 64 MiB moves 320 MiB instead of 384 MiB.

Results are bitwise equal to the NumPy chain (the same adds in the same order, element by
element). Its vector loop uses AVX2 where the CPU has it (chosen at run time: 4 x 64 MiB
from two threads took 0.79-0.89x the time of the SSE2 loop on the dev VM) and SSE2
elsewhere on x86-64. The kernel is built when crossdevice is installed from source with a C
compiler; where the build failed, or with `CROSSDEVICE_NATIVE=0` in the environment, the
NumPy kernels run instead and everything works the same, only slower.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Final

import numpy as np

from crossdevice._core import environment

__all__ = [
    "available",
    "can_sum",
    "fused_sum",
    "instruction_set",
    "instruction_sets",
]

# dtype -> the kernel's code (_hostsum.c: CDX_F32, CDX_F64, CDX_U32, CDX_U64). Signed and
# unsigned integers of one width add identically in two's complement (NumPy wraps around).
_CODES: Final = {
    np.dtype(np.float32): 0,
    np.dtype(np.float64): 1,
    np.dtype(np.int32): 2,
    np.dtype(np.uint32): 2,
    np.dtype(np.int64): 3,
    np.dtype(np.uint64): 3,
}


# instruction set -> the kernel's flag (_hostsum.c: CDX_ISA_*), in order of preference.
_ISA_FLAGS: Final = {"avx2": 4, "sse2": 2, "scalar": 1}


def _load() -> tuple[ctypes._CFuncPtr, int] | None:  # type: ignore[name-defined]
    if not environment.env_switch("CROSSDEVICE_NATIVE", default=True):
        return None
    try:
        from crossdevice._arrays import _hostsum  # type: ignore[attr-defined]
    except ImportError:  # built without a C compiler: the NumPy kernels run
        return None
    library = ctypes.CDLL(_hostsum.__file__)
    function = library.cdx_sum
    function.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ssize_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    function.restype = ctypes.c_int
    library.cdx_isas.argtypes = []
    library.cdx_isas.restype = ctypes.c_int
    return function, library.cdx_isas()


_LOADED: Final = _load()
_KERNEL: Final = None if _LOADED is None else _LOADED[0]
_ISAS: Final = 0 if _LOADED is None else _LOADED[1]
#: The instruction set `fused_sum` asks for: the best one this CPU has. Tests set it to
#: each one in turn.
_ISA = next((name for name, flag in _ISA_FLAGS.items() if _ISAS & flag), "")


def available() -> bool:
    """Whether the compiled kernel is built and enabled (`CROSSDEVICE_NATIVE` is not 0)."""
    return _KERNEL is not None


def instruction_sets() -> tuple[str, ...]:
    """The kernel's vector loops this CPU can run, best first ("avx2", "sse2", "scalar").

    Empty when the kernel is not built or is turned off.
    """
    if _KERNEL is None:
        return ()
    return tuple(name for name, flag in _ISA_FLAGS.items() if _ISAS & flag)


def instruction_set() -> str:
    """The instruction set `fused_sum` uses ("" when the kernel is off)."""
    return _ISA if _KERNEL is not None else ""


def can_sum(inputs: Sequence[np.ndarray], out: np.ndarray, divisor: int | None) -> bool:
    """Whether `fused_sum(inputs, out, ...)` can run: kernel present, supported dtype.

    Expects what `host_kernels.sum_slice` is given: 1-D arrays of one dtype and length.
    All must be aligned (NumPy's default) and contiguous; a divisor needs a float dtype.
    """
    if _KERNEL is None:
        return False
    code = _CODES.get(out.dtype)
    if code is None or (divisor is not None and code > 1):
        return False
    if not (out.flags.c_contiguous and out.flags.aligned):
        return False
    return all(x.flags.c_contiguous and x.flags.aligned for x in inputs)


def fused_sum(
    inputs: Sequence[np.ndarray],
    out: np.ndarray,
    start: int,
    stop: int,
    *,
    divisor: int | None = None,
    stream: bool = False,
) -> None:
    """`out[start:stop] = (inputs[0] + inputs[1] + ...)[start:stop]` in one compiled pass.

    The GIL is released for the whole pass. Call only where `can_sum` is true.

    Args:
        inputs: 1-D contiguous arrays of `out`'s dtype and length, added in this order.
        out: the 1-D output (it may be `inputs[0]`).
        start: first element of the range.
        stop: one past the last element.
        divisor: if given (float dtypes only), each sum is then divided by it, bitwise as
            `np.true_divide(sum, divisor)`.
        stream: write with non-temporal stores (for results far larger than the caches).

    Raises:
        RuntimeError: the kernel refused its arguments (a bug in the caller).
    """
    kernel = _KERNEL
    if kernel is None or stop <= start:
        return
    itemsize = out.itemsize
    offset = start * itemsize
    pointers = (ctypes.c_void_p * len(inputs))(
        *[x.__array_interface__["data"][0] + offset for x in inputs]
    )
    status = kernel(
        pointers,
        len(inputs),
        out.__array_interface__["data"][0] + offset,
        stop - start,
        _CODES[out.dtype],
        1 if stream else 0,
        divisor or 0,
        _ISA_FLAGS[_ISA],
    )
    if status != 0:
        raise RuntimeError(
            f"the compiled sum kernel refused its arguments (status {status}) for dtype "
            f"{out.dtype}, {len(inputs)} inputs, range [{start}, {stop}), instruction set "
            f"{_ISA!r}; expected a dtype from {sorted({str(d) for d in _CODES})} and an "
            f"instruction set from {instruction_sets()}; this is a crossdevice bug, please "
            "report it (set CROSSDEVICE_NATIVE=0 to use the NumPy kernels meanwhile)"
        )
