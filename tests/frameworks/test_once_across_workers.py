"""A call made once a step (a scheduler's) compares its numbers across workers too.

`ReduceLROnPlateau.step(metric)` runs on each worker alone; with each worker's own
metric the workers' learning rates, then their models, drifted apart silently (seen:
lr 0.00125 on one worker, 0.0025 on the other). Now every worker raises, naming the fix.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.frameworks.once_workers import plateau_training
from tests.multi_worker.harness import run_workers

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_per_worker_metric_is_an_error_on_every_worker(torch_module: Any, replicas: int) -> None:
    del torch_module
    outs = [r.unwrap() for r in run_workers(plateau_training, 2, args=(False, replicas))]
    for out in outs:
        assert "ReduceLROnPlateau.step runs once per step" in out.get("error", ""), out
        assert "reduce a per-replica metric first" in out["error"]


def test_an_agreed_metric_steps_the_scheduler_alike(torch_module: Any) -> None:
    del torch_module
    outs = [r.unwrap() for r in run_workers(plateau_training, 2, args=(True, 1))]
    assert "rates" in outs[0], outs
    assert outs[0] == outs[1]
