"""The recorder's bound, its ring of steps, and the trace-event JSON it writes."""

from __future__ import annotations

import json
from pathlib import Path

from crossdevice._trace.recorder import DEFAULT_MAX_BYTES, WORKER_LANE, Recorder


def _drive(recorder: Recorder, steps: int, replicas: int = 4) -> None:
    """`steps` steps of `replicas` replicas, each: compute, one all-reduce, compute."""
    t = 0.0
    for _ in range(steps):
        recorder.step(t)
        for r in range(replicas):
            recorder.add(r, "step", t, t + 1e-3)
            recorder.add(
                r, "wait", t + 2e-4, t + 5e-4, ("all_reduce", 1, {"site": "x.py:1 (f)" * 40})
            )
        recorder.add(WORKER_LANE, "collective", t + 3e-4, t + 5e-4, ("all_reduce", 7, {"bytes": 4}))
        t += 1e-3


def test_the_file_stays_under_the_bound_over_100000_steps(tmp_path: Path) -> None:
    recorder = Recorder(steps=100_000)  # the byte bound, not the step count, must hold
    _drive(recorder, 100_000)
    assert len(recorder.events) == recorder.max_events  # full: old events were dropped
    path = tmp_path / "trace.json"
    size = recorder.write(str(path), 0.0, 0, "test", {"rank": 0})
    assert size == path.stat().st_size
    assert size <= DEFAULT_MAX_BYTES
    data = json.loads(path.read_text())
    names = {e["name"] for e in data["traceEvents"]}
    assert {"wait all_reduce #1", "compute", "collective all_reduce #7"} <= names


def test_a_small_bound_holds_too_and_keeps_the_latest_steps(tmp_path: Path) -> None:
    recorder = Recorder(steps=50, max_bytes=1 << 17)
    _drive(recorder, 5_000)
    size = recorder.write(str(tmp_path / "t.json"), 0.0, 0, "test", {})
    assert size <= 1 << 17
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    latest = max(e["ts"] for e in events if "ts" in e)
    assert latest >= 4_999 * 1e3  # the last step's events are there (in us)


def test_the_ring_keeps_the_last_n_steps() -> None:
    recorder = Recorder(steps=3)
    _drive(recorder, 10, replicas=1)
    kept = recorder.kept()
    assert sum(1 for e in kept if e[0] == "S") == 3
    assert min(e[3] for e in kept) >= 7e-3 - 1e-12


def test_compute_fills_the_gaps_between_a_replicas_collectives(tmp_path: Path) -> None:
    recorder = Recorder()
    recorder.step(0.0)
    recorder.add(0, "step", 0.0, 10e-3)
    recorder.add(0, "wait", 2e-3, 5e-3, ("all_reduce", 0, None))
    recorder.add(0, "reduce", 7e-3, 8e-3, ("all_reduce", 1, None))
    recorder.write(str(tmp_path / "t.json"), 0.0, 0, "test", {})
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    compute = sorted((e["ts"], e["dur"]) for e in events if e["name"] == "compute")
    assert compute == [(0.0, 2000.0), (5000.0, 2000.0), (8000.0, 2000.0)]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert lanes == {"replica 0"}
