"""Workers whose optimizer settings or gradient clearing went apart fail at the next pass.

A scheduler stepped on the chief only, a learning rate set by hand on one worker, a
`zero_grad()` skipped or added on one worker: each worker stepped its own optimizer with
the summed gradients, so the programs went apart silently (the bug hunt of session 52);
so did parameters loaded or edited on one worker outside the step, and one worker's
model in eval mode (session 54).
Now each backward pass's gradients carry the pass's optimizer settings and `zero_grad()`
count (`crossdevice/_frameworks/torch/step_state.py`), compared across workers with the
call: every worker raises `CollectiveMismatchError`, showing each worker's values, before
any worker used the sum. The same program on every worker (a scheduler on each, gradient
accumulation) trains as plain torch does on the global batches.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.frameworks.state_workers import plain, train
from tests.multi_worker.harness import run_workers

pytestmark = [pytest.mark.multiprocess]

#: The pass at which each case's workers first differ, and what the messages show there.
FAILS = {
    "chief_scheduler": (1, ("lr=0.25", "lr=0.5")),
    "lr_by_hand": (2, ("lr=0.125", "lr=0.3")),
    "numpy_lr": (2, ("lr=0.2", "lr=0.3")),  # NumPy floats: compared by value too
    "skipped_zero_grad": (3, ("zero_grad() 1x", "zero_grad() 0x")),
    "cleared_accumulation": (2, ("zero_grad() 1x", "zero_grad() 2x")),
    # Parameters changed outside the step on one worker, or its model in eval mode (the
    # bug hunt of session 54: the workers trained on apart).
    "loaded_on_chief": (2, ("0 parameter writes", "parameter writes since step()")),
    "edited_in_place": (2, ("0 parameter writes", "1 parameter writes")),
    "eval_on_one": (2, ("modules in eval mode",)),
    "frozen_on_one": (2, ("1 parameters frozen",)),
}


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("case", sorted(FAILS))
def test_settings_that_went_apart_fail_on_every_worker(
    torch_module: Any, case: str, replicas: int
) -> None:
    del torch_module
    outs = [r.unwrap() for r in run_workers(train, 2, args=(case, replicas))]
    at, shown = FAILS[case]
    for out in outs:
        error = out.get("error", "")
        assert error.startswith("CollectiveMismatchError"), out
        # (a parameter frozen on one worker cuts other buckets too: other fields differ)
        assert re.search(r"fields that differ: [a-z, ]*\bstate\b", error), error
        for text in shown:
            assert text in error, error
        assert len(out["rates"]) == at, out  # the runs before it completed


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_same_program_on_every_worker_trains_as_plain_torch(
    torch_module: Any, replicas: int
) -> None:
    torch = torch_module
    outs = [r.unwrap() for r in run_workers(train, 2, args=("alike", replicas))]
    reference = plain("alike")
    for out in outs:
        assert "params" in out, out
        assert out["rates"] == [0.25, 0.125, 0.0625, 0.03125]
        worst = max(
            float((a - b).abs().max()) for a, b in zip(out["params"], reference, strict=True)
        )
        assert worst <= 1e-12, worst
        # The rate changes every step and the state with it, but not the call's layout:
        # the workers still predict it (with the state in the predictor's history: 0).
        assert out["guesses"] >= 2, out["guesses"]
    assert all(torch.equal(a, b) for a, b in zip(outs[0]["params"], outs[1]["params"], strict=True))
