"""Layer 2: the one place that knows array libraries.

`backend_for(x)` returns the backend of a value: NumPy (built in) or torch (loaded only
when a torch tensor shows up or a torch feature is asked for). Python scalars and lists
are NumPy values.
"""

from __future__ import annotations

from typing import Any

from crossdevice._arrays.base import ArrayBackend as ArrayBackend
from crossdevice._arrays.detect import get_torch_backend as get_torch_backend
from crossdevice._arrays.detect import is_torch as is_torch
from crossdevice._arrays.numpy_backend import NUMPY as NUMPY

__all__ = ["NUMPY", "ArrayBackend", "backend_for", "get_torch_backend", "is_array", "is_torch"]


def backend_for(x: Any) -> ArrayBackend:
    """The backend for value `x` (torch tensors → torch, anything else → NumPy)."""
    if is_torch(x):
        return get_torch_backend()
    return NUMPY


def is_array(x: object) -> bool:
    """Whether `x` is an array value (NumPy array or scalar, torch tensor, Python number)."""
    import numpy as np

    return isinstance(x, np.ndarray | np.generic | int | float | complex | bool) or is_torch(x)
