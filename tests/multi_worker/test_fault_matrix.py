"""Fault matrix: 2 and 3 workers, 1 and 2 local replicas, every way workers disagree or fail.

In every cell every surviving rank must raise a clear error in time, naming the right
ranks; no process may abort and no result may be silently wrong. Cells share worker
processes where they can (all mismatch cells run in one process group per shape of the
cluster) to keep the matrix fast on a 2-core host.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pytest

from tests.multi_worker.fault_workers import (
    MISMATCH_CELLS,
    frozen_store_at_start,
    lost_worker,
    mismatches,
    replica_counts,
    uneven_shards,
)
from tests.multi_worker.harness import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

CONFIGS = [(2, 1), (2, 2), (3, 1), (3, 2)]
#: A lost worker is named after `dead_after_seconds` (5 s) of silence, plus up to one
#: `startup_probe_seconds` (1 s) at start-up, plus how far apart the workers' clocks
#: started (their imports, on a loaded 2-core machine: seconds); far below the hang
#: (the harness's 90 s) that the bound tells it from.
_CLEAR_WITHIN = 15.0

#: Every cell runs on both transports of a host all-reduce: Gloo (as across hosts) and
#: shared memory (workers of one host: the default here, for every size).
TRANSPORTS: dict[str, dict[str, str]] = {
    "gloo": {"CROSSDEVICE_SHARED_MEMORY": "0"},
    "shm": {},
}


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "shm" and not (sys.platform == "linux" and os.uname().machine == "x86_64"):
        pytest.skip("shared memory is used on x86-64 Linux only (other hosts keep to Gloo)")
    return str(request.param)


def _ids(world_size: int, local: int, rank: int) -> list[int]:
    return list(range(rank * local, (rank + 1) * local))


@pytest.mark.parametrize(("world_size", "local"), CONFIGS, ids=[f"{w}x{n}" for w, n in CONFIGS])
def test_mismatches_raise_on_every_rank(world_size: int, local: int, transport: str) -> None:
    results = run_workers(
        mismatches, world_size, args=(local,), timeout=120, env=TRANSPORTS[transport]
    )
    outs: list[dict[str, Any]] = [r.unwrap() for r in results]
    for rank, out in enumerate(outs):
        assert out["shared_memory"] == (transport == "shm")
        for cell in MISMATCH_CELLS:
            got = out[cell]
            assert got["type"] == "CollectiveMismatchError", (rank, cell, got)
            assert got["elapsed"] < _CLEAR_WITHIN, (rank, cell, got)
            message = got["message"]
            assert all(f"rank {r}:" in message for r in range(world_size)), message
            assert "differ" in message
            after = out[f"{cell}/after"]
            assert after["type"] is None, (rank, cell, after)
            assert after["value"] == [float(world_size * local)] * local
        culprit = world_size - 1
        if rank == culprit:
            assert out["raise"]["type"] == "ValueError"
            assert out["carry_on"]["type"] == "RuntimeError", out["carry_on"]
            assert "broken" in out["carry_on"]["message"]
        else:
            got = out["raise"]
            assert got["type"] == "WorkerFailedError", (rank, got)
            assert (
                f"rank {culprit} (global replicas {_ids(world_size, local, culprit)})"
                in (got["message"])
            )
            assert "raised ValueError: bad batch" in got["message"]  # its text too, on Gloo
            assert got["elapsed"] < _CLEAR_WITHIN
            assert out["carry_on"]["type"] == "RuntimeError"


@pytest.mark.parametrize("world_size", [2, 3])
def test_different_replica_counts_fail_at_construction(world_size: int) -> None:
    for result in run_workers(replica_counts, world_size, timeout=60):
        got = result.unwrap()
        assert got["type"] == "CollectiveMismatchError", got
        assert "same number of local replicas" in got["message"]


LOST = [
    # (world_size, local, culprit, how, timeout)
    (2, 1, 1, "kill", 30.0),
    (3, 2, 0, "kill", 30.0),  # rank 0 serves the store
    (2, 2, 1, "stall", 3.0),
    (3, 1, 1, "stall", 3.0),
    (2, 1, 0, "stall", None),  # the default timeout (shortened to 3 s in the worker)
    (3, 2, 2, "stall", None),
    (2, 1, 0, "freeze", 30.0),  # the store's server frozen: its reads never answer
    (3, 1, 1, "freeze", 30.0),  # its heartbeat stops, its connections stay open
]


@pytest.mark.parametrize(
    ("world_size", "local", "culprit", "how", "timeout"),
    LOST,
    ids=[f"{w}x{n}-rank{c}-{h}-timeout{t}" for w, n, c, h, t in LOST],
)
def test_lost_worker_is_named(
    world_size: int, local: int, culprit: int, how: str, timeout: float | None, transport: str
) -> None:
    survivors = [r for r in range(world_size) if r != culprit]
    # On shared memory, warm up so that the survivors wait in the predicted all-reduce's
    # shared round (the first all-reduces after a new one go through Gloo).
    warmups = 3 if transport == "shm" else 1
    results = run_workers(
        lost_worker,
        world_size,
        args=(local, culprit, how, timeout, warmups),
        timeout=90,
        required=survivors,
        env=TRANSPORTS[transport],
    )
    dies = how in ("kill", "freeze")
    bound = _CLEAR_WITHIN if dies else (timeout or 3.0) + 5.0
    for rank in survivors:
        got = results[rank].unwrap()
        expected = "WorkerFailedError" if dies else "CollectiveTimeoutError"
        assert got["type"] == expected, (rank, got)
        assert got["shared_rounds"] == (transport == "shm"), (rank, got)
        assert got["elapsed"] < bound, (rank, got)
        assert f"rank {culprit}" in got["message"] or f"rank(s) [{culprit}]" in got["message"]
        assert f"global replicas {_ids(world_size, local, culprit)}" in got["message"], got


@pytest.mark.parametrize("when", ["rendezvous", "first-groups", "groups"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_frozen_store_host_at_start_is_named(world_size: int, when: str) -> None:
    """Rank 0 freezes while torch starts the groups: inside torch, where a store client
    waits for a frozen server for ever; the others name it instead of waiting."""
    survivors = list(range(1, world_size))
    results = run_workers(
        frozen_store_at_start, world_size, args=(when,), timeout=90, required=survivors
    )
    for rank in survivors:
        got = results[rank].unwrap()
        assert got["type"] == "WorkerFailedError", (rank, got)
        assert "rank 0 serves the c10d store" in got["message"], got
        assert "stopped or frozen" in got["message"], got
        assert got["elapsed"] < _CLEAR_WITHIN, (rank, got)


@pytest.mark.parametrize("local", [1, 2])
def test_uneven_shards_end_at_the_same_step(local: int, transport: str) -> None:
    results = run_workers(uneven_shards, 2, args=(local,), timeout=90, env=TRANSPORTS[transport])
    outs = [r.unwrap() for r in results]
    # Worker 0 yields 5 batches, worker 1 only 3: both run 5 steps (TF's rule).
    expected = []
    for s in range(5):
        elements = [10.0 * s + e for e in range(local)]
        if s < 3:
            elements += [100.0 + 10.0 * s + e for e in range(local)]
        expected.append((sum(elements) / len(elements), float(len(elements))))
    for out in outs:
        assert len(out["from_function"]) == 5
        for got, want in zip(out["from_function"], expected, strict=True):
            assert got == pytest.approx(want)
    # experimental_distribute_dataset: worker 0 has 3 global batches, worker 1 two; the
    # third step is worker 0's share of its last batch only (worker 1 gets empties).
    n = 2 * local
    full = [float(np.mean(np.arange(n) + 10 * s)) for s in range(2)]
    last = float(np.mean(np.arange(local) + 20))
    for out in outs:
        assert out["dataset"] == pytest.approx([*full, last])
