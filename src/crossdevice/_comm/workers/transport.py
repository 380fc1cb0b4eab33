"""`Transport`: what moves the data of one cross-worker all-reduce, and nothing else.

A worker communicator is composed (`communicator.py`): integrity (fingerprints, which say
what each worker is about to do, `integrity.py`), health (who is alive, and the one
wait loop, `health.py`) and transports, which only move data. Every transport has the
same small interface, and the first one `enabled` for a layout carries it (Horovod runs
the first enabled op of its list the same way):

* `SharedMemoryTransport` (`shm.py`): every worker on this host, through `/dev/shm`;
* `RingTransport` (`ring.py`): large host all-reduces out of place over Gloo's pairs,
  so that the input is never copied (between 2 workers exchanged whole, and copied
  only to carry the header behind it below `TUNING.header_fold_max_bytes`);
* `ProcessGroupTransport` (`gloo.py`): `torch.distributed.all_reduce` in place, Gloo for
  host buffers and NCCL for CUDA ones; it carries everything the others do not.

Every worker must pick the same transport for the same layout: `enabled` depends on the
layout and on settings the workers agreed on when they connected, nothing else.

An all-reduce runs in two phases, so that it can travel while the caller computes
(`Communicator.all_reduce_async`): `start` sends what can be sent at once and returns a
`Flight`; `Flight.finish` waits for the rest, checks, and returns the results.

A `Job` is one all-reduce as a transport sees it: the layout every worker sends, this
worker's buffers (or None: it sends zeros of the layout, when its own call did not fit
a predicted layout or it is aborting), whether it may write them, how to fill them
lazily, and the inline fingerprint header to check alongside (None: already agreed).
The transport returns this worker's results (None when it sent zeros) and whether every
worker's header equalled this one's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from crossdevice._comm.workers.calls import Call

__all__ = ["Flight", "Job", "Layout", "Reduced", "Transport", "host_layout"]

#: One buffer's wire dtype and element count, in order: what travels.
Layout = tuple[tuple[torch.dtype, int], ...]


@dataclasses.dataclass
class Job:
    """One all-reduce for a transport.

    Attributes:
        layout: what every worker sends (dtype, elements), non-empty buffers only.
        buffers: this worker's buffers of `layout` (flat, contiguous), or None: send zeros.
        donated: per buffer, whether it is ours to reduce in place (else it must not
            change; a transport that writes in place copies it first).
        fill: `fill(j, start, stop, out=None)` writes elements `start:stop` of buffer `j`
            (into `out` when given, a flat array of `stop - start` elements) and returns
            whether it wrote anything; None: the buffers are filled already.
        header: this worker's encoded fingerprint, checked against every worker's while
            the data moves; None: the fingerprints were exchanged and agreed before.
        overlap: the caller computes before it waits (`ReduceOptions.overlap`).
    """

    layout: Layout
    buffers: list[torch.Tensor] | None
    donated: tuple[bool, ...] = ()
    fill: Callable[..., bool] | None = None
    header: np.ndarray | None = None
    overlap: bool = False

    def fill_all(self) -> None:
        """Write every buffer whole now (a transport that reads them all at once)."""
        if self.fill is not None and self.buffers is not None:
            for j, (_, numel) in enumerate(self.layout):
                self.fill(j, 0, numel)
            self.fill = None


#: (this worker's results, one per buffer, or None when it sent zeros; whether every
#: worker's inline header equalled this worker's, True when there was none).
Reduced = tuple[list[torch.Tensor] | None, bool]


class Flight(Protocol):
    """One all-reduce a transport started."""

    def finish(self) -> Reduced:
        """Wait for the rest of it (watching the peers' health), check, return the results."""


class Transport(Protocol):
    """Moves one all-reduce's data between the workers (see the module doc)."""

    name: str

    def enabled(self, layout: Layout) -> bool:
        """Whether this transport carries all-reduces of `layout` (alike on every worker)."""

    def start(self, call: Call, job: Job) -> Flight:
        """Send what can be sent of `job` now; `finish` the returned flight for the sums."""

    def abandon(self, job: Job) -> list[Any]:
        """Send `job` (zeros and an abort header) without waiting: this worker quits.

        Its peers, waiting in the same all-reduce, get their ops paired and see the
        header differ. Returns what must be kept alive (pending work, its buffers).
        """


def host_layout(tensors: list[torch.Tensor]) -> Layout | None:
    """The layout of the non-empty `tensors`, None when any lives on CUDA (NCCL's)."""
    if any(t.is_cuda for t in tensors):
        return None
    return tuple((t.dtype, t.numel()) for t in tensors if t.numel())
