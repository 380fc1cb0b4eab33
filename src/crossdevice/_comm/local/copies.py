"""All-gather and broadcast rounds of a `ThreadCommunicator`: copies into one shared output.

The last replica to arrive plans the round: one output buffer (recycled when large), one
read-only result every replica shares (a torch view for torch inputs), and the copies
themselves, made at once when small or handed out as shared work (each replica copies its
own part) when large.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from crossdevice._arrays import backend_for
from crossdevice._comm.local.arrivals import CollectiveArrival
from crossdevice._comm.local.host_reduce import ALIGN_BYTES
from crossdevice._core import tuning
from crossdevice._sync.rounds import Round

__all__ = ["setup_broadcast", "setup_gather"]


def setup_gather(
    rnd: Round, arrivals: list[CollectiveArrival], output: Callable[[np.dtype, int], np.ndarray]
) -> None:
    """Plan an all-gather round: results, and the copies as shared work when large."""
    n = len(arrivals)
    axis: int = arrivals[0].extra
    if any(a.arrays is None for a in arrivals):
        column = [a.values[0] for a in arrivals]
        be = backend_for(column[0])
        result = be.freeze(be.concat(column, axis))
        for a in arrivals:
            rnd.results.setdefault(a.torch_mask, [result])
        return
    hosts = [a.arrays[0] for a in arrivals]  # type: ignore[index]
    shape = list(hosts[0].shape)
    shape[axis] = sum(h.shape[axis] for h in hosts)
    size = math.prod(shape)
    flat = output(hosts[0].dtype, size)
    out = flat.reshape(shape)
    starts = [0]
    for h in hosts:
        starts.append(starts[-1] + h.shape[axis])
    lead = (slice(None),) * axis

    def copy(replica_id: int) -> None:
        dest = out[(*lead, slice(starts[replica_id], starts[replica_id + 1]))]
        np.copyto(dest, hosts[replica_id])

    rnd.outputs = [flat]
    _share_single(rnd, arrivals, out)
    if size * flat.itemsize < tuning.TUNING.shared_work_min_bytes or n == 1:
        for r in range(n):
            copy(r)
    else:
        rnd.work = copy


def setup_broadcast(
    rnd: Round, arrivals: list[CollectiveArrival], output: Callable[[np.dtype, int], np.ndarray]
) -> None:
    """Plan a broadcast round: results, and the copy as shared work when large."""
    n = len(arrivals)
    root: int = arrivals[0].extra
    source = arrivals[root]
    if source.arrays is None:
        value = source.values[0]
        be = backend_for(value)
        result = be.freeze(be.copy(value))
        for a in arrivals:
            rnd.results.setdefault(a.torch_mask, [result])
        return
    src = source.arrays[0]
    flat = output(src.dtype, src.size)
    out = flat.reshape(src.shape)
    rnd.outputs = [flat]
    _share_single(rnd, arrivals, out)
    src_flat = src.reshape(-1)
    if src.nbytes < tuning.TUNING.shared_work_min_bytes or n == 1:
        np.copyto(flat, src_flat)
        return
    align = max(1, ALIGN_BYTES // src.itemsize)
    bounds = [min(src.size, (src.size * k // n) // align * align) for k in range(n)]
    bounds.append(src.size)

    def copy(replica_id: int) -> None:
        lo, hi = bounds[replica_id], bounds[replica_id + 1]
        np.copyto(flat[lo:hi], src_flat[lo:hi])

    rnd.work = copy


def _share_single(rnd: Round, arrivals: list[CollectiveArrival], out: np.ndarray) -> None:
    readonly = out.view()
    readonly.flags.writeable = False
    for a in arrivals:
        key = a.torch_mask
        if not key or key in rnd.results:
            continue
        if key[0]:
            import torch

            rnd.results[key] = [torch.from_numpy(out)]
        else:
            rnd.results[key] = [readonly]
