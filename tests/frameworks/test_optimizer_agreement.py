"""The replicas' optimizer steps agree, or it is an error; state edits reach every replica.

A replica that skips `step()` or `zero_grad()` under a condition of its own must fail
the run (naming it) rather than drift away from the others, with per-replica copies as
with shared storage; optimizer state changed between runs through the mirrored
optimizer (`opt.state` is replica 0's there) trains what plain torch trains.
"""

from __future__ import annotations

from typing import Any

import pytest

import crossdevice as cd
from tests.frameworks.helpers import (
    assert_trains_like,
    global_batches,
    global_loss,
    mirrored,
    mlp,
    replica_batch,
)
from tests.strategies.conftest import replica_execution

MODES = ["threads", "cooperative"]
SHARING = pytest.mark.parametrize("shared", [False, True], ids=["copies", "shared"])

pytestmark = pytest.mark.usefixtures("float64")


def _adam(torch: Any, cdt: Any, strategy: Any, shared: bool) -> tuple[Any, Any]:
    with strategy.scope():
        net = mlp(torch)
        return cdt.prepare(net, torch.optim.Adam(net.parameters(), lr=0.05), share_storage=shared)


def _replica() -> int:
    ctx = cd.get_replica_context()
    return 0 if ctx is None else ctx.replica_id_in_sync_group


SKIPPED = {
    "step": r"replicas \[1\] returned while replicas \[0\] wait in MirroredOptimizer.step",
    "zero_grad": r"zero_grad\(\) different numbers.*replica 0: 1, replica 1: 0",
    "model.zero_grad": r"zero_grad\(\) different numbers.*replica 0: 1, replica 1: 0",
}


@pytest.mark.parametrize("mode", MODES)
@SHARING
@pytest.mark.parametrize("skipped", sorted(SKIPPED))
def test_a_call_skipped_by_one_replica_is_an_error_naming_it(
    torch: Any, cdt: Any, mode: str, shared: bool, skipped: str
) -> None:
    x, y = replica_batch(torch)
    with replica_execution(mode):
        strategy = mirrored(2)
        model, optimizer = _adam(torch, cdt, strategy, shared)

        def step(skipper: int) -> None:
            # e.g. `if torch.isfinite(local_loss): opt.step()`
            zero_grad = model.zero_grad if skipped == "model.zero_grad" else optimizer.zero_grad
            if "zero_grad" not in skipped or _replica() != skipper:
                zero_grad()
            global_loss(torch, model, x, y).backward()
            if skipped != "step" or _replica() != skipper:
                optimizer.step()

        strategy.run(step, args=(-1,))
        with pytest.raises(RuntimeError, match=SKIPPED[skipped]):
            strategy.run(step, args=(1,))
        for a, b in zip(*(r.parameters() for r in model.replicas), strict=True):
            assert torch.equal(a, b)  # nobody stepped alone
        strategy.run(step, args=(-1,))  # usable again, no stale count from the failed run
    for a, b in zip(*(r.parameters() for r in model.replicas), strict=True):
        assert torch.equal(a, b)


EDITS = {
    "state.clear()": lambda torch, opt: opt.state.clear(),
    "exp_avg.zero_()": lambda torch, opt: [s["exp_avg"].zero_() for s in opt.state.values()],
    "state_dict tensor": lambda torch, opt: [
        s["exp_avg_sq"].mul_(4.0) for s in opt.state_dict()["state"].values()
    ],
    "replaced tensor": lambda torch, opt: [
        s.__setitem__("exp_avg", torch.ones_like(s["exp_avg"])) for s in opt.state.values()
    ],
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_state_changed_between_runs_reaches_every_replica(
    torch: Any, cdt: Any, mode: str, edit: str
) -> None:
    data = global_batches(torch, 4)
    plain = mlp(torch)
    start = [p.detach().clone() for p in plain.parameters()]
    reference = torch.optim.Adam(plain.parameters(), lr=0.05)
    with replica_execution(mode):
        strategy = mirrored(2)
        model, optimizer = _adam(torch, cdt, strategy, shared=False)

        def step(x: Any, y: Any) -> None:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()
            optimizer.step()

        for i, ((gx, gy), (x, y)) in enumerate(
            zip(data, strategy.experimental_distribute_dataset(data), strict=True)
        ):
            if i == 2:
                for opt in (reference, optimizer):
                    EDITS[edit](torch, opt)
            reference.zero_grad()
            global_loss(torch, plain, gx, gy).backward()
            reference.step()
            strategy.run(step, args=(x, y))
    assert_trains_like(torch, plain, model, start)


def test_state_loaded_or_read_between_runs_is_copied_only_when_changed(
    torch: Any, cdt: Any
) -> None:
    x, y = replica_batch(torch)
    strategy = mirrored(2)
    model, optimizer = _adam(torch, cdt, strategy, shared=False)

    def step() -> None:
        optimizer.zero_grad()
        global_loss(torch, model, x, y).backward()
        optimizer.step()

    strategy.run(step)
    others = [id(s) for s in optimizer.replicas[1].state.values()]
    _ = [s["exp_avg"].sum() for s in optimizer.state.values()]  # read only
    strategy.run(step)
    assert [id(s) for s in optimizer.replicas[1].state.values()] == others  # no copy
    optimizer.load_state_dict(optimizer.state_dict())
    loaded = [id(s) for s in optimizer.replicas[1].state.values()]
    strategy.run(step)
    assert [id(s) for s in optimizer.replicas[1].state.values()] == loaded  # no second copy
