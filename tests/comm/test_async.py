"""The asynchronous replica all-reduce (`_strategies.replica.all_reduce_async`).

Across workers it is the synchronous all-reduce's own collective left in flight: bitwise
the same results (every path: one NumPy value, large values, nests of torch tensors that
take two collectives, MEAN of integers, several local replicas), errors raised as
themselves from `wait`. Within one process it completes when issued.
"""

from __future__ import annotations

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._strategies.replica import all_reduce_async
from tests.comm import async_workers
from tests.comm.peers import GLOO, assert_failing_peer_named
from tests.multi_worker.harness import run_workers

torch = pytest.importorskip("torch")


def test_within_one_process_it_completes_when_issued() -> None:
    cd.config.set_logical_cpu_devices(2)
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])

    def step() -> tuple[bool, np.ndarray, np.ndarray]:
        ctx = cd.get_replica_context()
        x = np.arange(5.0) * (ctx.replica_id_in_sync_group + 1)
        pending = all_reduce_async(ctx, "mean", {"x": x})
        done = pending.done()
        return done, pending.wait()["x"], ctx.all_reduce("mean", {"x": x})["x"]

    for done, got, sync in strategy.experimental_local_results(strategy.run(step)):
        assert done
        assert got.tobytes() == sync.tobytes()
        assert got.tolist() == [0.0, 1.5, 3.0, 4.5, 6.0]


def test_a_value_that_requires_grad_stays_differentiable() -> None:
    cd.config.set_logical_cpu_devices(2)
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])

    def step() -> list[tuple[list[float], list[float]]]:
        ctx = cd.get_replica_context()
        out = []
        for reduce in (ctx.all_reduce, lambda op, v: all_reduce_async(ctx, op, v).wait()):
            w = torch.ones(3, requires_grad=True)
            total = reduce("sum", w * (ctx.replica_id_in_sync_group + 1))
            total.sum().backward()
            out.append((total.detach().tolist(), w.grad.tolist()))
        return out

    for sync, issued in strategy.experimental_local_results(strategy.run(step)):
        assert sync[0] == [3.0] * 3
        assert issued == sync  # the value and the gradient the all-reduce's backward gives


def test_outside_a_replica_it_says_where_it_may_be_called() -> None:
    strategy = cd.MirroredStrategy(["CPU:0"])
    ctx = strategy.run(cd.get_replica_context)
    with pytest.raises(RuntimeError, match="replica"):
        all_reduce_async(ctx, "sum", np.ones(2))


def _check_replicas(outs: list[dict], local: int) -> None:
    replicas = [r for out in outs for r in out["replicas"]]
    assert len(replicas) == 2 * local
    reference = replicas[0]
    for got in replicas:
        assert got["unchanged"]
        for key in reference:
            if "/" in key:
                sync, issued, done = got[key]
                assert done, key
                assert issued == sync, key  # bitwise, leaf by leaf
                assert sync == reference[key][0], key  # the same bits everywhere
        assert got["first"] == got["first_again"] == reference["first"]
        assert got["first"] == got["nest/sum"][0]
        assert got["second"] == got["large/sum"][0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("env", [GLOO, {}], ids=["gloo", "shared-memory"])
def test_across_workers_the_results_are_bitwise_the_synchronous_ones(env: dict) -> None:
    outs = [
        r.unwrap() for r in run_workers(async_workers.same_bits, 2, args=(1,), env=env, timeout=120)
    ]
    _check_replicas(outs, 1)
    # And the values are the rank-order sums (not only the same on both paths).
    (got,) = [v for k, v in outs[0]["replicas"][0].items() if k == "large/sum"]
    chain = async_workers.values(0, 0)["large"] + async_workers.values(1, 0)["large"]
    assert got[0][0][1] == chain.tobytes()


@pytest.mark.multiprocess
def test_with_two_replicas_per_worker_each_replica_waits_for_its_own_results() -> None:
    outs = [
        r.unwrap()
        for r in run_workers(async_workers.same_bits, 2, args=(2,), env=GLOO, timeout=120)
    ]
    _check_replicas(outs, 2)


@pytest.mark.multiprocess
def test_a_differing_call_fails_every_worker_as_a_mismatch() -> None:
    outs = [r.unwrap() for r in run_workers(async_workers.mismatch, 2, env=GLOO, timeout=90)]
    for out in outs:
        outcome = out["outcome"]
        assert outcome[0] == "wait", out  # predicted: the check comes with the data
        assert outcome[1] == "CollectiveMismatchError", out
        assert "shapes" in outcome[2]
        assert outcome[3] == "CollectiveMismatchError"  # and again, as itself
        assert out["after"] == 2.0  # the next all-reduce pairs up


@pytest.mark.multiprocess
def test_a_failing_peer_is_named_by_the_worker_waiting_on_it() -> None:
    outs = [r.unwrap() for r in run_workers(async_workers.peer_fails, 2, env=GLOO, timeout=90)]
    assert_failing_peer_named(outs)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("how", "error"), [("kill", "WorkerFailedError"), ("stall", "CollectiveTimeoutError")]
)
def test_a_lost_peer_is_named_from_the_background_of_the_ring(how: str, error: str) -> None:
    results = run_workers(
        async_workers.lost_peer, 2, args=(how,), env=GLOO, timeout=90, required=[0]
    )
    out = results[0].unwrap()
    kind, message = out["outcome"]
    assert kind == error, out
    assert "rank 1" in message or "rank(s) [1]" in message, out
    assert out["elapsed"] < 10.0, out
