"""Attributes and gradients changed on replica 0 outside `strategy.run` reach every replica.

Outside `strategy.run` a mirrored module reads as replica 0's copy. Two changes made
there reached replica 0 alone (the bug hunt of session 55), and the replicas trained on
apart, silently:

* a plain attribute set on a submodule (`model.module[1].negative_slope = 0.9`,
  `model[2].temperature = 0.5`, a dropout schedule `model[3].p = 0.0`): now followed at
  the next run (`attributes.py`);
* gradients changed between a run's backward and the next run's step
  (`clip_grad_norm_(model.parameters(), ...)`, `p.grad.mul_(0.5)`, `p.grad = None`),
  with a copy per replica: now followed (`outside_gradients.py`).

Each case trains as plain torch does on the same global batches, in every mode (replica
threads or cooperative, shared storage or copies), on 2 and 3 replicas.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.frameworks.helpers import global_batches, global_loss, mirrored
from tests.strategies.conftest import replica_execution

MODES = pytest.mark.parametrize("mode", ["threads", "cooperative"])
SHARED = pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
REPLICAS = pytest.mark.parametrize("replicas", [2, 3])


def _net(torch: Any) -> Any:
    class Tempered(torch.nn.Module):
        """Divides by a temperature; remembers, inside run, its replica's own rows."""

        gain = 1.0  # a class default, shadowed by an instance attribute for a while

        def __init__(self) -> None:
            super().__init__()
            self.temperature = 1.0
            self.shift = (0.0, 0.0, 0.0)

        def forward(self, x: Any) -> Any:
            self.rows = x.shape[0]  # set inside run: each replica's own
            return x / self.temperature * self.gain + torch.tensor(self.shift)

    torch.manual_seed(0)
    dropout = torch.nn.Dropout(0.0).eval()  # its `p` is followed, its randomness unused
    return torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.LeakyReLU(0.1), Tempered(), dropout)


def _change(model: Any, i: int) -> None:
    """Plain attributes changed before step `i`, each reached another way."""
    first = getattr(model, "module", model)  # replica 0's module (plain torch: the model)
    if i == 1:
        first[1].negative_slope = 0.9
        model[2].temperature = 0.5
        model[2].gain = 3.0
        model[3].p = 0.5  # a dropout schedule
    if i == 2:
        first[2].shift = (0.1, -0.2, 0.3)
        model[3].p = 0.25
        del model[2].gain  # the class's again
        model[2].temperature = 2.0


@MODES
@SHARED
@REPLICAS
def test_attributes_set_on_submodules_outside_run_reach_every_replica(
    torch: Any, cdt: Any, mode: str, shared: bool, replicas: int
) -> None:
    torch.set_default_dtype(torch.float64)
    data = global_batches(torch, 4)
    plain = _net(torch)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.5)
    for i, (x, y) in enumerate(data):
        _change(plain, i)
        sgd.zero_grad()
        global_loss(torch, plain, x, y).backward()
        sgd.step()
    with replica_execution(mode):
        strategy = mirrored(replicas)
        with strategy.scope():
            net = _net(torch)
            model, optimizer = cdt.prepare(
                net, torch.optim.SGD(net.parameters(), lr=0.5), share_storage=shared
            )

        def step(x: Any, y: Any) -> None:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()
            optimizer.step()

        for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(data)):
            _change(model, i)
            strategy.run(step, args=(x, y))
            # set by each replica's own forward (16 rows over 3 replicas: 6, 6, 4): kept
            rows = [len(part) for part in strategy.experimental_local_results(x)]
            assert [r[2].rows for r in model.replicas] == rows
    assert [r[1].negative_slope for r in model.replicas] == [0.9] * replicas
    assert [(r[2].temperature, r[2].shift, r[3].p) for r in model.replicas] == [
        (2.0, (0.1, -0.2, 0.3), 0.25)
    ] * replicas
    assert all("gain" not in vars(r[2]) for r in model.replicas)
    for replica in model.replicas:
        for a, b in zip(replica.parameters(), plain.parameters(), strict=True):
            assert float((a - b).detach().abs().max()) <= 1e-12


def test_a_submodule_replaced_outside_run_is_an_error(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        net = _net(torch)
        model, _ = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
    model.module[1] = torch.nn.ReLU()
    with pytest.raises(RuntimeError, match=r"replaced or added outside strategy\.run"):
        strategy.run(lambda: None)


def _mlp(torch: Any) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _edit_gradients(torch: Any, model: Any, how: str) -> None:
    """Between the backward and the step, outside run (on replica 0's copy there)."""
    if how == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    elif how == "scaled":
        with torch.no_grad():
            for p in model.parameters():
                p.grad.mul_(0.5)
    else:  # "cleared"
        next(iter(model.parameters())).grad = None


@pytest.mark.parametrize("how", ["clip", "scaled", "cleared"])
@MODES
@SHARED
@REPLICAS
def test_gradients_changed_outside_run_before_the_step_reach_every_replica(
    torch: Any, cdt: Any, how: str, mode: str, shared: bool, replicas: int
) -> None:
    torch.set_default_dtype(torch.float64)
    data = global_batches(torch, 3)
    plain = _mlp(torch)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
    for x, y in data:
        sgd.zero_grad()
        global_loss(torch, plain, x, y).backward()
        _edit_gradients(torch, plain, how)
        sgd.step()
    with replica_execution(mode):
        strategy = mirrored(replicas)
        with strategy.scope():
            net = _mlp(torch)
            sgd = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
            model, optimizer = cdt.prepare(net, sgd, share_storage=shared)

        def backward(x: Any, y: Any) -> None:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()

        for x, y in strategy.experimental_distribute_dataset(data):
            strategy.run(backward, args=(x, y))
            _edit_gradients(torch, model, how)
            strategy.run(optimizer.step)
    first = list(model.replicas[0].parameters())
    for replica in model.replicas[1:]:
        for a, b in zip(first, replica.parameters(), strict=True):
            assert torch.equal(a, b), "replicas differ"
    worst = max(
        float((a - b).detach().abs().max()) for a, b in zip(first, plain.parameters(), strict=True)
    )
    assert worst <= 1e-12, worst
