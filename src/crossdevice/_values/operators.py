"""`ArrayOperators`: a value that behaves as the array it stands for.

`Mirrored` values, variables and distributed variables all forward arithmetic,
comparisons, indexing and `numpy.asarray` to one array: `self._operand()`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from crossdevice._arrays import backend_for

__all__ = ["ArrayOperators"]


def _forward(op: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: ArrayOperators, *args: Any) -> Any:
        return op(self._operand(), *args)

    method.__doc__ = f"`{op.__name__}` applied to the array this value stands for."
    return method


def _reflected(op: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: ArrayOperators, other: Any) -> Any:
        return op(other, self._operand())

    method.__doc__ = f"`{op.__name__}` with this value on the right."
    return method


class ArrayOperators:
    """Operators on `self._operand()`, the array the value stands for in this context."""

    __slots__ = ()

    def _operand(self) -> Any:
        raise NotImplementedError

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = self._operand()
        return np.asarray(backend_for(value).to_numpy(value), dtype=dtype)

    __add__ = _forward(operator.add)
    __sub__ = _forward(operator.sub)
    __mul__ = _forward(operator.mul)
    __truediv__ = _forward(operator.truediv)
    __floordiv__ = _forward(operator.floordiv)
    __mod__ = _forward(operator.mod)
    __and__ = _forward(operator.and_)
    __or__ = _forward(operator.or_)
    __xor__ = _forward(operator.xor)
    __matmul__ = _forward(operator.matmul)
    __radd__ = _reflected(operator.add)
    __rsub__ = _reflected(operator.sub)
    __rmul__ = _reflected(operator.mul)
    __rtruediv__ = _reflected(operator.truediv)
    __rfloordiv__ = _reflected(operator.floordiv)
    __rmod__ = _reflected(operator.mod)
    __rpow__ = _reflected(operator.pow)
    __rand__ = _reflected(operator.and_)
    __ror__ = _reflected(operator.or_)
    __rxor__ = _reflected(operator.xor)
    __rmatmul__ = _reflected(operator.matmul)
    __neg__ = _forward(operator.neg)
    __invert__ = _forward(operator.invert)
    __abs__ = _forward(operator.abs)
    __lt__ = _forward(operator.lt)
    __le__ = _forward(operator.le)
    __gt__ = _forward(operator.gt)
    __ge__ = _forward(operator.ge)
    __getitem__ = _forward(operator.getitem)

    def __pow__(self, other: Any, modulo: Any = None) -> Any:
        """`pow(value, other[, modulo])` on the array this value stands for.

        TF's `DistributedDelegate` forwards the three-argument form too. NumPy arrays and
        torch tensors do not implement it, so for them it is `(value ** other) % modulo`;
        Python numbers use the built-in `pow`.
        """
        operand = self._operand()
        if modulo is None:
            return operand**other
        if isinstance(operand, int | float):
            return pow(operand, other, modulo)
        return (operand**other) % modulo

    def __float__(self) -> float:
        return float(self._operand())

    def __int__(self) -> int:
        return int(self._operand())

    def __bool__(self) -> bool:
        return bool(self._operand())

    def __len__(self) -> int:
        return len(self._operand())
