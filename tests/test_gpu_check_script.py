"""`scripts/gpu_check.sh` where there is no CUDA (as in CI): exit 2, saying why, in its log.

The script's real work (the GPU suites on real CUDA, `bench --cuda`, the GPU training
example) needs a GPU; CI has none, so what CI can check is the refusal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.torch
def test_without_cuda_it_exits_2_saying_so(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    log = tmp_path / "check.log"
    # No CUDA device, even on a machine that has one: the check must refuse, not run.
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(log)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.startswith(f"crossdevice GPU check: log {log}\n"), done.stdout
    message = "crossdevice GPU check: no CUDA to check (torch "
    assert message in done.stdout, done.stdout
    assert "torch.cuda.is_available() is False" in done.stdout
    assert message in log.read_text()  # the one log has it too
