"""`all_reduce_host`: the host all-reduce for a caller that holds every replica's arrays.

`HostAllReduce` (a `CrossDeviceOps`) reduces a `PerReplica` outside `strategy.run` here:
the same validation, packing, in-order adds and shared read-only results as the replicas'
own all-reduce, computed on the caller's thread (large rounds across the host kernels'
worker pool). One communicator per replica count, used for its planning only.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Final

from crossdevice._comm.local.thread import ThreadCommunicator
from crossdevice._core.reduce_op import ReduceOp

__all__ = ["all_reduce_host"]


_HOST_REDUCERS: dict[int, ThreadCommunicator] = {}
_HOST_REDUCERS_LOCK: Final = threading.Lock()


def all_reduce_host(
    per_replica: Sequence[Sequence[Any]], reduce_op: ReduceOp | str
) -> list[list[Any]]:
    """The default host all-reduce for a caller holding every replica's arrays.

    `per_replica[r]` is replica r's list of arrays (NumPy, scalars or torch tensors; the
    same shapes and dtypes in every list). Arrays are grouped by dtype, small ones packed,
    large ones reduced in place in cache-sized blocks across the worker pool, adding in
    replica order (bitwise equal to `x0 + x1 + ...`). Every replica gets views of the same
    read-only result buffers, in its own library.

    Args:
        per_replica: one list of arrays per replica (at least one replica).
        reduce_op: `ReduceOp.SUM`, `ReduceOp.MEAN` or their names.

    Returns:
        One list of results per replica.

    Raises:
        ValueError: the lists differ in length, shapes or dtypes (naming both).

    Example:
        >>> import numpy as np
        >>> a, b = np.ones(3, np.float32), np.full(3, 2.0, np.float32)
        >>> all_reduce_host([[a], [b]], "mean")[1][0]
        array([1.5, 1.5, 1.5], dtype=float32)
    """
    n = len(per_replica)
    if n < 1:
        raise ValueError("all_reduce_host expected at least one replica's arrays, received none")
    with _HOST_REDUCERS_LOCK:
        comm = _HOST_REDUCERS.get(n)
        if comm is None:
            comm = _HOST_REDUCERS[n] = ThreadCommunicator(n, name="all_reduce_host")
    return comm.cross_replica_all_reduce(per_replica, reduce_op)
