"""A prepared optimizer deep-copies and steps with a closure as plain torch's does.

Both were refusals where plain torch, DDP and Accelerate run (bug hunt of session 54):

* `copy.deepcopy(optimizer)` raised "a MirroredOptimizer cannot be pickled". Plain torch
  copies an optimizer with its parameters: alone, over new tensors in no model; with the
  model in one deep copy (one memo), over the copied model's parameters. Here the copy
  is the same: alone, replica 0's optimizer copied as torch copies it (a plain
  optimizer); after the mirrored model in one deep copy, a `MirroredOptimizer` over the
  copied mirrored model, which trains on as the original's copy does in plain torch.
* `optimizer.step(closure)` with SGD or Adam was refused where the replicas store their
  parameters once. Each replica now evaluates the closure on its own slice (its backward
  reduces the gradients), the one step follows, and every replica returns the reduced
  loss: plain torch's loss and update on the global batch.

Every test runs on replica threads and cooperative replicas, with shared storage and
with a copy per replica, against plain torch on the same global batches in float64.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest

from tests.frameworks.helpers import (
    assert_trains_like,
    global_batches,
    global_loss,
    mirrored,
    mlp,
    run_on_replicas,
    standard_step,
    train_plain,
)
from tests.strategies.conftest import replica_execution

MODES = ["threads", "cooperative"]
SHARING = pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
EXECUTION = pytest.mark.parametrize("mode", MODES)


def _adam(torch: Any, params: Any) -> Any:
    return torch.optim.Adam(params, lr=1e-2)


def _trained(torch: Any, cdt: Any, data: list[Any], shared: bool) -> tuple[Any, Any, Any]:
    """(strategy, model, optimizer): the mirrored `mlp` trained with Adam on `data`."""
    strategy = mirrored(4)
    with strategy.scope():
        net = mlp(torch)
        model, optimizer = cdt.prepare(net, _adam(torch, net.parameters()), share_storage=shared)
    train = standard_step(torch)
    run_on_replicas(strategy, lambda x, y, i: train(model, optimizer, x, y, i), data)
    return strategy, model, optimizer


def _plain(torch: Any, data: list[Any]) -> tuple[Any, Any, list[Any]]:
    """(model, optimizer, start): the plain `mlp` trained with Adam on `data`."""
    model = mlp(torch)
    optimizer = _adam(torch, model.parameters())
    start = train_plain(torch, model, optimizer, data, standard_step(torch))
    return model, optimizer, start


def _assert_same_state(torch: Any, got: Any, expected: Any) -> None:
    """Two optimizers' state dicts are alike, their tensors within 1e-12."""
    a, b = got.state_dict(), expected.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for k, entry in b["state"].items():
        assert sorted(a["state"][k]) == sorted(entry)
        for name, value in entry.items():
            assert float((a["state"][k][name] - value).abs().max()) <= 1e-12, name


@EXECUTION
@SHARING
def test_an_optimizer_copied_alone_is_torchs_copy_over_detached_parameters(
    torch: Any, cdt: Any, float64: None, mode: str, shared: bool
) -> None:
    data = global_batches(torch, 3)
    plain, plain_optimizer, _ = _plain(torch, data)
    expected = copy.deepcopy(plain_optimizer)
    with replica_execution(mode):
        _, model, optimizer = _trained(torch, cdt, data, shared)
        duplicate = copy.deepcopy(optimizer)
    # As plain torch's: an optimizer of the same class over new tensors in no model.
    assert type(duplicate) is type(expected) is torch.optim.Adam
    params = duplicate.param_groups[0]["params"]
    assert [type(p) for p in params] == [type(p) for p in expected.param_groups[0]["params"]]
    mirrored_params = {id(p) for replica in model.replicas for p in replica.parameters()}
    assert not mirrored_params & {id(p) for p in params}
    assert [id(p) for p in duplicate.state] == [id(p) for p in params]
    for own, original in zip(params, model.replicas[0].parameters(), strict=True):
        assert torch.equal(own, original.detach())
        assert own.grad is None
    _assert_same_state(torch, duplicate, expected)
    _assert_same_state(torch, duplicate, optimizer)
    # Its own state: stepping it leaves the mirrored optimizer and model alone.
    before = [p.detach().clone() for p in model.parameters()]
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    for own, reference in zip(params, expected.param_groups[0]["params"], strict=True):
        own.grad = torch.ones_like(own)
        reference.grad = torch.ones_like(reference)
    duplicate.step()
    expected.step()
    _assert_same_state(torch, duplicate, expected)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(
        torch.equal(a, s["exp_avg"]) for a, s in zip(moments, optimizer.state.values(), strict=True)
    )
    del plain


