"""`crossdevice bench --multi-worker` under torchrun: the table and correct results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_bench_across_two_workers(tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "crossdevice",
        "bench",
        "--multi-worker",
        "-b",
        "64K",
        "-e",
        "1M",
        "-n",
        "3",
        "-w",
        "1",
        "--json",
        str(out_json),
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 workers, 1 replica each" in out.stdout
    # Both workers share this host: the strategy's row goes through shared memory (on
    # x86-64 Linux), `strategy-gloo` through Gloo.
    if sys.platform == "linux" and os.uname().machine == "x86_64":
        assert "`strategy` all-reduces through shared memory" in out.stdout
    rows = json.loads(out_json.read_text())["rows"]
    assert {r["impl"] for r in rows} == {"torch", "torch+copy", "comm", "strategy", "strategy-gloo"}
    assert {r["size"] for r in rows} == {64 * 1024, 256 * 1024, 1024 * 1024}
    assert all(r["wrong"] == 0 and r["algbw"] > 0 for r in rows)
    for row in rows:  # nccl-tests' all-reduce bus bandwidth factor 2(n-1)/n with n = 2
        assert row["busbw"] == pytest.approx(row["algbw"])
