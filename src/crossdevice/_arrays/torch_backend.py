"""The torch backend (CPU and CUDA tensors).

Only the torch-specific modules import torch, and only when a torch value or feature
shows up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

try:
    import torch
except ImportError:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "this feature needs PyTorch, which is not installed; install it with "
        "`pip install torch==2.13.0` (CPU build) then `pip install crossdevice[torch]`"
    ) from None

import numpy as np

from crossdevice._core.devices import DeviceSpec, canonicalize, physical_gpu_index

__all__ = ["TORCH", "TorchBackend"]


#: Floating dtypes whose sums accumulate in float32 (`TorchBackend.sum_n`).
_LOW_PRECISION: Final = (torch.float16, torch.bfloat16)


class TorchBackend:
    """torch tensors; CPU tensors are host memory, CUDA tensors live on `GPU:i`."""

    name: Final = "torch"

    def asarray(self, x: Any) -> torch.Tensor:
        """`torch.as_tensor(x)`."""
        if isinstance(x, torch.Tensor):
            return x
        return torch.as_tensor(np.asarray(x))

    def device_of(self, x: Any) -> str | None:
        """`GPU:i` for CUDA tensors, None for CPU tensors."""
        if x.device.type == "cuda":
            index = x.device.index if x.device.index is not None else torch.cuda.current_device()
            return canonicalize(f"GPU:{index}")
        return None

    def torch_device(self, device: str) -> torch.device:
        """The torch device for a TF device string (a logical GPU: the CUDA device behind it)."""
        spec = DeviceSpec.from_string(device)
        if spec.device_type == "GPU":
            return torch.device("cuda", physical_gpu_index(spec.device_index or 0))
        return torch.device("cpu")

    def to_device(self, x: Any, device: str) -> Any:
        """`x.to(device)`; host → host returns `x`; a device already there returns `x`.

        Host → GPU goes through pinned memory without blocking the host (a pageable copy
        is `cudaStreamSynchronize` on the stream, which waits for every kernel queued
        there). The copy is made on the calling thread's current stream of the target
        device, so work queued there after it sees the data. The pinned staging copy is
        ours: the caller may change `x` as soon as this returns.
        """
        target = self.torch_device(device)
        if x.device == target or (x.device.type == "cpu" and target.type == "cpu"):
            return x
        if x.device.type == "cpu":
            staged = x if x.is_pinned() else x.pin_memory()
            return staged.to(target, non_blocking=True)
        return x.to(target, non_blocking=False)

    def copy(self, x: Any) -> torch.Tensor:
        """`x.clone()`."""
        return x.detach().clone()

    def shape(self, x: Any) -> tuple[int, ...]:
        """`tuple(x.shape)`."""
        return tuple(x.shape)

    def dtype_name(self, x: Any) -> str:
        """`"float32"`, `"bfloat16"`, ..."""
        return str(x.dtype).removeprefix("torch.")

    def is_floating(self, x: Any) -> bool:
        """Floating point or complex."""
        return bool(x.is_floating_point() or x.is_complex())

    def nbytes(self, x: Any) -> int:
        """Bytes of `x`."""
        return int(x.numel() * x.element_size())

    def sum_n(self, xs: Sequence[Any], out: Any | None = None) -> torch.Tensor:
        """In-order sum on the first value's device.

        float16 and bfloat16 values are added in float32 and rounded once at the end
        (one rounding per addition in their own precision would lose the low bits of
        every gradient: 8 bf16 values of 1 and 2**-9 sum to 1 in bf16, 1.0156 in float32).
        """
        with torch.no_grad():
            first = xs[0]
            if first.dtype in _LOW_PRECISION and len(xs) > 1:
                total = torch.add(first.float(), xs[1].to(first.device, torch.float32))
                for x in xs[2:]:
                    total.add_(x.to(first.device, torch.float32))
                if out is None:
                    return total.to(first.dtype)
                out.copy_(total)
                return out
            if len(xs) == 1:
                if out is None:
                    return first.detach().clone()
                out.copy_(first)
                return out
            if out is None:
                out = torch.add(first, xs[1].to(first.device))
            else:
                torch.add(first, xs[1].to(first.device), out=out)
            for x in xs[2:]:
                out.add_(x.to(first.device))
            return out

    def divide(self, x: Any, n: float) -> torch.Tensor:
        """True division (integers become the default float dtype)."""
        return torch.true_divide(x, n)

    def reduce_sum(self, x: Any, axis: tuple[int, ...]) -> torch.Tensor:
        """`torch.sum(x, axis)`, keeping the dtype."""
        if not axis:
            return x
        return torch.sum(x, dim=axis, dtype=x.dtype)

    def concat(self, xs: Sequence[Any], axis: int) -> torch.Tensor:
        """`torch.cat`."""
        return torch.cat(list(xs), dim=axis)

    def pack(self, xs: Sequence[Any]) -> torch.Tensor:
        """One 1-D buffer holding every element of `xs`, in order."""
        return torch.cat([x.detach().reshape(-1) for x in xs])

    def zeros(self, shape: tuple[int, ...], like: Any) -> torch.Tensor:
        """Zeros with `like`'s dtype and device."""
        return torch.zeros(shape, dtype=like.dtype, device=like.device)

    def to_numpy(self, x: Any) -> np.ndarray:
        """Host NumPy copy (bfloat16 goes through float32, which NumPy lacks)."""
        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.numpy()

    def assign(self, target: Any, value: Any) -> None:
        """`target.copy_(value)`."""
        with torch.no_grad():
            target.copy_(self.asarray(value).to(target.device))

    def freeze(self, x: Any) -> Any:
        """Torch has no read-only tensors; the tensor is returned as it is."""
        return x


TORCH: Final = TorchBackend()
