"""Kill a training job with SIGKILL after a checkpoint; the resumed job ends bitwise equal.

Each case runs `tests.train.resume_script` three times: uninterrupted; saving after step
4 (mid-epoch: the data position, the random state and BatchNorm statistics all matter)
and killed with SIGKILL after step 7; and again on the same directory, which restores
step 4 and trains to the end. The last parameters must equal the uninterrupted run's,
bit for bit.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.train.resume_script", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen[str]) -> tuple[int, str]:
    out, err = process.communicate(timeout=TIMEOUT)
    return process.returncode, out + err


def _digest(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("parameters ")]
    assert len(lines) == 1, output
    return lines[0].split()[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "mode"),
    [
        pytest.param("cnn", "threads", marks=pytest.mark.torch),
        pytest.param("cnn", "cooperative", marks=pytest.mark.torch),
        ("numpy", "threads"),
    ],
)
def test_kill_and_resume_is_bitwise_the_uninterrupted_run(
    tmp_path: Path, model: str, mode: str, request: pytest.FixtureRequest
) -> None:
    if model == "cnn":
        request.getfixturevalue("torch_module")
    # The uninterrupted run and the one that gets killed run side by side.
    uninterrupted = _start(model, mode, str(tmp_path / "unused"))
    killed = _start(model, mode, str(tmp_path / "run"), "--save-at", "4", "--kill-at", "7")
    code, output = _finish(killed)
    assert code == -signal.SIGKILL, output
    assert "parameters" not in output
    code, reference = _finish(uninterrupted)
    assert code == 0, reference
    code, resumed = _finish(_start(model, mode, str(tmp_path / "run")))
    assert code == 0, resumed
    assert "resumed at epoch 0, step 4" in resumed
    assert _digest(resumed) == _digest(reference)
