"""The training example under MultiWorkerMirroredStrategy: 2 workers x 2 replicas."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.frameworks.helpers import load_example
from tests.frameworks.workers import train_example
from tests.multi_worker.harness import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_example_on_two_workers_matches_a_single_replica_run(torch_module: Any) -> None:
    argv = ["--strategy", "multi_worker", "--replicas", "2", "--quiet", "--dtype", "float64"]
    results = [r.unwrap() for r in run_workers(train_example, 2, args=(argv,), timeout=240)]
    # The same global batches (4 x 16) on one replica.
    dtype = torch_module.get_default_dtype()
    try:
        reference = load_example("custom_training_loop").main(
            [
                "--strategy",
                "one_device",
                "--batch-size-per-replica",
                "64",
                "--quiet",
                "--dtype",
                "float64",
            ]
        )
    finally:
        torch_module.set_default_dtype(dtype)
    for result in results:
        assert result["steps"] >= 100
        assert result["test_accuracy"] >= 0.95
        difference = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(result["params"], reference["params"], strict=True)
        )
        assert difference <= 1e-5
        for replica in result["replica_params"]:
            for a, b in zip(replica, results[0]["params"], strict=True):
                np.testing.assert_array_equal(a, b)  # every replica of every worker
