"""`FlatRoutes`: what a repeated gradient bucket's reduction decides, decided once.

A training step reduces the same buckets step after step (`crossdevice.torch`'s flat
buffers, `CollectiveAllReduce.reduce_flat_async`): the same op, options, call site,
leaves and wire dtype, and parts of the same dtype and device. What those decide (the
merged options, the all-reduce's `ReduceOptions` and so its fingerprint's signature,
whether the buffer goes into a recycled host room or travels narrowed, and what MEAN
divides by) is worked out on the first call and kept in a `FlatRoute`; a repeated call
looks it up by the identity of the objects it was made from and only copies the parts
into the flat buffer and issues the all-reduce. Nothing about the data is kept: every
call's fingerprint is still compared on every worker before its result is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

__all__ = ["MAX_ROUTES", "FlatRoute", "FlatRoutes", "numpy_dtype", "total_numel"]

#: Routes kept (a model has a handful of buckets, each up to 4 routes: the optimizer step
#: count modulo 4 is part of its call site); the table is emptied when full.
MAX_ROUTES: Final = 256


@dataclasses.dataclass(frozen=True, slots=True)
class FlatRoute:
    """One kind of flat bucket reduction, as its first call worked it out.

    Attributes:
        leaves: the call's `leaves` object (kept: the key holds its id).
        options: the call's `options` object (kept: the key holds its id).
        merged: the strategy's options merged with `options`.
        reduce: the cross-worker all-reduce's `ReduceOptions` (None: narrowed on the
            wire, gathered and added in float32).
        signature: what the workers compare of a narrowed call (None: an all-reduce,
            whose `reduce` holds it).
        room_dtype: the NumPy dtype of the recycled host room the parts are copied into
            (None: a fresh `torch.cat`, for CUDA parts and dtypes NumPy lacks).
        deliver: turns the communicator's results into the caller's buffer (MEAN divides).
    """

    leaves: tuple[Any, ...]
    options: Any
    merged: Any
    reduce: Any
    signature: Any
    room_dtype: np.dtype | None
    deliver: Callable[[list[Any]], Any]


class FlatRoutes:
    """A strategy's `FlatRoute`s, by the identity of what makes them (see the module doc).

    Args:
        make: builds the route of a call from `(reduce_op, options, site, leaves,
            wire_dtype, first part)`, the general path's decisions.
    """

    def __init__(self, make: Callable[..., FlatRoute]) -> None:
        self._make = make
        self._routes: dict[Any, FlatRoute] = {}

    def route(
        self,
        reduce_op: Any,
        options: Any,
        site: object,
        leaves: tuple[Any, ...],
        wire_dtype: Any,
        first: Any,
    ) -> FlatRoute:
        """The route of this call: kept from an earlier call like it, else made now."""
        # The device type, as `numpy_dtype` decides by it (a host room or not).
        key = (id(leaves), id(options), reduce_op, site, wire_dtype, first.dtype, first.device.type)
        try:
            route = self._routes.get(key)
        except TypeError:  # an unhashable site: made afresh
            return self._make(reduce_op, options, site, leaves, wire_dtype, first)
        if route is not None and route.leaves is leaves and route.options is options:
            return route
        route = self._make(reduce_op, options, site, leaves, wire_dtype, first)
        if len(self._routes) >= MAX_ROUTES:
            self._routes.clear()
        self._routes[key] = route
        return route


def numpy_dtype(first: Any) -> np.dtype | None:
    """The NumPy dtype of host tensor `first`, None for CUDA ones and dtypes NumPy lacks."""
    if first.device.type != "cpu":
        return None
    try:
        return np.dtype(str(first.dtype).removeprefix("torch."))
    except TypeError:  # bfloat16: NumPy has none
        return None


def total_numel(parts: Sequence[Any]) -> int:
    """The number of elements of all `parts`."""
    return sum(map(type(parts[0]).numel, parts))  # torch tensors' method, unbound
