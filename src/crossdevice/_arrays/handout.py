"""`hand_out`: the one rule for giving a computed result to one more holder.

A result several replicas (or destinations) receive is shared where that is safe and
copied where it is not (docs/design.md §3; TF tensors are immutable):

* NumPy arrays are shared: one buffer, read-only, for every holder;
* anything else (torch has no read-only tensors) is one array per holder, so that an
  in-place edit by one cannot reach another: the first holder may take the result
  itself when nobody else sees it (`copy=False`), every other holder gets a copy.

Every place that hands a result to replicas goes through here: the cross-device ops'
results (`_cross_device/results.py`, `host.py`, the in-order sums of `nccl.py`), the
replica threads' shared all-reduce and all-gather results (`_strategies/replicated.py`)
and the host leaves of GPU replicas (`_strategies/extended.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from crossdevice._arrays import backend_for

__all__ = ["hand_out", "hand_out_all", "hand_out_each"]


def hand_out(value: Any, copy: bool) -> Any:
    """`value` for one more holder: NumPy shared read-only; others copied when `copy`.

    Args:
        value: a computed result (never a caller's input).
        copy: whether somebody else holds (or will hold) `value` itself.
    """
    if isinstance(value, np.ndarray):
        value.setflags(write=False)  # (a little cheaper than `value.flags.writeable = False`)
        return value
    if isinstance(value, np.generic):
        return value  # NumPy scalars are immutable
    return backend_for(value).copy(value) if copy else value


def hand_out_all(value: Any, holders: int) -> list[Any]:
    """`value` for each of `holders`: the first takes it (unless NumPy), the others copies."""
    return [hand_out(value, copy=k > 0) for k in range(holders)]


def hand_out_each(values: Sequence[Any]) -> list[Any]:
    """One result per holder, in order, from results that may be one object many times."""
    seen: set[int] = set()
    out = []
    for value in values:
        out.append(hand_out(value, copy=id(value) in seen))
        seen.add(id(value))
    return out
