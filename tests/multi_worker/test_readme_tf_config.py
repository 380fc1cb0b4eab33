"""The README's TF_CONFIG launch is the same job as its torchrun launch: 2 workers x 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multi_worker.harness import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

README = Path(__file__).resolve().parents[2] / "README.md"


def _tf_config_launch() -> str:
    text = README.read_text()
    match = re.search(r"\nfor i in 0 1; do\n.*?\ndone; wait\n", text, re.DOTALL)
    assert match is not None, "the README has no TF_CONFIG launch loop"
    return match.group(0)


def test_readme_tf_config_launch_runs_four_replicas() -> None:
    script = _tf_config_launch()
    assert "crossdevice demo --multi-worker --replicas 2" in script
    # The README's ports may be taken on a test machine; the job is otherwise verbatim.
    script = script.replace("12345", str(free_port())).replace("12346", str(free_port()))
    script = script.replace(
        "crossdevice demo --multi-worker --replicas 2",
        # The default epochs: the torch demo needs them for its 0.95 accuracy bar.
        "crossdevice demo --multi-worker --replicas 2 --no-progress",
    )
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(
        ["bash", "-c", "set -e\n" + script],
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MultiWorkerMirroredStrategy: 2 workers x 2 replicas" in out.stdout
    assert "parameters match" in out.stdout
    assert out.stdout.count("demo: OK") == 1  # only the chief reports
