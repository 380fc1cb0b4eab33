"""MultiWorkerMirroredStrategy across 2 and 3 worker processes on 127.0.0.1."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.multi_worker.harness import run_workers
from tests.multi_worker.strategy_workers import (
    has_data_in_flight,
    has_data_per_pass,
    raised_outside_run,
    scenarios,
    stall_in_all_reduce,
    sync_on_read_on_chief_only,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _split(batch: np.ndarray, n: int) -> list[list[int]]:
    """TF's split: ceil(B / n) examples per replica in order, the last ones what is left."""
    size = -(-len(batch) // n)
    return [batch[i * size : (i + 1) * size].tolist() for i in range(n)]


@pytest.mark.parametrize(
    ("world_size", "local", "use_torch", "launcher"),
    [
        (2, 1, False, "torchrun"),
        (2, 2, True, "torchrun"),
        (3, 1, True, "torchrun"),
        (3, 2, False, "torchrun"),
        (2, 1, False, "tf_config"),
    ],
    ids=["2x1-numpy", "2x2-torch", "3x1-torch", "3x2-numpy", "2x1-tf_config-chief"],
)
def test_collectives_match_numpy(
    world_size: int, local: int, use_torch: bool, launcher: Any
) -> None:
    results = run_workers(
        scenarios,
        world_size,
        args=(local, use_torch),
        timeout=120,
        launcher=launcher,
        chief=launcher == "tf_config",
    )
    outs: list[dict[str, Any]] = [r.unwrap() for r in results]
    n = world_size * local
    ids = np.arange(n)
    for rank, out in enumerate(outs):
        assert out["num_replicas"] == n
        assert out["ids"] == list(range(rank * local, (rank + 1) * local))
        total = float(np.sum(ids + 1))
        for i in range(local):
            np.testing.assert_array_equal(out["sum_x"][i], np.full((2, 3), total))
            np.testing.assert_array_equal(out["sum_y"][i], np.full((2, 3), 2 * total))
            assert out["sum_int"][i] == int(ids.sum())
            np.testing.assert_allclose(out["mean"][i], np.full((2, 3), total / n))
            expected_gather = np.concatenate([np.full((r + 1, 2), r) for r in ids])
            np.testing.assert_array_equal(out["gather"][i], expected_gather)
            assert out["batch"][i][0] == float(ids.sum())
            np.testing.assert_allclose(out["batch"][i][1], np.arange(3.0) * ids.sum())
        weights = ids + 1  # replica r holds r + 1 elements valued r
        assert out["reduce_sum_axis0"] == pytest.approx(float(np.sum(ids * weights)))
        assert out["reduce_mean_axis0"] == pytest.approx(
            float(np.sum(ids * weights) / np.sum(weights))
        )
        assert out["reduce_sum_none"] == float(ids.sum())
        assert out["reduce_to_cpu0"] == [float(ids.sum())] * 2
        expected = np.concatenate([np.full(r + 1, float(r)) for r in ids])
        np.testing.assert_array_equal(out["gather_cross_replica"], expected)
        # Every worker's, also where `run` returned a plain value (one replica per worker).
        np.testing.assert_array_equal(out["gather_run"], np.repeat(ids.astype(float), 2))
        assert out["plain_sum"] == float(world_size)  # a true cross-worker reduce (TF)
        workers = np.arange(world_size) + 1.0  # worker w's plain value: 3 of w + 1
        assert out["plain_sum_axis0"] == float(3 * local * workers.sum())
        assert out["plain_mean_axis0"] == pytest.approx(float(workers.mean()))
        # Variables start from the chief's value (7) on every worker and replica.
        assert out["initial"] == [[7.0, 7.0]] * local
        assert out["updated"] == [[7.0 + float(np.sum(ids + 1))] * 2] * local
        # ONLY_FIRST_REPLICA: replica 0's update (+1) and value (1) on every worker.
        assert out["first_replica"] == [11.0, 1.0]
        # Sharding: each global batch is split over all n replicas; this worker keeps its own.
        for step, batch in enumerate([np.arange(0, 8), np.arange(8, 14)]):
            assert out["shards"][step] == _split(batch, n)[rank * local : (rank + 1) * local]
        # A SUM variable assigned in cross-replica context reads back what was assigned
        # (TF divides by the local replicas only: the read would be world_size times it).
        mine = slice(rank * local, (rank + 1) * local)
        assert out["count_parts"] == [7 // n + (r < 7 % n) for r in range(n)][mine]
        assert out["total_parts"] == [6.0 / n] * local
        assert (out["count"], out["total"]) == (7, 6.0)
        assert out["count_assigned"] == 7  # a snapshot: later assigns of 8 do not show
        # TF 2.21 (CollectiveAllReduceExtended): checkpoints and summaries on the chief only.
        assert out["roles"] == [rank == 0, rank == 0, True, True]


@pytest.mark.parametrize("how", ["stall", "die"])
def test_missing_worker_times_out_naming_the_collective(how: str) -> None:
    results = run_workers(stall_in_all_reduce, 3, args=(2, how), timeout=60, required=[0, 1])
    expected = "CollectiveTimeoutError" if how == "stall" else "WorkerFailedError"
    for rank in (0, 1):
        out = results[rank].unwrap()
        assert out["type"] == expected, out
        message = out["message"]
        if how == "stall":
            assert message.startswith(f"all_reduce #2 on rank {rank} of 3 timed out after 3 s"), (
                message
            )
            assert ": rank(s) [2] (global replicas [2]) did not arrive at it." in message, message
        else:  # named first (rank 1 may also see rank 0's store go, once rank 0 has exited)
            assert message.startswith(
                f"all_reduce #2 on rank {rank} of 3: a peer failed: rank 2 (global replicas [2])"
            ), message
            assert "stopped sending heartbeats" in message, message
        assert out["elapsed"] < 10.0


def test_sync_on_read_read_on_the_chief_only_names_the_variable() -> None:
    """Issue 23: the chief logs a metric, the other worker goes on to `next(iterator)`.
    Every worker's error says what each was doing: the read is a collective all make."""
    results = run_workers(sync_on_read_on_chief_only, 2, args=(1,), timeout=90)
    for rank in (0, 1):
        out = results[rank].unwrap()
        assert out["type"] == "CollectiveMismatchError", out
        message = out["message"]
        assert (
            "reading SyncOnReadVariable 'loss_sum:0' in cross-replica context, which reduces "
            "it across the workers: a collective every worker must make at the same point"
        ) in message, message
        assert "rank 1: has_data #4" in message
        assert "next(iterator) of a distributed" in message
        assert out["elapsed"] < 10.0


def test_a_worker_with_data_does_not_wait_for_the_has_data_agreement() -> None:
    """`next(iterator)` on a worker that has data issues the per-step has-data collective
    and returns: the agreement completes during the step (here in its all-reduce), so
    the late peer costs the step, not the input. Every step's result is still right."""
    results = [r.unwrap() for r in run_workers(has_data_in_flight, 2, timeout=60)]
    assert max(results[0]["waits"]) < 0.5, results[0]["waits"]  # the peer is 1 s late
    for out in results:
        # Each global batch of 2 rows is split one row per worker; SUM adds both.
        assert out["sums"] == [[[2.0]], [[4.0]], [[6.0]]], out["sums"]


def test_a_list_of_batches_agrees_on_its_length_once_a_pass() -> None:
    """Every worker gives the same length: the first step's has-data collective carries
    it, and the later steps of a training loop (each makes an all-reduce) send none. The
    results are the same, and every pass stops at its end on every worker."""
    results = [r.unwrap() for r in run_workers(has_data_per_pass, 2, args=("train",), timeout=60)]
    for out in results:
        assert out["type"] is None, out
        assert out["sums"] == [[[2.0 * (i + 1)]] for i in range(4)] * 2, out["sums"]
        assert out["sent"] == [4, 4], out["sent"]  # one per pass, with the length


def test_steps_without_a_collective_still_agree_each_step() -> None:
    """No collective ran since the last agreement: nothing else would notice a worker a
    step ahead, so each step agrees for real (after the first, without the length)."""
    results = [r.unwrap() for r in run_workers(has_data_per_pass, 2, args=("quiet",), timeout=60)]
    for out in results:
        assert out["type"] is None, out
        assert out["sent"] == [4, None, None, None, None] * 2, out["sent"]


def test_a_worker_a_step_ahead_is_caught_at_the_next_collective() -> None:
    """Rank 1 takes one `next()` more, right after a step's all-reduce: that agreement is
    skipped, so its loop's next `next()` follows no collective and agrees for real,
    against rank 0's all-reduce: both get the mismatch (skipping it too, rank 1 would
    silently train on other batches than rank 0)."""
    results = [r.unwrap() for r in run_workers(has_data_per_pass, 2, args=("ahead",), timeout=60)]
    for out in results:
        assert out["type"] == "CollectiveMismatchError", out
        assert "rank 1: has_data #" in out["message"], out["message"]
        assert "rank 0: all_reduce #" in out["message"], out["message"]


def test_a_dataset_whose_len_lies_is_an_error_not_a_silent_step() -> None:
    results = [r.unwrap() for r in run_workers(has_data_per_pass, 2, args=("lying",), timeout=60)]
    for out in results:
        assert out["type"] == "RuntimeError", out
        assert "yielded more than its len() of 3 batches" in out["message"], out["message"]


@pytest.mark.parametrize("where", ["dataset", "reduce"])
def test_an_error_outside_run_on_one_worker_reaches_the_other(where: str) -> None:
    """Worker 1's dataset raises, or its `strategy.reduce` refuses its value, where worker
    0 waits in the step's agreement or the reduction: worker 0 waited until its timeout
    (600 s by default), learning nothing (bug hunt, session 53); now it raises at once,
    naming worker 1's error."""
    outs = [r.unwrap() for r in run_workers(raised_outside_run, 2, args=(where,), timeout=45)]
    expected = "OSError: disk gone" if where == "dataset" else "ValueError"
    assert outs[1]["type"] == expected.split(":", maxsplit=1)[0], outs[1]
    assert outs[0]["type"] == "WorkerFailedError", outs[0]
    assert f"rank 1 (global replicas [1]) raised {expected}" in outs[0]["message"], outs[0]
