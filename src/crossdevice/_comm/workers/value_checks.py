"""Checks of all_gather and broadcast calls against every worker's fingerprint.

The fingerprints say each worker's value's rank, dtype and shape; these checks raise
the same ValueError on every worker (they all read the same table) before data moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from crossdevice._comm.workers import fingerprint as fp
from crossdevice._comm.workers.wire import DTYPE_CODES, dtype_name

__all__ = ["check_broadcast", "check_gather"]


def _describe(prints: Sequence[fp.Fingerprint]) -> str:
    def one(p: fp.Fingerprint) -> str:
        if p.ndim < 0:
            return "None"
        return f"{p.shape} {dtype_name(DTYPE_CODES[p.dtype_code])}"

    return ", ".join(f"rank {rank}: {one(p)}" for rank, p in enumerate(prints))


def check_gather(call: Any, prints: Sequence[fp.Fingerprint], axis: int) -> int:
    """The normalised gather axis; ValueError (alike on every worker) for bad inputs."""
    ndim = prints[0].ndim
    axes = sorted({p.arg for p in prints})
    problem = None
    if len({(p.ndim, p.dtype_code) for p in prints}) > 1:
        problem = "arrays of different ranks or dtypes"
    elif len(axes) > 1:
        problem = f"different axes {axes}"
    elif not -ndim <= axis < ndim:
        problem = f"axis {axis}, out of range for arrays of rank {ndim}"
    else:
        axis %= ndim
        if len({p.shape[:axis] + p.shape[axis + 1 :] for p in prints}) > 1:
            problem = f"shapes that differ on an axis other than {axis}"
    if problem is not None:
        raise ValueError(
            f"{call.label}: every worker must pass an array of the same rank and dtype whose "
            f"shape differs only along the gather axis, with the same axis; received "
            f"{problem} ({_describe(prints)}); reshape or pad the values so that only the "
            f"gather axis differs"
        )
    return axis


def check_broadcast(
    call: Any, prints: Sequence[fp.Fingerprint], root: int, world_size: int
) -> None:
    """ValueError (alike on every worker) when the workers' broadcast calls disagree."""
    roots = sorted({p.arg for p in prints})
    problem = None
    if len(roots) > 1:
        problem = f"different roots {roots}"
    elif not 0 <= root < world_size:
        problem = f"root {root}, out of range for {world_size} workers"
    elif prints[root].ndim < 0:
        problem = f"no value on root {root}"
    elif any(
        p.ndim >= 0 and (p.ndim, p.dtype_code, p.shape) != (r.ndim, r.dtype_code, r.shape)
        for p in prints
        for r in [prints[root]]
    ):
        problem = "values whose shape or dtype differ from root's"
    if problem is not None:
        raise ValueError(
            f"{call.label}: every worker must name the same root, the root must pass a value "
            f"and the others None or an array of the root's shape and dtype; received "
            f"{problem} ({_describe(prints)})"
        )
