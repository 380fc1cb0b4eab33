"""ProcessGroupCommunicator across 2 and 3 worker processes on 127.0.0.1.

Each test spawns the workers once and checks many results against NumPy references
built from the same inputs (`workers.value_of`), to keep the file fast.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from tests.multi_worker import workers
from tests.multi_worker.harness import WorkerResult, run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]

#: Timeout given to the communicators in the failure tests.
TIMEOUT = 2.0
#: The issue's bound: the others raise within timeout_seconds + 5 s.
BOUND = TIMEOUT + 5.0
#: A dead worker is named within this long, whatever the timeout (issue 15).
DEAD_BOUND = 10.0


def _values(results: list[WorkerResult]) -> list[dict[str, Any]]:
    return [r.unwrap() for r in results]


def _check(out: dict[str, Any], name: str, expected: np.ndarray, kind: str, **tol: Any) -> None:
    got_kind, got = out[name]
    assert got_kind == ("torch" if kind == "torch" else "ndarray"), name
    assert got.dtype == expected.dtype, (name, got.dtype, expected.dtype)
    assert got.shape == expected.shape, (name, got.shape, expected.shape)
    if np.issubdtype(expected.dtype, np.inexact):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6, err_msg=name, **tol)
    else:
        np.testing.assert_array_equal(got, expected, err_msg=name)


def _check_collectives(outs: list[dict[str, Any]], world: int) -> None:
    ranks = range(world)
    for rank, out in enumerate(outs):
        assert out["rank"] == rank
        assert out["world_size"] == world
        for kind in ("numpy", "torch"):
            specs = [((3, 4), "float32"), ((5,), "float64"), ((2, 2), "int32")]
            for i, (shape, dtype) in enumerate(specs):
                total = sum(workers.value_of(r, shape, dtype) for r in ranks).astype(dtype)
                _check(out, f"{kind}/sum/{i}", total, kind)
                # MEAN divides in the value's own library: integers become floating point
                if kind == "numpy":
                    mean_dtype = np.float64 if dtype == "int32" else dtype
                else:
                    mean_dtype = np.float32 if dtype == "int32" else dtype
                _check(out, f"{kind}/mean/{i}", (total / world).astype(mean_dtype), kind)
                _check(out, f"{kind}/mean_div/{i}", (total / (2 * world)).astype(mean_dtype), kind)
            assert out[f"{kind}/inputs_unchanged"]
            donated = sum(workers.value_of(r, (6,), "float32") for r in ranks)
            _check(out, f"{kind}/donated", donated, kind)
            gather0 = np.concatenate([workers.value_of(r, (r + 1, 3), "float32") for r in ranks])
            _check(out, f"{kind}/gather0", gather0, kind)
            gather1 = np.concatenate(
                [workers.value_of(r, (2, r + 2), "int64") for r in ranks], axis=1
            )
            _check(out, f"{kind}/gather1", gather1, kind)
            root_value = workers.value_of(world - 1, (2, 3), "float32")
            _check(out, f"{kind}/broadcast", root_value, kind)
            # a worker passing None gets NumPy back
            none_kind = kind if rank == world - 1 else "numpy"
            _check(out, f"{kind}/broadcast_none", root_value, none_kind)
            batch = [
                ((10,), "float32", 1),
                ((3,), "int64", 2),
                ((4, 4), "float32", 3),
                ((7,), "float64", 4),
                ((), "float32", 5),
            ]
            for i, (shape, dtype, seed) in enumerate(batch):
                total = sum(workers.value_of(r, shape, dtype, seed) for r in ranks).astype(dtype)
                mean_dtype = (
                    dtype if dtype != "int64" else ("float64" if kind == "numpy" else "float32")
                )
                for pack in (0, 32):
                    _check(out, f"{kind}/batch/sum/{pack}/{i}", total, kind)
                    mean = (total / world).astype(mean_dtype)
                    _check(out, f"{kind}/batch/mean/{pack}/{i}", mean, kind)
                mean = (total / (4 * world)).astype(mean_dtype)
                _check(out, f"{kind}/batch/mean_div/{i}", mean, kind)
            int16 = sum(workers.value_of(r, (4,), "int16").astype(np.int64) for r in ranks)
            _check(out, f"{kind}/odd/0", int16.astype(np.int16), kind)
            uint64 = np.zeros(3, np.uint64)
            for r in ranks:
                uint64 = uint64 + np.full(3, 2**63 + r, np.uint64)  # wraps like the sum
            _check(out, f"{kind}/odd/1", uint64, kind)
        assert out["mixed_kinds"] == ["ndarray", "Tensor", "ndarray"]
        message = out["gather_error"]
        assert message.startswith("all_gather #")
        for r in ranks:
            assert f"rank {r}: (2, {3 + r}) float32" in message
        assert out["gather_error"] == outs[0]["gather_error"]  # alike on every worker
        _check(out, "after_error", np.full(2, sum(ranks), np.int64), "numpy")
        assert out["sequence_number"] == outs[0]["sequence_number"] > 0
        assert out["closed"]


@pytest.mark.slow
def test_two_workers_torchrun_env() -> None:
    outs = _values(run_workers(workers.collectives, 2, launcher="torchrun"))
    _check_collectives(outs, 2)
    for rank, out in enumerate(outs):
        cluster = out["cluster"]
        assert (cluster.source, cluster.rank, cluster.local_rank) == ("torchrun", rank, rank)


@pytest.mark.slow
def test_three_workers_tf_config_with_chief() -> None:
    outs = _values(run_workers(workers.collectives, 3, launcher="tf_config", chief=True))
    _check_collectives(outs, 3)
    kinds = [(o["cluster"].task_type, o["cluster"].task_id, o["cluster"].rank) for o in outs]
    assert kinds == [("chief", 0, 0), ("worker", 0, 1), ("worker", 1, 2)]
    assert outs[0]["cluster"].is_chief
    assert not outs[1]["cluster"].is_chief


@pytest.mark.slow
def test_join_existing_group_and_misuse() -> None:
    outs = _values(run_workers(workers.join_existing, 2))
    for out in outs:
        assert out["wrong_cluster"].startswith("ValueError: the cluster makes this worker rank")
        assert out["cluster_when_joined"] is None
        a, b, seq_a, seq_b = out["interleaved"]
        np.testing.assert_array_equal(a, np.full(3, 3))
        np.testing.assert_array_equal(b, np.full(3, 30))
        assert (seq_a, seq_b) == (1, 1)
        assert out["divisor_with_sum"].startswith("ValueError: divisor applies to ReduceOp.MEAN")
        assert out["divisor_zero"].startswith("ValueError: divisor must be a positive number")
        assert out["single_array"].startswith("TypeError: all_reduce takes a list")
        assert out["bad_op"].startswith("ValueError: unknown reduce op 'max'")
        assert out["bad_dtype"].startswith("TypeError: cannot communicate a NumPy array")
        assert out["bad_torch_dtype"].startswith(
            "TypeError: cannot communicate values of dtype float8_e4m3fn"
        )
        assert out["seq_after_local_errors"] == 1  # local errors number no collective
        assert "received different roots [0, 1]" in out["roots_differ"]
        assert "received no value on root 0" in out["root_none"]
        assert "root 2, out of range for 2 workers" in out["root_out_of_range"]
        assert (
            "differ from root's (rank 0: (2,) float32, rank 1: (3,) float32)" in out["bcast_shape"]
        )
        assert (
            "different ranks or dtypes (rank 0: (2,) float64, rank 1: (2, 2) float64)"
            in out["gather_rank"]
        )
        assert "rank 0: (2,) float64, rank 1: (2,) float32" in out["gather_dtype"]
        assert "different axes [0, 1]" in out["gather_axis"]
        assert "axis 0, out of range for arrays of rank 0" in out["gather_scalar"]
        for key in ("roots_differ", "root_none", "bcast_shape", "gather_rank", "gather_axis"):
            assert out[key].startswith("ValueError: ")
            assert out[key] == outs[0][key]
        np.testing.assert_array_equal(out["still_works"], np.full(2, 1))
        assert out["after_close"].startswith(
            "RuntimeError: barrier: this ProcessGroupCommunicator is closed"
        )
        np.testing.assert_array_equal(out["second_still_works"], np.full(2, 1))
        assert out["default_group_kept"]  # a joined group belongs to the program


def _failure(results: list[WorkerResult], culprit: int) -> list[dict[str, Any]]:
    return [r.unwrap() for r in results if r.rank != culprit]


@pytest.mark.slow
def test_stalled_worker_is_named_within_timeout() -> None:
    results = run_workers(
        workers.stall_or_die, 3, args=(1, "stall", TIMEOUT), required=[0, 2], timeout=40
    )
    for out in _failure(results, culprit=1):
        assert out["type"] == "CollectiveTimeoutError", out
        assert out["message"].startswith("all_reduce #2 on rank "), out["message"]
        assert "timed out after 2 s: rank(s) [1] did not arrive" in out["message"]
        assert "timeout_seconds" in out["message"]  # how to change it
        assert TIMEOUT - 0.1 <= out["elapsed"] <= BOUND, out["elapsed"]
        assert "collectives are broken (all_reduce #2 failed)" in out["after"]


@pytest.mark.slow
def test_killed_worker_is_named_within_timeout() -> None:
    results = run_workers(
        workers.stall_or_die, 3, args=(2, "kill", TIMEOUT), required=[0, 1], timeout=40
    )
    assert results[2].exitcode == -9
    for out in _failure(results, culprit=2):
        # A dead worker is named within seconds, whatever the timeout says.
        assert out["type"] == "WorkerFailedError", out
        assert re.match(r"all_reduce #2 on rank \d of 3: a peer failed: rank 2 ", out["message"])
        assert "stopped sending heartbeats" in out["message"]
        assert out["elapsed"] <= DEAD_BOUND, out["elapsed"]


@pytest.mark.slow
def test_killed_store_host_fails_the_others_within_timeout() -> None:
    results = run_workers(
        workers.stall_or_die, 2, args=(0, "kill", TIMEOUT), required=[1], timeout=40
    )
    (out,) = _failure(results, culprit=0)
    assert out["type"] == "WorkerFailedError", out
    assert out["message"].startswith("all_reduce #2 on rank 1 of 2: a peer failed: rank 0 ")
    assert "c10d store" in out["message"]
    assert out["elapsed"] <= DEAD_BOUND, out["elapsed"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize(("world", "implementation"), [(1, "AUTO"), (2, "RING"), (2, "AUTO")])
def test_cuda_tensors(torch_module: Any, world: int, implementation: str) -> None:
    if not torch_module.cuda.is_available():
        pytest.skip("needs CUDA")
    outs = _values(run_workers(workers.cuda_collectives, world, args=(implementation,)))
    total = sum(range(1, world + 1))
    for out in outs:
        assert {device for device, _ in out.values()} == {"cuda"}
        np.testing.assert_allclose(out["sum"][1], np.full(4, total, np.float32))
        np.testing.assert_allclose(out["mean"][1], np.full(2, total / world))
        gather = np.concatenate([np.full(r + 1, r + 1.0) for r in range(world)])
        np.testing.assert_allclose(out["gather"][1], gather)
        np.testing.assert_allclose(out["broadcast"][1], np.full(4, float(world)))
