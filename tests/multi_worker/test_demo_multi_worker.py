"""`crossdevice demo --multi-worker` (the torch CNN) under torchrun: 2 workers x 2 replicas."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_demo_under_torchrun_matches_single_replica() -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "crossdevice",
        "demo",
        "--multi-worker",
        "--replicas",
        "2",
        "--no-progress",
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=420, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MultiWorkerMirroredStrategy: 2 workers x 2 replicas" in out.stdout
    assert "parameters match" in out.stdout
    assert out.stdout.count("demo: OK") == 1  # only the chief reports
