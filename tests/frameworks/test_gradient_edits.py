"""Changes to the all-reduced gradients before the step: every replica alike, or an error.

Clipping (or any change to `.grad`) on some replicas only, between backward and
`step()`, made each replica with a copy of the model step with its own gradients: the
replicas went apart silently (0.25 after 3 steps; the bug hunt of session 56). Each
replica now counts its changes since the reduction and the replicas compare them at the
step (`crossdevice/_frameworks/torch/gradient_edits.py`); counts that differ with
gradients that differ are an error. The same changes on every replica, and changes that
replica 0 makes once for all (`call_once`) and the others copy, train as plain torch.
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
    run_on_replicas,
    train_plain,
)
from tests.strategies.conftest import replica_execution

pytestmark = pytest.mark.usefixtures("float64")

MODES = ["threads", "cooperative"]


def _edit(torch: Any, model: Any, how: str) -> None:
    if how == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    elif how == "mul":
        model[0].weight.grad.mul_(0.5)
    elif how == "twice":  # two writes: replicas that copy the result write once
        model[0].weight.grad.mul_(0.5).add_(0.01)
    else:
        assert how == "none"
        model[0].bias.grad = None


def _step(torch: Any, how: str, on: str) -> Any:
    def step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        optimizer.zero_grad()
        global_loss(torch, model, x, y).backward()
        ctx = cd.get_replica_context()
        if on == "once" and ctx is not None:  # every replica calls it; it runs once
            cd.torch.call_once(lambda: _edit(torch, model, how))
        elif on != "first" or ctx is None or ctx.replica_id_in_sync_group == 0:
            _edit(torch, model, how)
        optimizer.step()

    return step


def _train(torch: Any, cdt: Any, how: str, on: str, mode: str, replicas: int) -> Any:
    data = global_batches(torch, 3)
    step = _step(torch, how, on)
    plain = mlp(torch)
    start = train_plain(torch, plain, torch.optim.SGD(plain.parameters(), lr=0.5), data, step)
    with replica_execution(mode):
        strategy = mirrored(replicas)
        with strategy.scope():
            net = mlp(torch)
            sgd = torch.optim.SGD(net.parameters(), lr=0.5)
            model, optimizer = cdt.prepare(net, sgd, share_storage=False)
        run_on_replicas(strategy, lambda x, y, i: step(model, optimizer, x, y, i), data)
    return plain, model, start


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("how", ["clip", "mul", "none"])
def test_a_change_on_one_replica_only_is_an_error(
    torch: Any, cdt: Any, how: str, replicas: int, mode: str
) -> None:
    with pytest.raises(RuntimeError, match="changed their all-reduced gradients differently"):
        _train(torch, cdt, how, "first", mode, replicas)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["clip", "mul", "twice", "none"])
@pytest.mark.parametrize("on", ["all", "once"])
def test_the_same_change_on_every_replica_trains_like_plain_torch(
    torch: Any, cdt: Any, how: str, on: str, mode: str
) -> None:
    plain, model, start = _train(torch, cdt, how, on, mode, 2)
    assert_trains_like(torch, plain, model, start)
