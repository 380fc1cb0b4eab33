"""The interface every array backend implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["ArrayBackend"]


class ArrayBackend(Protocol):
    """Operations the layers above need from an array library.

    Values are the library's own arrays. Devices are canonical TF device strings; a host
    array carries no logical device (`device_of` returns None) because every logical CPU
    device shares host memory.
    """

    @property
    def name(self) -> str:
        """`"numpy"` or `"torch"`."""
        ...

    def asarray(self, x: Any) -> Any:
        """`x` as an array of this library (no copy when it already is one)."""
        ...

    def device_of(self, x: Any) -> str | None:
        """The canonical device of `x`, or None for host memory."""
        ...

    def to_device(self, x: Any, device: str) -> Any:
        """`x` on `device`; host to host returns `x` itself (no copy)."""
        ...

    def copy(self, x: Any) -> Any:
        """A new, writable array equal to `x` on the same device."""
        ...

    def shape(self, x: Any) -> tuple[int, ...]:
        """The shape of `x`."""
        ...

    def dtype_name(self, x: Any) -> str:
        """The dtype of `x` as a short name (`"float32"`, `"bfloat16"`, ...)."""
        ...

    def is_floating(self, x: Any) -> bool:
        """Whether `x` has a floating-point (or complex) dtype."""
        ...

    def nbytes(self, x: Any) -> int:
        """The size of `x` in bytes."""
        ...

    def sum_n(self, xs: Sequence[Any], out: Any | None = None) -> Any:
        """`xs[0] + xs[1] + ...` added in order (bitwise reproducible), into `out` if given."""
        ...

    def divide(self, x: Any, n: float) -> Any:
        """`x / n` with the library's true division (integers become floating point)."""
        ...

    def reduce_sum(self, x: Any, axis: tuple[int, ...]) -> Any:
        """Sum of `x` over `axis`."""
        ...

    def concat(self, xs: Sequence[Any], axis: int) -> Any:
        """Concatenate `xs` along `axis`."""
        ...

    def pack(self, xs: Sequence[Any]) -> Any:
        """Flatten and concatenate same-dtype arrays into one new 1-D buffer."""
        ...

    def zeros(self, shape: tuple[int, ...], like: Any) -> Any:
        """Zeros of `shape` with the dtype and device of `like`."""
        ...

    def to_numpy(self, x: Any) -> Any:
        """`x` as a NumPy array (host copy for device tensors)."""
        ...

    def assign(self, target: Any, value: Any) -> None:
        """Write `value` into the array `target` in place (broadcasting, casting as `target`)."""
        ...

    def freeze(self, x: Any) -> Any:
        """Mark `x` read-only where the library supports it, so a shared result is safe."""
        ...
