"""Which array library a value belongs to, without importing torch to find out.

A leaf of `_arrays`: the backends themselves ask it (the NumPy backend hands a value to
torch's when it turns out to be a tensor), so it imports no backend at module level.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from crossdevice._arrays.base import ArrayBackend

__all__ = ["get_torch_backend", "is_torch"]


def is_torch(x: object) -> bool:
    """Whether `x` is a torch tensor (without importing torch when it is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def get_torch_backend() -> ArrayBackend:
    """The torch backend; ImportError with the install line when torch is missing."""
    from crossdevice._arrays.torch_backend import TORCH

    return TORCH
