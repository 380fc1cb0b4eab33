"""Tracing across worker processes: per-worker files that merge, the straggler line, reports."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

from crossdevice._trace.merge import merge
from crossdevice._trace.recorder import WORKER_LANE
from tests.multi_worker.harness import run_workers
from tests.multi_worker.trace_workers import stall_or_mismatch, traced_guesses, traced_steps

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

K = 8
DELAY = 0.02


def test_a_2x2_trace_has_every_replica_and_merges(tmp_path: Path) -> None:
    path = str(tmp_path / "trace.json")
    results = run_workers(traced_steps, 2, args=(2, -1, 0.0, 6, K, path), timeout=90)
    files = [results[r].unwrap()["written"][0] for r in (0, 1)]
    assert files == [str(tmp_path / "trace.worker0.json"), str(tmp_path / "trace.worker1.json")]
    for rank, file in enumerate(files):
        data = json.loads(Path(file).read_text())
        assert data["otherData"]["rank"] == rank
        spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
        assert {e["tid"] for e in spans} == {0, 1, WORKER_LANE}  # both replicas, the collectives
        collectives = [e for e in spans if e["tid"] == WORKER_LANE]
        assert len({e["args"]["seq"] for e in collectives}) >= 6  # one a step at least
        assert all(e["args"]["bytes"] > 0 and e["args"]["site"] for e in collectives), collectives
    done = merge(files, str(tmp_path / "merged.json"))
    assert done["aligned_at"] is not None
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert {(e["pid"], e["tid"]) for e in merged["traceEvents"] if e["ph"] == "X"} == {
        (p, t) for p in (0, 1) for t in (0, 1, WORKER_LANE)
    }
    # Aligned: the first common collective ends at the same time in both lanes.
    ends = {
        e["pid"]: e["ts"] + e["dur"]
        for e in merged["traceEvents"]
        if e["ph"] == "X" and e["tid"] == WORKER_LANE and e["args"]["seq"] == done["aligned_at"]
    }
    assert ends[0] == pytest.approx(ends[1], abs=1.0)


@pytest.mark.parametrize("shared_memory", ["0", "1"], ids=["gloo", "shm"])
def test_a_trace_says_which_collectives_layout_was_guessed_wrong(
    tmp_path: Path, shared_memory: str
) -> None:
    """A repeated all-reduce is predicted ("right"); the first of another size is
    guessed as the one before ("wrong": zeros of the guess went first); the next is
    not predicted (a context never seen), the third is again."""
    env = {"CROSSDEVICE_SHARED_MEMORY": shared_memory}
    path = str(tmp_path / "guess.json")
    results = run_workers(traced_guesses, 2, args=(path,), timeout=90, env=env)
    for result in results:
        spans = sorted(result.unwrap())
        assert [n for _, n, _ in spans] == [32] * 6 + [64] * 3, spans
        guesses = [guess for _, _, guess in spans]
        assert guesses[2:6] == ["right"] * 4, spans  # 8 floats again and again
        assert guesses[6:] == ["wrong", "", "right"], spans


def test_a_slow_worker_is_named_within_2k_steps(tmp_path: Path) -> None:
    path = str(tmp_path / "slow.json")
    results = run_workers(traced_steps, 2, args=(1, 1, DELAY, 2 * K, K, path), timeout=90)
    out = results[0].unwrap()
    named = [(step, line) for step, line in out["lines"] if "worker 1 (workers)" in line]
    assert named, out["lines"]
    assert named[0][0] <= 2 * K
    median = float(re.search(r"median ([\d.]+) ms", named[0][1]).group(1))  # type: ignore[union-attr]
    assert median >= 0.5 * DELAY * 1e3
    # Worker 0's collectives last as long as worker 1 keeps it waiting.
    data = json.loads(Path(out["written"][0]).read_text())
    spans = [e["dur"] for e in data["traceEvents"] if e["ph"] == "X" and e["tid"] == WORKER_LANE]
    assert statistics.median(spans) >= 0.5 * DELAY * 1e6


def _check_report(out: dict[str, Any], culprit: str) -> None:
    report = out["report"]
    assert "missing" not in report, report
    assert culprit in report["error"]["message"]
    assert report["groups"][0]["failed"], report["groups"][0]
    worker = report["groups"][0]
    assert worker["name"].startswith("worker rank 0 of 2")
    assert len(worker["collectives"]) >= 4  # the good steps' collectives and the failed one
    assert worker["collectives"][-1]["ended_seconds_ago"] is None  # the one that failed
    assert any(g["name"] == "MultiWorkerMirroredStrategy" for g in report["groups"])
    assert any("stall_or_mismatch" in line for t in report["threads"] for line in t["stack"])
    assert culprit in report["text"]


def test_a_stalled_worker_is_named_in_a_report() -> None:
    results = run_workers(stall_or_mismatch, 2, args=("stall",), timeout=90, required=[0])
    out = results[0].unwrap()
    assert out["type"] == "CollectiveTimeoutError", out
    _check_report(out, "rank(s) [1]")


def test_a_mismatched_worker_is_named_in_a_report() -> None:
    results = run_workers(stall_or_mismatch, 2, args=("mismatch",), timeout=90)
    out = results[0].unwrap()
    assert out["type"] == "CollectiveMismatchError", out
    _check_report(out, "rank 1: all_reduce")
    assert results[1].unwrap()["report"]["error"]["type"] == "CollectiveMismatchError"
