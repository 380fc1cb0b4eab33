"""`Integrity.abandon`: a worker that quits sends zeros only where its peers' receives fit.

After an all-reduce whose start raised midway (a lazy fill raised after part of the data
left: a backward pass that raised after its first gradient buckets left), the peers wait
for the rest: zeros of any layout would complete their receives with data that is not
this worker's (summed silently) or meet receives of another size (Gloo ends the process).
Nothing is sent then; the store's abort mark names the worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from crossdevice._comm.workers.calls import Call, Standing  # noqa: E402
from crossdevice._comm.workers.integrity import Integrity  # noqa: E402
from crossdevice._comm.workers.transport import Job  # noqa: E402

_LAYOUT = ((torch.float32, 8),)


class _Transport:
    """Sends nothing; its `start` raises when told to (a lazy fill that raised midway)."""

    name = "fake"

    def __init__(self, raises: bool) -> None:
        self.raises = raises
        self.abandoned: list[Job] = []

    def enabled(self, layout: Any) -> bool:
        return True

    def start(self, call: Call, job: Job) -> Any:
        if self.raises:
            raise ValueError("backward raised")
        return object()

    def abandon(self, job: Job) -> list[Any]:
        self.abandoned.append(job)
        return []


class _Groups:
    host = None  # the default group


@pytest.fixture
def one_worker(tmp_path: Any) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("midway", [False, True], ids=["started", "midway"])
def test_zeros_of_the_predicted_layout_go_only_after_a_whole_start(
    one_worker: None, midway: bool
) -> None:
    transport = _Transport(raises=midway)
    integrity = Integrity(Standing(0, 1), _Groups(), None, [transport])  # type: ignore[arg-type]
    integrity._predict = lambda: _LAYOUT  # type: ignore[method-assign]
    header = np.zeros(8, dtype=np.uint8)
    call = Call("all_reduce", 1, 10.0, time.monotonic())

    def job(layout: Any) -> Job:
        return Job(layout, [torch.zeros(8)], fill=lambda *args, **kwargs: True)

    if midway:
        with pytest.raises(ValueError, match="backward raised"):
            integrity.start(call, header, _LAYOUT, job, lambda: "")
    else:
        integrity.start(call, header, _LAYOUT, job, lambda: "")
    integrity.abandon(1, "ValueError")
    if midway:
        assert transport.abandoned == []  # the peers wait for the rest: nothing fits it
    else:
        # An all-reduce in flight, started whole: the zeros take the guess after it.
        assert [sent.layout for sent in transport.abandoned] == [_LAYOUT]
        assert transport.abandoned[0].buffers is None  # zeros
