"""`--trace` on the demo and the bench, `crossdevice trace merge|render`, CROSSDEVICE_TRACE."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from crossdevice._cli.main import main
from crossdevice._trace.recorder import WORKER_LANE


def _spans(path: Path) -> list[dict[str, object]]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]


def test_the_demo_traces_its_data_parallel_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "demo.json"
    argv = ["demo", "--numpy", "--replicas", "2", "--epochs", "3", "--no-progress"]
    assert main([*argv, "--trace", str(path)]) == 0
    assert f"trace written to {path}" in capsys.readouterr().out
    spans = _spans(path)
    assert {s["tid"] for s in spans} == {0, 1}
    assert {"compute", "wait"} <= {s["cat"] for s in spans}

    png = tmp_path / "demo.png"
    assert main(["trace", "render", str(path), str(png), "--steps", "3"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_bench_traces_its_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bench.json"
    argv = ["bench", "-b", "1K", "-e", "1K", "-n", "3", "-w", "1", "--ops", "sharded"]
    assert main([*argv, "--replicas", "2", "--bw-bytes", "1M", "--trace", str(path)]) == 0
    capsys.readouterr()
    assert {s["tid"] for s in _spans(path)} == {0, 1}


def _worker_file(path: Path, rank: int, ends: list[float]) -> None:
    events = [
        {
            "name": f"collective all_reduce #{seq}",
            "cat": "collective",
            "ph": "X",
            "ts": end - 5,
            "dur": 5,
            "pid": rank,
            "tid": WORKER_LANE,
            "args": {"seq": seq},
        }
        for seq, end in zip((3, 4), ends, strict=True)
    ]
    path.write_text(json.dumps({"otherData": {"rank": rank}, "traceEvents": events}))


def test_merge_aligns_the_workers_at_their_first_common_collective(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _worker_file(tmp_path / "w0.json", 0, [100.0, 200.0])
    _worker_file(tmp_path / "w1.json", 1, [1100.0, 1195.0])  # its clock is 1000 us ahead
    out = tmp_path / "merged.json"
    assert (
        main(["trace", "merge", str(out), str(tmp_path / "w0.json"), str(tmp_path / "w1.json")])
        == 0
    )
    assert "aligned at collective #3" in capsys.readouterr().out
    ends = {(s["pid"], s["args"]["seq"]): s["ts"] + s["dur"] for s in _spans(out)}  # type: ignore[index, operator]
    assert ends == {(0, 3): 100.0, (0, 4): 200.0, (1, 3): 100.0, (1, 4): 195.0}


def test_merge_refuses_what_is_not_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x.json").write_text("[1, 2]")
    assert main(["trace", "merge", str(tmp_path / "m.json"), str(tmp_path / "x.json")]) == 1
    assert "expected a trace-event JSON object" in capsys.readouterr().err


def test_crossdevice_trace_traces_the_whole_process(tmp_path: Path) -> None:
    path = tmp_path / "env.json"
    script = textwrap.dedent(
        """
        import numpy as np, crossdevice as cd
        strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
        for _ in range(3):
            strategy.run(lambda: cd.get_replica_context().all_reduce("sum", np.ones(2)))
        """
    )
    env = {**os.environ, "CROSSDEVICE_TRACE": str(path), "CROSSDEVICE_LOGICAL_CPUS": "2"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    data = json.loads(path.read_text())
    assert data["otherData"]["steps_recorded"] == 3
    assert {s["tid"] for s in _spans(path)} == {0, 1}
