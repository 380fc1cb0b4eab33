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

A NumPy array handed to more than one holder is remembered (`is_shared`, by identity,
for as long as it lives): where TF gives every replica a tensor of its own, ours is one
object only because we share the buffer, and `regroup` must keep it per-replica. The
same object from every replica for any other reason (a constant the replica function
captured, what one `merge_fn` returned) is one value, as in TF.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from crossdevice._arrays import backend_for

__all__ = ["hand_out", "hand_out_all", "hand_out_each", "is_shared", "mark_shared"]

#: id -> weak reference of each NumPy array handed to several holders (`mark_shared`).
_SHARED: dict[int, weakref.ReferenceType[np.ndarray]] = {}


def _forget(key: int, ref: weakref.ReferenceType[np.ndarray]) -> None:
    # The array died: its id may be reused by an unrelated object.
    if _SHARED.get(key) is ref:
        _SHARED.pop(key, None)


def mark_shared(array: np.ndarray) -> None:
    """Remember that `array` is one result several holders received (`is_shared`)."""
    key = id(array)
    ref = _SHARED.get(key)
    if ref is None or ref() is not array:
        _SHARED[key] = weakref.ref(array, partial(_forget, key))


def is_shared(value: Any) -> bool:
    """Whether `value` is a result handed to several holders (one buffer for many)."""
    ref = _SHARED.get(id(value))
    return ref is not None and ref() is value


def hand_out(value: Any, copy: bool) -> Any:
    """`value` for one more holder: NumPy shared read-only; others copied when `copy`.

    Args:
        value: a computed result (never a caller's input).
        copy: whether somebody else holds (or will hold) `value` itself.

    Returns:
        NumPy: `value` read-only (a NumPy scalar as a read-only 0-d array, so that a
        result's kind never depends on its dtype or rank), remembered as shared when
        `copy`; anything else: `value`, or a copy when `copy`.
    """
    if isinstance(value, np.ndarray):
        value.setflags(write=False)  # (a little cheaper than `value.flags.writeable = False`)
        if copy:
            mark_shared(value)
        return value
    if isinstance(value, np.generic):
        # NumPy ufuncs turn 0-d arrays into scalars; results are 0-d arrays like inputs.
        return hand_out(np.asarray(value), copy)
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
