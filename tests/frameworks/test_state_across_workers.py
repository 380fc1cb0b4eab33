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

So do the writes outside `strategy.run` since the last step to buffers and to the
optimizer's state (`outside_run.py`; a later multi-worker bug hunt: one worker that loaded,
cleared or edited its optimizer's state, or wrote a buffer, trained on silently), while
every worker writing them alike, and forwards that update a buffer on some replicas
only, train as plain torch does.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.frameworks.state_workers import BY_HAND, plain, train
from tests.multi_worker.harness import run_workers

pytestmark = [pytest.mark.multiprocess]

#: What the error says of the collective at the end of the data (`_StepSync.ended`).
_END = "the end of a pass over a distributed dataset"

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
    # The reduced gradients changed before the step on one worker (session 56): the
    # step went apart; the next pass fails, before another update.
    "clipped_on_one": (1, ("changes to the reduced gradients before the last step()",)),
    "grad_none_on_one": (1, ("1 changes to the reduced gradients",)),
    # Only the last step went apart: no next pass carries it, so the end of the data
    # compares it (every run completed; the last next() raises).
    "clipped_last_on_one": (4, (_END, "changes to the reduced gradients before the last")),
    "scheduler_last_on_chief": (4, (_END, "lr=0.03125", "lr=0.0625")),
    # Buffers and optimizer state written outside run on one worker; the
    # other worker's text says it wrote none.
    "optimizer_loaded_on_one": (2, ("SGD state changed outside run", "4 replaced/added")),
    "optimizer_cleared_on_one": (2, ("SGD state changed", "0 replaced/added, 4 removed")),
    "optimizer_edited_on_one": (2, ("SGD state changed", "0 removed, 4 in-place")),
    "buffer_on_one": (2, ("buffer '2.scale' written 1x outside run",)),
    "declared_buffer_on_one": (2, ("buffer '2.peak' written 1x outside run",)),
    # A plain attribute set on one worker (session 56: each worker's own objective).
    "attribute_on_one": (2, ("attribute '1.slope' set to 0.5 outside run",)),
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
        if case in BY_HAND:
            assert "0 writes outside run to buffers, optimizer state" in error, error
        assert len(out["rates"]) == at, out  # the runs before it completed


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("case", ["alike", "clipped_alike"])
def test_the_same_program_on_every_worker_trains_as_plain_torch(
    torch_module: Any, replicas: int, case: str
) -> None:
    torch = torch_module
    outs = [r.unwrap() for r in run_workers(train, 2, args=(case, replicas))]
    reference = plain(case)
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


@pytest.mark.parametrize("replicas", [1, 2])
def test_buffers_and_optimizer_state_written_alike_train_as_plain_torch(
    torch_module: Any, replicas: int
) -> None:
    """Every worker loads the optimizer's state of step 0 after step 1, halves its momentum
    and writes the buffers, while each
    replica's forward updates `peak` or not, as its slice has it: no error, plain torch's
    parameters and buffers."""
    torch = torch_module
    outs = [r.unwrap() for r in run_workers(train, 2, args=("alike_by_hand", replicas))]
    reference = plain("alike_by_hand", replicas)
    for out in outs:
        assert "params" in out, out
        got = out["params"] + out["buffers"]
        assert len(got) == len(reference)
        worst = max(float((a - b).abs().max()) for a, b in zip(got, reference, strict=True))
        assert worst <= 1e-12, worst
    assert outs[0]["rates"] == outs[1]["rates"]
    assert all(torch.equal(a, b) for a, b in zip(outs[0]["params"], outs[1]["params"], strict=True))


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_forward_on_one_worker_outside_run_sets_its_caches_alone(
    torch_module: Any, replicas: int
) -> None:
    """An evaluation on one worker between steps (eval, a forward, train again) sets the
    attributes a forward caches (`self.widest = ...`): not a setting, no error."""
    torch = torch_module
    outs = [r.unwrap() for r in run_workers(train, 2, args=("forward_on_one", replicas))]
    for out in outs:
        assert "params" in out, out
    assert all(torch.equal(a, b) for a, b in zip(outs[0]["params"], outs[1]["params"], strict=True))


def test_a_scaler_not_prepared_on_one_worker_fails_on_every_worker(torch_module: Any) -> None:
    """A GradScaler never given to `prepare`, used on one worker only (one replica each):
    its scaled gradient was summed with the other's unscaled one, silently (session 56's
    bug hunt). The pass carries the calls, so every worker fails at that pass, before
    anything is summed. (With several local replicas an unprepared scaler is refused.)"""
    del torch_module
    for out in (r.unwrap() for r in run_workers(train, 2, args=("scaler_on_one", 1))):
        error = out.get("error", "")
        assert error.startswith("CollectiveMismatchError"), out
        assert "1 calls in this run to a GradScaler not given to prepare" in error, error
        assert len(out["rates"]) == 1, out


def test_a_scaler_not_prepared_on_every_worker_trains_as_plain_torch(torch_module: Any) -> None:
    """The same unprepared GradScaler on every worker (one replica each) is fine: the
    workers' reduced gradients, and so their unscaling and inf checks, are alike."""
    torch = torch_module
    outs = [r.unwrap() for r in run_workers(train, 2, args=("scaler_alike", 1))]
    reference = plain("alike")  # a scale of 2**10 unscales exactly in float64
    for out in outs:
        assert "params" in out, out
        worst = max(
            float((a - b).abs().max()) for a, b in zip(out["params"], reference, strict=True)
        )
        assert worst <= 1e-12, worst
    assert all(torch.equal(a, b) for a, b in zip(outs[0]["params"], outs[1]["params"], strict=True))
