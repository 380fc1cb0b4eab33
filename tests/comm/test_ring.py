"""The out-of-place ring over Gloo's pairs (`_comm/workers/ring.py`): exact, checked, clear."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from tests.comm import ring_workers
from tests.comm.peers import GLOO, assert_failing_peer_named
from tests.multi_worker.harness import run_workers


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_sums_in_rank_order_the_same_bits_everywhere(world_size: int) -> None:
    outs = [r.unwrap() for r in run_workers(ring_workers.sums, world_size, env=GLOO, timeout=90)]
    chain = ring_workers.data(0)
    for rank in range(1, world_size):
        chain = chain + ring_workers.data(rank)  # the in-order chain, in float32
    for out in outs:
        assert not out["shared_memory"]
        assert out["unchanged"]
        for got in out["results"]:
            assert got.dtype == np.float32
            assert got.tobytes() == chain.tobytes()


@pytest.mark.multiprocess
def test_a_worker_whose_call_differs_fails_every_worker_through_the_ring() -> None:
    outs = [r.unwrap() for r in run_workers(ring_workers.mismatch, 2, env=GLOO, timeout=90)]
    for out in outs:
        kind, message = out["mismatch"]
        assert kind == "CollectiveMismatchError", out
        assert "shapes" in message
        assert out["after"] == 2.0  # not broken: the next all-reduce pairs up


@pytest.mark.multiprocess
def test_a_failing_worker_is_named_by_the_peer_waiting_in_the_ring() -> None:
    outs = [r.unwrap() for r in run_workers(ring_workers.abort, 2, env=GLOO, timeout=90)]
    assert_failing_peer_named(outs)
