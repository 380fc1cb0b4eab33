"""`examples/preemption.py` under torchrun: preempted, killed, restarted, bitwise the same.

Two workers train one epoch. In one job, worker 1 sends itself SIGTERM after step 7:
both workers save the same step (the next one at which the workers agree, within
`AGREE_SECONDS`) and exit with the restart code, and a relaunch resumes there.
In another, worker 1 dies by SIGKILL after step 7 under `--max-restarts 1`: torchrun
restarts the job, which resumes from the periodic checkpoint of step 5 on its own. Both
end with the parameters of the uninterrupted job, bit for bit.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.frameworks.helpers import EXAMPLES
from tests.multi_worker.harness import torchrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.torch]

TIMEOUT = 240


def _torchrun(directory: Path, *extra: str, restarts: int = 0) -> subprocess.CompletedProcess[str]:
    command = torchrun(
        str(EXAMPLES / "preemption.py"),
        "--checkpoint-dir",
        str(directory),
        "--epochs",
        "1",
        "--batch-size",
        "128",
        "--checkpoint-every",
        "5",
        *extra,
        max_restarts=restarts,
    )
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, check=False)


def _digest(done: subprocess.CompletedProcess[str]) -> str:
    found = re.findall(r"finished 15 steps; parameters ([0-9a-f]{64})", done.stdout)
    assert len(found) == 1, done.stdout + done.stderr
    return found[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    done = _torchrun(tmp_path_factory.mktemp("uninterrupted"))
    assert done.returncode == 0, done.stdout + done.stderr
    return _digest(done)


def test_sigterm_to_one_worker_saves_the_same_step_on_both(
    torch_module: object, tmp_path: Path, uninterrupted: str
) -> None:
    preempt = ("--preempt-worker", "1", "--preempt-at-step", "7", "--preempt-signal", "TERM")
    done = _torchrun(tmp_path, *preempt)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output  # no restarts allowed: torchrun reports the failure
    saved = re.findall(r"termination notice; saved (\S+) at step (\d+); exiting", output)
    assert len(saved) == 2, output  # both workers
    assert saved[0] == saved[1], output  # the same checkpoint, the same step
    path, step = saved[0]
    assert Path(path).parent == tmp_path
    # After the step the signal came in, at the workers' next agreement (at the latest
    # when the loop ends, in watch_preemption_scope).
    assert 8 <= int(step) <= 15, output
    assert output.count("exitcode  : 42") >= 1, output
    again = _torchrun(tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    epoch = 1 if step == "15" else 0  # saved at the end of the loop: the epoch was over
    assert again.stdout.count(f"resumed at epoch {epoch}, step {step}") == 2
    assert _digest(again) == uninterrupted


def test_a_killed_worker_restarts_the_job_from_the_last_checkpoint(
    torch_module: object, tmp_path: Path, uninterrupted: str
) -> None:
    kill = ("--preempt-worker", "1", "--preempt-at-step", "7", "--preempt-signal", "KILL")
    done = _torchrun(tmp_path, *kill, restarts=1)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "exitcode: -9" in output or "exitcode  : -9" in output, output
    assert done.stdout.count("resumed at epoch 0, step 5") == 2, output
    assert _digest(done) == uninterrupted