@EXECUTION
@SHARING
@pytest.mark.parametrize("holder", ["tuple", "dict"])
def test_a_model_and_its_optimizer_copied_together_train_on_like_plain_torchs(
    torch: Any, cdt: Any, float64: None, mode: str, shared: bool, holder: str
) -> None:
    data = global_batches(torch, 6)
    before, after = data[:3], data[3:]

    def together(model: Any, optimizer: Any) -> tuple[Any, Any]:
        if holder == "tuple":
            return copy.deepcopy((model, optimizer))
        copied = copy.deepcopy({"model": model, "optimizer": optimizer})
        return copied["model"], copied["optimizer"]

    plain, plain_optimizer, _ = _plain(torch, before)
    plain_twin, plain_twin_optimizer = together(plain, plain_optimizer)
    assert plain_twin_optimizer.param_groups[0]["params"] == list(plain_twin.parameters())
    # The copy trains on the later batches, the original on them in reverse order.
    step = standard_step(torch)
    start = train_plain(torch, plain_twin, plain_twin_optimizer, after, step)
    train_plain(torch, plain, plain_optimizer, after[::-1], step)
    with replica_execution(mode):
        strategy, model, optimizer = _trained(torch, cdt, before, shared)
        twin, twin_optimizer = together(model, optimizer)
        assert type(twin_optimizer) is cdt.MirroredOptimizer
        assert twin_optimizer.shares_storage is shared
        assert twin_optimizer.param_groups[0]["params"] == list(twin.replicas[0].parameters())
        _assert_same_state(torch, twin_optimizer, optimizer)
        run_on_replicas(strategy, lambda x, y, i: step(twin, twin_optimizer, x, y, i), after)
        run_on_replicas(strategy, lambda x, y, i: step(model, optimizer, x, y, i), after[::-1])
    assert_trains_like(torch, plain_twin, twin, start)
    assert_trains_like(torch, plain, model, start)
    _assert_same_state(torch, twin_optimizer, plain_twin_optimizer)
    _assert_same_state(torch, optimizer, plain_optimizer)


@EXECUTION
@SHARING
def test_an_optimizer_copied_before_its_model_is_over_the_copied_model_as_in_torch(
    torch: Any, cdt: Any, float64: None, mode: str, shared: bool
) -> None:
    data = global_batches(torch, 6)
    before, after = data[:3], data[3:]
    plain, plain_optimizer, _ = _plain(torch, before)
    plain_twin_optimizer, plain_twin = copy.deepcopy((plain_optimizer, plain))
    assert plain_twin_optimizer.param_groups[0]["params"] == list(plain_twin.parameters())
    step = standard_step(torch)
    start = train_plain(torch, plain_twin, plain_twin_optimizer, after, step)
    with replica_execution(mode):
        strategy, model, optimizer = _trained(torch, cdt, before, shared)
        twin_optimizer, twin = copy.deepcopy((optimizer, model))
        # The model was not copied yet when its optimizer was: a plain copy over the
        # copied model's replica 0 parameters, which prepare mirrors.
        assert type(twin_optimizer) is torch.optim.Adam
        assert twin_optimizer.param_groups[0]["params"] == list(twin.replicas[0].parameters())
        with pytest.raises(RuntimeError, match=r"crossdevice\.torch\.prepare"):
            strategy.run(twin_optimizer.step)
        twin, twin_optimizer = cdt.prepare(twin, twin_optimizer)
        run_on_replicas(strategy, lambda x, y, i: step(twin, twin_optimizer, x, y, i), after)
    assert_trains_like(torch, plain_twin, twin, start)
    _assert_same_state(torch, twin_optimizer, plain_twin_optimizer)


@EXECUTION
def test_a_copied_lbfgs_steps_as_the_original_does(
    torch: Any, cdt: Any, float64: None, mode: str
) -> None:
    # Plain torch's copy of LBFGS loses `_params` (its __getstate__ keeps three entries)
    # and fails at its first step; the mirrored copy keeps it and steps as the original.
    data = global_batches(torch, 4)
    step = _closure_step(torch, stray=False)
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            net = mlp(torch)
            lbfgs = torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=4, history_size=3)
            model, optimizer = cdt.prepare(net, lbfgs)
        run_on_replicas(strategy, lambda x, y, i: step(model, optimizer, x, y, i), data[:2])
        twin, twin_optimizer = copy.deepcopy((model, optimizer))
        assert type(twin_optimizer) is cdt.MirroredOptimizer
        for m, o in ((model, optimizer), (twin, twin_optimizer)):
            run_on_replicas(strategy, lambda x, y, i, m=m, o=o: step(m, o, x, y, i), data[2:])
    for replica, twin_replica in zip(model.replicas, twin.replicas, strict=True):
        for a, b in zip(replica.parameters(), twin_replica.parameters(), strict=True):
            assert torch.equal(a, b)


def test_an_optimizer_is_deep_copied_outside_run_and_never_pickled(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        net = mlp(torch)
        model, optimizer = cdt.prepare(net, _adam(torch, net.parameters()))
    with pytest.raises(RuntimeError, match=r"outside strategy\.run"):
        strategy.run(lambda: copy.deepcopy(optimizer))
    with pytest.raises(TypeError, match=r"cannot be pickled.*state_dict\(\)"):
        pickle.dumps(optimizer)
    del model


# --- step(closure) -------------------------------------------------------------------------
OPTIMIZERS = {
    "SGD": lambda torch, params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
    "Adam": lambda torch, params: torch.optim.Adam(params, lr=1e-2),
}


def _closure_step(torch: Any, stray: bool) -> Any:
    """A step through `optimizer.step(closure)`, the closure zeroing the gradients first;
    with `stray`, a backward before it leaves gradients the closure must replace."""

    def step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> Any:
        del i
        if stray:
            (global_loss(torch, model, x, y) * 3.0).backward()

        def closure() -> Any:
            optimizer.zero_grad()
            loss = global_loss(torch, model, x, y)
            loss.backward()
            return loss

        return optimizer.step(closure)

    return step


@EXECUTION
@SHARING
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stray", [False, True], ids=["closure", "after-a-backward"])
def test_a_step_with_a_closure_trains_like_plain_torch(
    torch: Any, cdt: Any, float64: None, mode: str, shared: bool, name: str, stray: bool
) -> None:
    make = OPTIMIZERS[name]
    data = global_batches(torch, 4)
    step = _closure_step(torch, stray)
    plain = mlp(torch)
    plain_optimizer = make(torch, plain.parameters())
    start = [p.detach().clone() for p in plain.parameters()]
    losses = [step(plain, plain_optimizer, x, y, i) for i, (x, y) in enumerate(data)]
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            net = mlp(torch)
            model, optimizer = cdt.prepare(net, make(torch, net.parameters()), share_storage=shared)
        assert optimizer.shares_storage is shared
        results = run_on_replicas(strategy, lambda x, y, i: step(model, optimizer, x, y, i), data)
    assert_trains_like(torch, plain, model, start)
    _assert_same_state(torch, optimizer, plain_optimizer)
    for expected, result in zip(losses, results, strict=True):
        for loss in strategy.experimental_local_results(result):
            assert float((loss - expected.detach()).abs()) <= 1e-12  # the global loss
