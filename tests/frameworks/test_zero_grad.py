"""`MirroredOptimizer.zero_grad` leaves what torch's `Optimizer.zero_grad` leaves.

It clears the running replica's gradients with torch's own loop (issue #26: per step,
without the profiler range torch opens on every call), so what it leaves must be
torch's: no gradient, or the same tensor zeroed in place and out of the graph. An
optimizer class with a `zero_grad` of its own gets it called, and under a profiler torch's
range is still recorded.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.frameworks.helpers import mirrored, mlp
from tests.strategies.conftest import replica_execution

pytestmark = pytest.mark.usefixtures("float64")


def _prepared(torch: Any, cdt: Any, replicas: int, share_storage: bool, cls: Any = None) -> Any:
    strategy = mirrored(replicas)
    with strategy.scope():
        net = mlp(torch)
        optimizer = (cls or torch.optim.SGD)(net.parameters(), lr=0.1)
        model, optimizer = cdt.prepare(net, optimizer, share_storage=share_storage)
    return strategy, model, optimizer


def _backward(torch: Any, model: Any, create_graph: bool = False) -> None:
    x = torch.linspace(-1.0, 1.0, 24).reshape(4, 6)
    model(x).square().sum().backward(create_graph=create_graph)


@pytest.mark.parametrize("share_storage", [False, True], ids=["copies", "shared"])
@pytest.mark.parametrize("mode", ["threads", "cooperative"])
def test_zero_grad_in_place_zeroes_the_same_tensors(
    torch: Any, cdt: Any, share_storage: bool, mode: str
) -> None:
    with replica_execution(mode):
        strategy, model, optimizer = _prepared(torch, cdt, 2, share_storage)

        def step(set_to_none: bool) -> Any:
            optimizer.zero_grad()
            _backward(torch, model)
            before = [p.grad for p in model.parameters()]
            optimizer.zero_grad(set_to_none=set_to_none)
            return before, [p.grad for p in model.parameters()]

        # Checked after the step: with shared storage the replicas' gradients lie in one
        # buffer, which the first replica's zero_grad clears for both.
        for before, after in strategy.experimental_local_results(strategy.run(step, (False,))):
            assert all(a is b for a, b in zip(before, after, strict=True))  # in place
            assert all(not g.any() for g in after)
        for before, after in strategy.experimental_local_results(strategy.run(step, (True,))):
            assert all(g is not None for g in before)
            assert after == [None] * 4
        strategy.run(lambda: _backward(torch, model))
        grads = [[p.grad for p in replica.parameters()] for replica in model.replicas]
        assert all(bool(g.abs().sum() > 0) for gs in grads for g in gs)
        optimizer.zero_grad(set_to_none=False)  # outside run: every replica's
        for replica, before in zip(model.replicas, grads, strict=True):
            after = [p.grad for p in replica.parameters()]
            assert all(a is b for a, b in zip(before, after, strict=True))
            assert all(not g.any() for g in after)


# torch warns of the parameter-gradient cycle; the test clears the gradients after.
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
def test_zero_grad_in_place_takes_a_gradient_out_of_the_graph(torch: Any, cdt: Any) -> None:
    """As torch's: a gradient made with create_graph=True is detached, then zeroed."""
    strategy, model, optimizer = _prepared(torch, cdt, 1, share_storage=False)
    plain = mlp(torch)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for net, opt in ((model, optimizer), (plain, plain_optimizer)):
        _backward(torch, net, create_graph=True)
        assert all(p.grad.requires_grad for p in net.parameters())
        opt.zero_grad(set_to_none=False)
        for p in net.parameters():
            assert p.grad.grad_fn is None
            assert not p.grad.requires_grad
            assert not p.grad.any()
        opt.zero_grad()
    del strategy


def test_an_optimizers_own_zero_grad_is_called(torch: Any, cdt: Any) -> None:
    calls: list[bool] = []

    class Counting(torch.optim.SGD):  # type: ignore[misc, name-defined]
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    strategy, _, optimizer = _prepared(torch, cdt, 2, share_storage=False, cls=Counting)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)

    strategy.run(step)
    assert sorted(calls) == [False, False]  # each replica's copy, its own way
    optimizer.zero_grad()  # outside run: every replica's
    assert len(calls) == 4


def test_a_profiler_still_records_torchs_zero_grad_range(torch: Any, cdt: Any) -> None:
    strategy, model, optimizer = _prepared(torch, cdt, 1, share_storage=False)
    _backward(torch, model)
    # acc_events: torch 2.11 warns (an error here) that a second profiler in one process
    # clears the first one's events unless it keeps them.
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, acc_events=True) as profile:
        optimizer.zero_grad()
    names = {event.name for event in profile.events()}
    assert "Optimizer.zero_grad#SGD.zero_grad" in names, sorted(names)
    assert all(p.grad is None for p in model.parameters())
    del strategy
