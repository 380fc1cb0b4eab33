"""`RingTransport`: large host all-reduces out of place, over Gloo's pairs.

Gloo's all-reduce works in place, so an all-reduce that must leave its input unchanged
(TF's semantics, and a strategy's local sums that are the user's own arrays) first
copies the input: on the 2-core host that copy cost 17-33% of a raw Gloo all-reduce
from 1 MiB up. This transport never copies: it sends straight from the input and writes
the sums straight into a fresh output, in two phases of point-to-point messages on the
communicator's Gloo group (the same traffic as Gloo's own ring):

    every buffer is cut into `world_size` chunks; chunk r is rank r's
    # reduce-scatter: every rank sends chunk q of its input to rank q, and receives
    #   chunk r of every peer's input; it sums chunk r in rank order into its output
    # all-gather: every rank sends its summed chunk to every peer, and receives theirs
    #   straight into its output

Each chunk is summed once, by its owner, adding the workers' values in rank order
(`x_0 + x_1 + ...`, the same chain as the shared-memory transport), and every worker
receives those same bits: results are bitwise equal on every worker and run to run.

The inline fingerprint (`Job.header`) travels to every peer with the reduce-scatter and
is compared byte for byte before the all-gather: a worker whose call differs (or that
aborts) sends zeros with its own header, every worker sees a difference, and none goes
on to the all-gather (sizes always match: every worker sends the predicted layout).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import torch
import torch.distributed as dist

from crossdevice._arrays import host_kernels
from crossdevice._arrays.buffer_pool import BufferPool
from crossdevice._comm.workers.calls import Call
from crossdevice._comm.workers.groups import Groups
from crossdevice._comm.workers.health import HealthBoard
from crossdevice._comm.workers.speculation import RoomPool
from crossdevice._comm.workers.transport import Job, Layout, Reduced
from crossdevice._core import tuning

__all__ = ["SUMMED_DTYPES", "RingTransport", "chunk_bounds"]

#: Dtypes whose sums NumPy and Gloo compute alike (integers wrap, floats round once per
#: add); bool, float16, bfloat16 and complex stay on Gloo's own all-reduce.
SUMMED_DTYPES: Final = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})

#: Tags of the messages: the header, then per buffer its reduce-scatter and all-gather.
_HEADER_TAG: Final = 1
_TAG_BASE: Final = 2


def chunk_bounds(numel: int, parts: int) -> list[int]:
    """Where each rank's chunk of a buffer of `numel` elements starts (and the end)."""
    return [numel * k // parts for k in range(parts)] + [numel]


class RingTransport:
    """Out-of-place host all-reduces over the Gloo group's pairs (see the module doc).

    Args:
        groups: the communicator's process groups (the host one carries the messages).
        health: the health board whose wait loop every wait goes through.
        rank: this worker's rank.
        world_size: number of workers.
        rooms: where outputs come from (recycled once nobody holds a result).
    """

    name = "ring"

    def __init__(
        self, groups: Groups, health: HealthBoard, rank: int, world_size: int, rooms: RoomPool
    ) -> None:
        self._groups = groups
        self._health = health
        self._rank = rank
        self._world = world_size
        self._rooms = rooms
        self._scratch = BufferPool(per_key=2)
        self._zeros: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def enabled(self, layout: Layout) -> bool:
        """Host layouts of summed dtypes of at least `TUNING.ring_min_bytes`, 2+ workers."""
        return (
            self._world > 1
            and all(dtype in SUMMED_DTYPES for dtype, _ in layout)
            and sum(dtype.itemsize * n for dtype, n in layout) >= tuning.TUNING.ring_min_bytes
        )

    def start(self, call: Call, job: Job) -> _RingFlight:
        """Post the header and the reduce-scatter; `finish` sums, checks and all-gathers."""
        group, rank, world = self._groups.host, self._rank, self._world
        peers = [q for q in range(world) if q != rank]
        flight = _RingFlight(self, call, job)
        if job.header is not None:
            mine = torch.from_numpy(job.header)
            flight.headers = [torch.empty_like(mine) for _ in peers]
            for q, into in zip(peers, flight.headers, strict=True):
                flight.works.append(dist.isend(mine, q, group=group, tag=_HEADER_TAG))
                flight.works.append(dist.irecv(into, q, group=group, tag=_HEADER_TAG))
        fill = job.fill if job.buffers is not None else None
        for j, (dtype, numel) in enumerate(job.layout):
            bounds = chunk_bounds(numel, world)
            source = self._source(job, j, dtype, numel)
            tag = _TAG_BASE + 2 * j
            for q in peers:
                lo, hi = bounds[q], bounds[q + 1]
                if fill is not None:
                    fill(j, lo, hi)
                flight.works.append(dist.isend(source[lo:hi], q, group=group, tag=tag))
            lo, hi = bounds[rank], bounds[rank + 1]
            received = {}
            for q in peers:
                buf = torch.from_numpy(self._scratch.take(_np_dtype(dtype), hi - lo))
                received[q] = buf
                flight.works.append(dist.irecv(buf, q, group=group, tag=tag))
            if fill is not None:
                fill(j, lo, hi)
            flight.parts.append((source, bounds, received))
        return flight

    def _finish(self, flight: _RingFlight) -> Reduced:
        job, call, rank, world = flight.job, flight.call, self._rank, self._world
        self._health.wait_works(call, flight.works)
        flight.works = []
        header = job.header
        agrees = header is None or all(
            torch.equal(h, torch.from_numpy(header)) for h in flight.headers
        )
        if job.buffers is None or not agrees:
            return None, agrees
        # every rank sums its own chunk, in rank order.
        outputs = []
        for (dtype, numel), (source, bounds, received) in zip(
            job.layout, flight.parts, strict=True
        ):
            out = self._rooms.buffer(dtype, numel)[:numel]
            lo, hi = bounds[rank], bounds[rank + 1]
            parts = [
                source[lo:hi].numpy() if q == rank else received[q].numpy() for q in range(world)
            ]
            host_kernels.sum_n(parts, out=out[lo:hi].numpy(), parallel=False)
            outputs.append(out)
        flight.parts = []
        # all-gather: every rank's summed chunk, straight into every output.
        group, works = self._groups.host, []
        for j, out in enumerate(outputs):
            bounds = chunk_bounds(out.numel(), world)
            mine = out[bounds[rank] : bounds[rank + 1]]
            tag = _TAG_BASE + 2 * j + 1
            for q in (q for q in range(world) if q != rank):
                works.append(dist.isend(mine, q, group=group, tag=tag))
                works.append(dist.irecv(out[bounds[q] : bounds[q + 1]], q, group=group, tag=tag))
        self._health.wait_works(call, works)
        return outputs, True

    def abandon(self, job: Job) -> list[Any]:
        """Post the reduce-scatter of zeros with the abort header, without waiting.

        Each peer's sends to this worker pair with its receives here, and the header it
        gets differs from its own: it stops before the all-gather and exchanges headers.
        """
        group, rank, world = self._groups.host, self._rank, self._world
        kept: list[Any] = []
        if job.header is not None:
            mine = torch.from_numpy(job.header)
            for q in (q for q in range(world) if q != rank):
                into = torch.empty_like(mine)
                kept += [dist.isend(mine, q, group=group, tag=_HEADER_TAG), mine]
                kept += [dist.irecv(into, q, group=group, tag=_HEADER_TAG), into]
        for j, (dtype, numel) in enumerate(job.layout):
            bounds = chunk_bounds(numel, world)
            zeros = self._source(job, j, dtype, numel)
            for q in (q for q in range(world) if q != rank):
                into = torch.empty(bounds[rank + 1] - bounds[rank], dtype=dtype)
                kept += [
                    dist.isend(
                        zeros[bounds[q] : bounds[q + 1]], q, group=group, tag=_TAG_BASE + 2 * j
                    ),
                    dist.irecv(into, q, group=group, tag=_TAG_BASE + 2 * j),
                    zeros,
                    into,
                ]
        return kept

    def _source(self, job: Job, j: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Buffer `j` as it is sent: this worker's own, or zeros (its call did not fit)."""
        if job.buffers is not None:
            return job.buffers[j].reshape(-1)
        key = (dtype, numel)
        zeros = self._zeros.get(key)
        if zeros is None:
            if len(self._zeros) >= 4:
                self._zeros.clear()
            zeros = self._zeros[key] = torch.zeros(numel, dtype=dtype)
        return zeros


class _RingFlight:
    """A ring all-reduce whose reduce-scatter (and header) is in flight."""

    __slots__ = ("call", "headers", "job", "parts", "transport", "works")

    def __init__(self, transport: RingTransport, call: Call, job: Job) -> None:
        self.transport = transport
        self.call = call
        self.job = job
        self.works: list[Any] = []
        self.headers: list[torch.Tensor] = []
        #: per buffer: (what this worker sends, the chunk bounds, what each peer sent)
        self.parts: list[tuple[torch.Tensor, list[int], dict[int, torch.Tensor]]] = []

    def finish(self) -> Reduced:
        """Wait for the reduce-scatter, check the headers, sum, all-gather."""
        return self.transport._finish(self)


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype
