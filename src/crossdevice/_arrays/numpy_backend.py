"""The NumPy backend (the default for host values and Python numbers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from crossdevice._arrays import host_kernels
from crossdevice._arrays.detect import get_torch_backend, is_torch

__all__ = ["NUMPY", "NumpyBackend"]


class NumpyBackend:
    """NumPy arrays live in host memory: on every logical CPU device at once."""

    name: Final = "numpy"

    def asarray(self, x: Any) -> np.ndarray:
        """`x` as a NumPy array (no copy for arrays).

        Python numbers and lists follow `tf.constant`'s dtype rule, so ported programs give
        the same numbers: floats become float32 and ints int32 (int64 when too large).
        NumPy arrays and scalars keep their dtype.
        """
        if isinstance(x, np.ndarray | np.generic):
            return np.asarray(x)
        arr = np.asarray(x)
        if arr.dtype == np.float64:
            return arr.astype(np.float32)
        if arr.dtype == np.int64 and (arr.size == 0 or np.abs(arr).max() < 2**31):
            return arr.astype(np.int32)
        return arr

    def device_of(self, x: Any) -> str | None:
        """Host memory has no logical device."""
        del x
        return None

    def to_device(self, x: Any, device: str) -> Any:
        """Host → host returns `x`; host → GPU makes a torch CUDA tensor."""
        if "GPU" in device:
            torch_be = get_torch_backend()
            # np.asarray(order="C"), not np.ascontiguousarray: that makes a 0-d array 1-d.
            return torch_be.to_device(torch_be.asarray(np.asarray(x, order="C")), device)
        return x

    def copy(self, x: Any) -> np.ndarray:
        """A writable copy."""
        return np.array(x, copy=True)

    def shape(self, x: Any) -> tuple[int, ...]:
        """`np.shape(x)`."""
        return tuple(np.shape(x))

    def dtype_name(self, x: Any) -> str:
        """`str(x.dtype)`."""
        return str(np.asarray(x).dtype)

    def is_floating(self, x: Any) -> bool:
        """Floating point or complex."""
        return bool(np.issubdtype(np.asarray(x).dtype, np.inexact))

    def nbytes(self, x: Any) -> int:
        """Bytes of `x`."""
        return int(np.asarray(x).nbytes)

    def sum_n(self, xs: Sequence[Any], out: Any | None = None) -> np.ndarray:
        """In-order sum `xs[0] + xs[1] + ...`, bitwise equal to the naive `np.add` chain.

        Large same-shape arrays take the cache-blocked, multi-threaded kernel of
        `host_kernels.sum_n` (each input byte read once from memory); small, broadcast or
        mixed-dtype operands take the plain chain (0-d inputs give a 0-d array).
        """
        return host_kernels.sum_n([np.asarray(x) for x in xs], out)

    def divide(self, x: Any, n: float) -> Any:
        """True division: float dtypes are kept, integers become float64; arrays stay arrays.

        (NumPy's ufuncs turn a 0-d array into a NumPy scalar: an integer MEAN of 0-d
        arrays came back as a scalar where every other dtype and rank gave an array.)
        """
        result = np.true_divide(x, n)
        arr = np.asarray(x)
        if np.issubdtype(arr.dtype, np.inexact) and result.dtype != arr.dtype:
            result = result.astype(arr.dtype)
        if isinstance(x, np.ndarray) and not isinstance(result, np.ndarray):
            result = np.asarray(result)
        return result

    def reduce_sum(self, x: Any, axis: tuple[int, ...]) -> Any:
        """`np.sum(x, axis)`, keeping the dtype."""
        arr = np.asarray(x)
        return np.sum(arr, axis=axis, dtype=arr.dtype)

    def concat(self, xs: Sequence[Any], axis: int) -> np.ndarray:
        """`np.concatenate`."""
        return np.concatenate([np.asarray(x) for x in xs], axis=axis)

    def pack(self, xs: Sequence[Any]) -> np.ndarray:
        """One 1-D buffer holding every element of `xs`, in order."""
        arrays = [np.asarray(x) for x in xs]
        total = sum(a.size for a in arrays)
        flat = np.empty(total, dtype=arrays[0].dtype if arrays else np.float32)
        offset = 0
        for a in arrays:
            flat[offset : offset + a.size] = a.reshape(-1)
            offset += a.size
        return flat

    def zeros(self, shape: tuple[int, ...], like: Any) -> np.ndarray:
        """Zeros with `like`'s dtype."""
        return np.zeros(shape, dtype=np.asarray(like).dtype)

    def to_numpy(self, x: Any) -> np.ndarray:
        """`np.asarray(x)`."""
        return np.asarray(x)

    def assign(self, target: Any, value: Any) -> None:
        """`np.copyto(target, value)` with same-kind casting (float64 into float32 is fine)."""
        np.copyto(target, self.to_numpy_value(value), casting="same_kind")

    def to_numpy_value(self, value: Any) -> Any:
        """Torch tensors become NumPy arrays; everything else passes."""
        if is_torch(value):
            return value.detach().cpu().numpy()
        return value

    def freeze(self, x: Any) -> Any:
        """Set `writeable=False` on arrays that own their data or are views of our buffers."""
        if isinstance(x, np.ndarray):
            x.flags.writeable = False
        return x


NUMPY: Final = NumpyBackend()
