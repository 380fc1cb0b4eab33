"""`ProcessGroupTransport`: `torch.distributed.all_reduce` in place (Gloo on host, NCCL on CUDA).

The transport every layout can take: host buffers travel through the communicator's Gloo
group, CUDA buffers through its NCCL group. Gloo reduces in place, so a buffer the caller
still owns is copied first (the API never changes its inputs); donated buffers (a
strategy's packs) are reduced where they lie, and a lazy `fill` writes each chunk of them
just before the op that sends it (`speculation.speculative_ops`: large buffers leave in
chunks, so the copy or local sum of the next chunk runs while the previous one travels).

The inline header (`Job.header`) rides in the data: `INLINE_SLOTS` elements behind the
first buffer (which needs room for them: a `RoomPool` buffer, or a copy into one), or in
a small all-reduce of its own just before a large first buffer (`header_apart`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from crossdevice._comm.workers.calls import Call
from crossdevice._comm.workers.groups import Groups
from crossdevice._comm.workers.health import HealthBoard
from crossdevice._comm.workers.speculation import (
    Predictor,
    RoomPool,
    header_room,
    inline_agrees,
    speculative_ops,
)
from crossdevice._comm.workers.transport import Flight, Job, Layout, Reduced

__all__ = ["ProcessGroupTransport"]


class _Flight:
    """A started all-reduce: `finish` waits for its works and checks its header."""

    __slots__ = ("finish",)

    def __init__(self, finish: Callable[[], Reduced]) -> None:
        self.finish = finish


class ProcessGroupTransport:
    """In-place all-reduces on the communicator's process groups (see the module doc).

    Args:
        groups: the communicator's process groups.
        health: the health board whose wait loop every wait goes through.
        world_size: number of workers (what an inline header's sums are checked against).
        rooms: buffers with room for the inline header behind their data.
        predictor: where the zeros come from when this worker's call did not fit.
    """

    name = "process group"

    def __init__(
        self,
        groups: Groups,
        health: HealthBoard,
        world_size: int,
        rooms: RoomPool,
        predictor: Predictor,
    ) -> None:
        self._groups = groups
        self._health = health
        self._world = world_size
        self._rooms = rooms
        self._predictor = predictor

    def enabled(self, layout: Layout) -> bool:
        """Every layout: the transport of last resort."""
        del layout
        return True

    def start(self, call: Call, job: Job) -> Flight:
        """Launch the ops, filling donated buffers chunk by chunk as they leave."""
        tensors, views = self._writable(job)
        ops, slots, mine = speculative_ops(job.layout, tensors, job.header)
        fill = job.fill if job.buffers is not None else None
        works: list[Any] = []
        for tensor, span in ops:
            if fill is not None and span is not None:
                fill(*span)
            works.append(self._groups.all_reduce(tensor))

        # Read back through NumPy: after the wait this process's caches are Gloo's, and
        # torch's dispatch costs there several times what it costs now.
        check = None if slots is None else slots.numpy()

        def finish() -> Reduced:
            self._health.wait_works(call, works)
            agrees = check is None or inline_agrees(check, mine or [], self._world)
            return (views if agrees else None), agrees

        return _Flight(finish)

    def abandon(self, job: Job) -> list[Any]:
        """Launch the ops of `job` (zeros, an abort header) without waiting for them."""
        tensors = self._predictor.zeros(job.layout)
        ops, _, _ = speculative_ops(job.layout, tensors, job.header)
        return [(self._groups.all_reduce(t), t) for t, _ in ops]

    def _writable(self, job: Job) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(what Gloo reduces in place, this worker's results as views of it).

        The first buffer gets room behind it for an inline header that is not apart;
        buffers the caller still owns are copied (inputs never change), the first one
        straight into a buffer with that room.
        """
        buffers = job.buffers
        if buffers is None:
            return self._predictor.zeros(job.layout), None
        roomy = job.header is not None and header_room(job.layout)
        live: list[torch.Tensor] = []
        sent: list[torch.Tensor] = []
        for t, mine in zip(buffers, job.donated, strict=True):
            first = roomy and not sent  # this buffer carries the header behind it
            if not mine:
                room = self._copy(t, roomy=first)
            elif not first:
                room = t
            else:
                found = self._rooms.room_of(t)
                if found is None:
                    job.fill_all()  # the first buffer is copied whole, behind it the header
                    found = self._copy(t, roomy=True)
                room = found
            sent.append(room)
            live.append(room[: t.numel()] if first else room)
        return sent, live

    def _copy(self, tensor: torch.Tensor, *, roomy: bool = False) -> torch.Tensor:
        """A copy of `tensor` in a recycled host buffer (CUDA ones: a fresh CUDA one).

        `roomy`: the copy keeps `INLINE_SLOTS` elements of room behind the data, and the
        returned tensor includes them.
        """
        if tensor.is_cuda and not roomy:
            return tensor.clone()
        room = self._rooms.copy(tensor)
        return room if roomy else room[: tensor.numel()]
