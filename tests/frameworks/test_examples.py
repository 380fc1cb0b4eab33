"""The other runnable examples: the converted DDP script and the torchrun launch."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from tests.frameworks.helpers import EXAMPLES, load_example


@pytest.mark.slow
def test_ddp_converted_trains_and_keeps_replicas_identical(torch_module: Any) -> None:
    threads = torch_module.get_num_threads()
    try:
        out = load_example("ddp_converted").main(["--replicas", "4", "--epochs", "5", "--quiet"])
    finally:
        torch_module.set_num_threads(threads)
    assert out["accuracy"] >= 0.95
    first, *others = out["replica_params"]
    for other in others:
        for a, b in zip(first, other, strict=True):
            assert torch_module.equal(a, b)
    assert "layers.1.running_mean" in out["state_dict"]  # keys as in the original module


@pytest.mark.multiprocess
@pytest.mark.slow
def test_multi_worker_example_under_torchrun(torch_module: Any) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLES / "multi_worker_training.py"),
        "--replicas",
        "2",
        "--epochs",
        "2",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("Number of devices: 4") == 1  # only the chief prints
    assert done.stdout.count("Epoch 2, Loss") == 1
