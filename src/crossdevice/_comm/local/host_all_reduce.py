"""`all_reduce_host`: the host all-reduce for a caller that holds every replica's arrays.

`HostAllReduce` (a `CrossDeviceOps`) reduces a `PerReplica` outside `strategy.run` here:
the same validation, packing, in-order adds and shared read-only results as the replicas'
own all-reduce (`reduction.py`), computed on the caller's thread, large rounds across the
host kernels' worker pool. No communicator and no rendezvous: nobody else takes part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from crossdevice._arrays.buffer_pool import BufferPool
from crossdevice._arrays.host_kernels import run_parallel
from crossdevice._comm.local.arrivals import CollectiveArrival, validate
from crossdevice._comm.local.reduction import Packs, Reduction, arrive
from crossdevice._core import tuning
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op
from crossdevice._sync.call import describe_leaves

__all__ = ["all_reduce_host"]


class _HostCall:
    """The call `validate` names in its messages: `all_reduce_host`, once per call."""

    name = "all_reduce_host"
    seq = 1

    def __init__(self, arrivals: list[CollectiveArrival]) -> None:
        self.arrivals = arrivals

    def describe(self, arrival: CollectiveArrival) -> str:
        op = arrival.op.name if arrival.op is not None else None
        return f"all_reduce({op}, {describe_leaves(arrival.sig, arrival.structure)})"

    def describe_calls(self) -> str:
        return "; ".join(f"replica {r}: {self.describe(a)}" for r, a in enumerate(self.arrivals))


def all_reduce_host(
    per_replica: Sequence[Sequence[Any]],
    reduce_op: ReduceOp | str,
    pool: BufferPool | None = None,
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
        pool: where large output buffers are recycled from (None: fresh buffers).

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
    op = as_reduce_op(reduce_op)
    n = len(per_replica)
    if n < 1:
        raise ValueError("all_reduce_host expected at least one replica's arrays, received none")
    call = _HostCall([])
    arrivals = [arrive(list(values), op, Packs(), call) for values in per_replica]
    call.arrivals = arrivals
    error = validate(call, arrivals)
    if error is not None:
        raise ValueError(error)

    def output(dtype: np.dtype, size: int) -> np.ndarray:
        if pool is None or size * dtype.itemsize < tuning.TUNING.pool_min_bytes:
            return np.empty(size, dtype=dtype)
        return pool.take(dtype, size)

    reduction = Reduction(arrivals, output)
    if reduction.work is not None:
        run_parallel(reduction.work)
        reduction.finish()
    return [reduction.result(a.torch_mask) for a in arrivals]
