"""Workers of one host all-reduce through shared memory (`_comm/workers/shared_memory.py`).

The results must be the in-order sums, bitwise equal on every worker, with the inputs
untouched and nothing left in /dev/shm; when any worker cannot share memory every worker
keeps to Gloo. The fault matrix (`test_fault_matrix.py`) runs every failure cell on both
transports.
"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from crossdevice._comm.workers import shared_memory as shm  # noqa: E402
from crossdevice._core import tuning  # noqa: E402
from tests.multi_worker import shm_workers  # noqa: E402
from tests.multi_worker.harness import run_workers  # noqa: E402
from tests.multi_worker.workers import value_of  # noqa: E402

on_x86_linux = pytest.mark.skipif(
    not (sys.platform == "linux" and os.uname().machine == "x86_64"),
    reason="shared memory is used on x86-64 Linux only (other hosts keep to Gloo)",
)


def test_rounds_cover_every_element_once_within_a_slot() -> None:
    layout = (
        (torch.float32, 3_200_000),
        (torch.int64, 1000),
        (torch.float64, 771),
        (torch.int32, 5 * shm.SLOT_BYTES // 4),
    )
    rounds = shm.plan_rounds(layout)
    covered = dict.fromkeys(range(len(layout)), 0)
    for spec in rounds:
        end = 0
        for index, start, stop, offset in spec:
            dtype = layout[index][0]
            assert offset % 64 == 0
            assert offset >= end
            end = offset + (stop - start) * dtype.itemsize
            assert end <= shm.SLOT_BYTES
            assert start == covered[index]  # in order, no gap, no overlap
            covered[index] = stop
    assert covered == {i: n for i, (_, n) in enumerate(layout)}
    assert len(rounds) == -(-sum(d.itemsize * n for d, n in layout) // shm.SLOT_BYTES)


def test_which_layouts_go_through_shared_memory() -> None:
    assert tuning.TUNING.shared_memory_min_bytes == 0  # every size by default
    assert shm.uses_shared_memory(((torch.float32, 1),), tuning.TUNING.shared_memory_min_bytes)
    assert shm.uses_shared_memory(((torch.float32, 256), (torch.int64, 1)), 1032)
    assert not shm.uses_shared_memory(((torch.float32, 256), (torch.int64, 1)), 1033)
    big = 1 << 20
    # Dtypes whose sums NumPy and Gloo might compute differently stay on Gloo.
    for dtype in (torch.float16, torch.bfloat16, torch.bool, torch.complex64, torch.uint8):
        assert not shm.uses_shared_memory(((torch.float32, big), (dtype, 8)), 0)


def test_min_bytes_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(shm.MIN_BYTES_ENV_VAR, raising=False)
    assert shm.min_bytes_from_env() == tuning.TUNING.shared_memory_min_bytes
    monkeypatch.setenv(shm.MIN_BYTES_ENV_VAR, "65536")
    assert shm.min_bytes_from_env() == 65536
    for bad in ("-1", "1e6", "lots"):
        monkeypatch.setenv(shm.MIN_BYTES_ENV_VAR, bad)
        with pytest.raises(ValueError, match="CROSSDEVICE_SHARED_MEMORY_MIN_BYTES must be"):
            shm.min_bytes_from_env()


def _in_order_sum(world_size: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    total = value_of(0, shape, dtype, seed=3)
    for r in range(1, world_size):
        total = total + value_of(r, shape, dtype, seed=3)
    return total


@on_x86_linux
@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_through_shared_memory_is_exact_and_leaves_nothing(world_size: int) -> None:
    outs = [r.unwrap() for r in run_workers(shm_workers.all_reduces, world_size, args=(None,))]
    expected = [_in_order_sum(world_size, s, d) for s, d in shm_workers.SHAPES]
    pids = {f"crossdevice-{out['pid']}-" for out in outs}
    for out in outs:
        assert out["shared"]
        # Unlinked once every worker mapped it (names of other runs' workers ignored).
        assert not [n for n in out["leftovers"] if any(n.startswith(p) for p in pids)]
        for kind in ("numpy", "torch"):
            assert out[f"{kind}/type"] == ("ndarray" if kind == "numpy" else "Tensor")
            assert out[f"{kind}/unchanged"]
            # Every call goes through two shared rounds, the first too (nothing predicted
            # yet: its headers are exchanged first); those are the in-order sums, bit for bit.
            for i in range(5):
                assert out[f"{kind}/sum/{i}/rounds"] == 2
                for got, want in zip(out[f"{kind}/sum/{i}"], expected, strict=True):
                    assert got.dtype == want.dtype
                    assert got.shape == want.shape
                    np.testing.assert_array_equal(got, want)
            for got, want in zip(out[f"{kind}/mean"], expected, strict=True):
                np.testing.assert_allclose(got, want / world_size, rtol=1e-6, atol=1e-6)
        # (The packs' layout may equal the all-reduces' before: then even the first
        # batch call is predicted.)
        for i in range(1, 4):
            assert out[f"batch/{i}/rounds"] == 2, out[f"batch/{i}/rounds"]
            for got, want in zip(out[f"batch/{i}"], expected, strict=True):
                np.testing.assert_array_equal(got, want)
        for got, want in zip(out["donated"], expected, strict=True):
            np.testing.assert_array_equal(got, want)
        assert out["kept_intact"]
    # Every worker holds the same bits.
    for other in outs[1:]:
        for key in ("numpy/sum/4", "torch/sum/4", "numpy/mean", "batch/3"):
            for a, b in zip(outs[0][key], other[key], strict=True):
                assert a.tobytes() == b.tobytes()


@pytest.mark.multiprocess
@pytest.mark.parametrize("disable_on", [0, 2])
def test_one_worker_without_shared_memory_keeps_every_worker_on_gloo(disable_on: int) -> None:
    outs = [r.unwrap() for r in run_workers(shm_workers.all_reduces, 3, args=(disable_on,))]
    expected = [_in_order_sum(3, s, d) for s, d in shm_workers.SHAPES]
    for out in outs:
        assert not out["shared"]
        assert not [n for n in out["leftovers"] if n.startswith(f"crossdevice-{out['pid']}-")]
        for key in ("numpy/sum/4", "batch/3"):
            for got, want in zip(out[key], expected, strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # Gloo's order


@on_x86_linux
@pytest.mark.multiprocess
def test_strategy_with_local_replicas_reduces_through_shared_memory() -> None:
    outs = [r.unwrap() for r in run_workers(shm_workers.strategy_reduces, 2, timeout=90)]
    for out in outs:
        assert out["shared"]
        assert out["rounds"] > 0
        for x in out["x"]:  # replicas 0..3 hold 1..4
            np.testing.assert_array_equal(x, np.full(300_000, 10.0, np.float32))
        for n in out["n"]:
            np.testing.assert_array_equal(n, 4 * np.arange(70_000, dtype=np.int64))
        np.testing.assert_array_equal(out["mean"], np.full(400_000, 1.5))


@on_x86_linux
@pytest.mark.multiprocess
@pytest.mark.parametrize("culprit", [0, 2])
def test_a_worker_leaving_midway_is_named_and_no_peer_returns(culprit: int) -> None:
    outs = [
        r.unwrap() for r in run_workers(shm_workers.leaves_midway, 3, args=(culprit,), timeout=90)
    ]
    for rank, out in enumerate(outs):
        assert out["rounds"] == 3
        kind, message = out["outcome"]
        if rank == culprit:
            assert (kind, message) == ("RuntimeError", "injected failure in round 2")
            assert out["after"][0] == "RuntimeError"
            assert "broken" in out["after"][1]
            continue
        # Never a sum that read the culprit's stale slots: an error naming it, quickly.
        assert kind == "WorkerFailedError", (rank, out["outcome"])
        assert f"rank {culprit}" in message
        assert "injected failure in round 2" in message
        assert out["elapsed"] < 10.0
        assert out["after"][0] == "RuntimeError"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("variable", "values", "expected", "own"),
    [
        (
            shm.MIN_BYTES_ENV_VAR,
            ["0", "1024"],
            "differs between the workers (rank 0: 0, rank 1: 1024)",
            "",
        ),
        (
            shm.MIN_BYTES_ENV_VAR,
            [None, "lots"],
            "invalid CROSSDEVICE_SHARED_MEMORY or CROSSDEVICE_SHARED_MEMORY_MIN_BYTES",
            "CROSSDEVICE_SHARED_MEMORY_MIN_BYTES must be a byte count",
        ),
        # A switch that is neither on nor off is an error on every worker, not "on".
        (
            shm.ENV_VAR,
            [None, "maybe"],
            "invalid CROSSDEVICE_SHARED_MEMORY or CROSSDEVICE_SHARED_MEMORY_MIN_BYTES",
            "CROSSDEVICE_SHARED_MEMORY must be 1 or 0",
        ),
    ],
    ids=["differ", "bad-min-bytes", "bad-switch"],
)
def test_workers_must_agree_on_the_settings(
    variable: str, values: list[str | None], expected: str, own: str
) -> None:
    outs = [
        r.unwrap() for r in run_workers(shm_workers.min_bytes_settings, 2, args=(values, variable))
    ]
    for rank, (kind, message) in enumerate(outs):
        assert kind == "ValueError", (rank, message)
        if values[rank] in ("lots", "maybe"):  # that rank reports its own value's error
            assert own in message, message
        else:
            assert expected in message, message


@on_x86_linux
def test_a_failing_futex_call_raises_instead_of_spinning() -> None:
    assert shm._futex_ok()
    word = ctypes.c_uint32(0)
    with pytest.raises(OSError, match="futex"):
        shm._futex(ctypes.addressof(word), 999, 0, None)  # no such operation
