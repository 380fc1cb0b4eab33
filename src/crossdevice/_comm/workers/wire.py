"""Values as process groups carry them: dtypes Gloo/NCCL take, and back.

Only torch-using modules import this one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch

from crossdevice._arrays import NUMPY, backend_for, is_torch
from crossdevice._core.purpose import GRADIENTS_SITE

__all__ = [
    "DTYPE_CODES",
    "Wire",
    "describe_site",
    "describe_wires",
    "divide",
    "donation",
    "dtype_name",
    "is_single_array",
    "to_wire",
    "wire_dtype",
]

#: Dtypes Gloo reduces and moves natively (measured: int16/uint16/uint32 raise "Invalid
#: scalar type"). Complex values travel as pairs of reals.
_NATIVE_DTYPES: Final = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)
#: Dtypes sent widened; a sum wraps modulo 2**bits in either width, so narrowing the
#: wide sum gives bit for bit the narrow sum.
_WIDENED_DTYPES: Final = {
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
}
#: Dtypes sent as a same-size signed view (two's complement sums are the same bits).
_VIEWED_DTYPES: Final = {torch.uint64: torch.int64}
#: Dtype codes for the fingerprints of all_gather and broadcast.
DTYPE_CODES: Final = (
    *sorted(_NATIVE_DTYPES, key=str),
    *sorted(_WIDENED_DTYPES, key=str),
    *_VIEWED_DTYPES,
)


def dtype_name(dtype: torch.dtype) -> str:
    """`float32` for `torch.float32`."""
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass
class Wire:
    """A value ready for a process group: a contiguous tensor of a dtype Gloo/NCCL take."""

    tensor: torch.Tensor  # what travels
    dtype: torch.dtype  # the value's own dtype
    kind: str  # "numpy" or "torch": what the caller gets back
    device: torch.device  # where the caller's value lives
    shape: tuple[int, ...] = ()  # the caller's shape (before packing)
    owned: bool = False  # `tensor` is a fresh copy, not the caller's memory

    def result(self, tensor: torch.Tensor) -> Any:
        """`tensor` (wire dtype, wire device) as a value of the caller's kind and dtype."""
        if tensor.dtype != self.dtype:
            if self.dtype in _VIEWED_DTYPES:
                tensor = tensor.view(self.dtype)
            else:
                tensor = tensor.to(self.dtype)
        if tensor.device != self.device:
            tensor = tensor.to(self.device)
        return tensor.numpy() if self.kind == "numpy" else tensor


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype `dtype` travels as; TypeError for dtypes no process group carries."""
    if dtype in _NATIVE_DTYPES:
        return dtype
    if dtype in _WIDENED_DTYPES:
        return _WIDENED_DTYPES[dtype]
    if dtype in _VIEWED_DTYPES:
        return _VIEWED_DTYPES[dtype]
    supported = sorted(dtype_name(d) for d in DTYPE_CODES)
    raise TypeError(
        f"cannot communicate values of dtype {dtype_name(dtype)}; expected one of "
        f"{supported}; cast the value first"
    )


def needs_view(dtype: torch.dtype) -> bool:
    """Whether `dtype` travels as a same-size view rather than a widened copy."""
    return dtype in _VIEWED_DTYPES


def is_single_array(value: object) -> bool:
    """Whether `value` is one array (not a list of them)."""
    return is_torch(value) or isinstance(value, np.ndarray)


def donation(values: Sequence[Any], donate: bool | Sequence[bool], fills: bool) -> list[bool]:
    """One donate flag per value of an all-reduce; errors for what cannot be reduced so.

    Raises:
        TypeError: a single array where a list of them is expected.
        ValueError: a flag count that is not the value count, or a fill with nothing
            donated to fill.
    """
    if is_single_array(values):
        raise TypeError(
            "all_reduce takes a list of buffers, got a single array; wrap it: all_reduce([x], ...)"
        )
    donated = [donate] * len(values) if isinstance(donate, bool) else list(donate)
    if len(donated) != len(values):
        raise ValueError(
            f"all_reduce: expected one donate flag per value ({len(values)}), got "
            f"{len(donated)}; pass one bool for all or one per value"
        )
    if fills and not any(donated):
        raise ValueError(
            f"all_reduce: fill= writes into the buffers, so it needs donate=True, got "
            f"donate={donate}; pass donate=True"
        )
    return donated


def divide(value: Any, count: float) -> Any:
    """`value / count`, in place for the floating buffers the collective just made."""
    if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.inexact):
        np.true_divide(value, count, out=value)
        return value
    if is_torch(value) and (value.is_floating_point() or value.is_complex()):
        return value.div_(count)
    return backend_for(value).divide(value, count)


def to_wire(value: Any, *, cuda: bool) -> Wire:
    """`value` as a contiguous tensor Gloo/NCCL can carry, its memory shared when it can be.

    `cuda`: CUDA tensors travel on NCCL; without it they are moved to the host (Gloo).
    """
    owned = False
    if is_torch(value):
        kind = "torch"
        tensor = value.detach()
        if not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
            owned = True
    else:
        kind = "numpy"
        array = NUMPY.asarray(value)
        if not (array.flags.c_contiguous and array.flags.writeable):
            array = np.array(array, order="C", copy=True)
            owned = True
        try:
            tensor = torch.from_numpy(array)
        except TypeError:
            raise TypeError(
                f"cannot communicate a NumPy array of dtype {array.dtype}; expected a "
                f"numeric or bool dtype torch supports (got {value!r:.80})"
            ) from None
    dtype, device, shape = tensor.dtype, tensor.device, tuple(tensor.shape)
    wdtype = wire_dtype(dtype)
    if tensor.is_cuda and not cuda:
        tensor = tensor.cpu()  # no NCCL: CUDA values travel through Gloo on the host
        owned = True
    if wdtype != dtype:
        owned = owned or not needs_view(dtype)
        tensor = tensor.view(wdtype) if needs_view(dtype) else tensor.to(wdtype)
    return Wire(tensor, dtype, kind, device, shape, owned)


def describe_site(site: object) -> str:
    """Where a call came from, for mismatch messages (its signature's `site`), or "".

    A strategy's site is `(user's line, structure, tag, step's global batch size)`: the
    line as `from file:line (function)` (not for the gradients, whose site is fixed),
    and the size of the global batch the step's input was sliced from, where known.
    """
    where, batch = site, None
    if isinstance(site, tuple) and len(site) == 4:
        where, batch = site[0], site[3]
    parts = []
    if isinstance(where, tuple) and len(where) == 3 and where != GRADIENTS_SITE:
        parts.append(f"from {where[0]}:{where[2]} ({where[1]})")
    if batch is not None:
        parts.append(f"in a step of a global batch of {batch}")
    return ", ".join(parts)


def describe_wires(wires: Sequence[Wire]) -> str:
    """`buffers: float32[2, 3], ...` (the first 12), for mismatch messages."""
    items = [f"{dtype_name(w.dtype)}{list(w.shape)}" for w in wires[:12]]
    more = f" +{len(wires) - 12} more" if len(wires) > 12 else ""
    return "buffers: " + ", ".join(items) + more
