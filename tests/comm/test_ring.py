"""The out-of-place ring over Gloo's pairs (`_comm/workers/ring.py`): exact, checked, clear.

Every way runs: two phases (reduce-scatter, all-gather), and the whole exchange
(`ring.direct`, the default on 2 workers below `TUNING.direct_max_bytes`), with its
header apart or folded behind a first buffer of one piece (`ring.folded`; the tests'
6 MiB are two pieces by default and too large to fold, one folded with 8 MiB pieces and
an 8 MiB fold limit).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from tests.comm import ring_workers
from tests.comm.peers import GLOO, assert_failing_peer_named, tuned
from tests.multi_worker.harness import run_workers

#: (workers, environment, what carries the tests' all-reduces).
WAYS = [
    pytest.param(2, GLOO, "direct", id="2-direct"),
    pytest.param(
        2, tuned(ring_piece_bytes=8 << 20, header_fold_max_bytes=8 << 20), "folded", id="2-folded"
    ),
    pytest.param(2, tuned(direct_max_workers=1), "ring", id="2-ring"),
    pytest.param(3, GLOO, "ring", id="3-ring"),
    pytest.param(3, tuned(direct_max_workers=3), "direct", id="3-direct"),
    pytest.param(
        3,
        tuned(direct_max_workers=3, ring_piece_bytes=8 << 20, header_fold_max_bytes=8 << 20),
        "folded",
        id="3-folded",
    ),
]
TWO = [w for w in WAYS if w.values[0] == 2]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world_size", "env", "way"), WAYS)
def test_ring_sums_in_rank_order_the_same_bits_everywhere(
    world_size: int, env: dict[str, str], way: str
) -> None:
    outs = [r.unwrap() for r in run_workers(ring_workers.sums, world_size, env=env, timeout=90)]
    chain, tiny = ring_workers.data(0), ring_workers.tiny(0)
    for rank in range(1, world_size):
        chain = chain + ring_workers.data(rank)  # the in-order chain, in float32
        tiny = tiny + ring_workers.tiny(rank)
    for out in outs:
        assert out["carrier"] == way
        assert out["tiny_carrier"] == ("folded" if way != "ring" else "ring")
        assert [got.tobytes() for got in out["tiny"]] == [tiny.tobytes()] * 3
        assert not out["shared_memory"]
        assert out["unchanged"]
        for got in out["results"]:
            assert got.dtype == np.float32
            assert got.tobytes() == chain.tobytes()


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world_size", "env", "way"), TWO)
def test_a_worker_whose_call_differs_fails_every_worker_through_the_ring(
    world_size: int, env: dict[str, str], way: str
) -> None:
    del way
    outs = [r.unwrap() for r in run_workers(ring_workers.mismatch, world_size, env=env, timeout=90)]
    for out in outs:
        kind, message = out["mismatch"]
        assert kind == "CollectiveMismatchError", out
        assert "shapes" in message
        assert out["after"] == 2.0  # not broken: the next all-reduce pairs up


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world_size", "env", "way"), TWO)
def test_a_failing_worker_is_named_by_the_peer_waiting_in_the_ring(
    world_size: int, env: dict[str, str], way: str
) -> None:
    del way
    outs = [r.unwrap() for r in run_workers(ring_workers.abort, world_size, env=env, timeout=90)]
    assert_failing_peer_named(outs)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world_size", "env", "way"), TWO)
def test_local_replicas_sums_filled_as_they_leave_are_exact(
    world_size: int, env: dict[str, str], way: str
) -> None:
    del way
    outs = [
        r.unwrap() for r in run_workers(ring_workers.local_sums, world_size, env=env, timeout=90)
    ]
    n = 1 << 16
    replicas = range(2 * world_size)
    a = sum(np.arange(n, dtype=np.float32) % 251 * (r + 1) for r in replicas)
    b = np.full(n, float(sum(replicas)), np.float32)
    for out in outs:
        for per_replica in out["results"]:
            for got_a, got_b in per_replica:
                assert got_a.tobytes() == a.astype(np.float32).tobytes()
                assert got_b.tobytes() == b.tobytes()


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["stop", "kill"])
@pytest.mark.parametrize(("world_size", "env", "way"), TWO)
def test_a_frozen_or_dead_worker_is_named_long_before_the_timeout(
    world_size: int, env: dict[str, str], way: str, how: str
) -> None:
    # Point-to-point waits cannot be cut short, so the first messages are waited on by a
    # helper while the caller reads the board (`HealthBoard.wait_arrival`).
    del way
    results = run_workers(
        ring_workers.lost,
        world_size,
        args=(how,),
        env=env,
        timeout=90,
        required=range(world_size - 1),
    )
    got = results[0].unwrap()
    kind, message = got["outcome"]
    assert kind == "WorkerFailedError", got
    assert f"rank {world_size - 1}" in message
    assert got["elapsed"] < 20.0, got


@pytest.mark.multiprocess
@pytest.mark.parametrize("guess_right", [True, False], ids=["guessed", "guessed-wrong"])
def test_a_worker_that_quits_with_a_guessed_all_reduce_in_flight_is_named(
    guess_right: bool,
) -> None:
    # Its abort tells the peers through their next all-reduce: zeros of the layout they
    # guess for it. With its own all-reduce in flight, that guess comes after the one in
    # flight (learnt as if agreed), not before it: a message of another size on a Gloo
    # pair ends the receiving process (gloo's size check), here the quitting one. Where
    # the guess for the one in flight was wrong, the peers follow it with its data, which
    # zeros would stand in for (rank 0 would sum them): none go, the store's mark tells.
    outs = run_workers(ring_workers.abort_in_flight, 2, args=(guess_right,), env=GLOO, timeout=90)
    assert_failing_peer_named([r.unwrap() for r in outs])
