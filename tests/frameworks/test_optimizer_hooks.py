"""Hooks registered on a prepared optimizer run on every replica's optimizer, as plain torch's.

`torch.optim.Optimizer`'s `register_step_pre_hook`, `register_step_post_hook` and its
`state_dict` / `load_state_dict` hooks, called on the `MirroredOptimizer` that `prepare`
returns, raised an internal `AttributeError` (the bug hunt of session 57): it never runs
`Optimizer.__init__`, whose hook dictionaries they write. Each now registers on every
replica's optimizer (`optimizer_hooks.py`), as a hook registered before `prepare` is
kept by each replica's copy; compared with plain torch in float64.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.frameworks.helpers import mirrored

pytestmark = pytest.mark.usefixtures("float64")


def _net(torch: Any) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _clamp(optimizer: Any, args: Any, kwargs: Any) -> None:
    """A step post-hook that changes training: every parameter clamped after the step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.data.clamp_(-0.3, 0.3)


@pytest.mark.parametrize("shared", [True, False])
def test_step_hooks_after_prepare_train_as_plain_torch(torch: Any, cdt: Any, shared: bool) -> None:
    net = _net(torch)
    plain = copy.deepcopy(net)
    strategy = mirrored(2)
    with strategy.scope():
        model, optimizer = cdt.prepare(
            net, torch.optim.SGD(net.parameters(), lr=0.5), share_storage=shared
        )
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    seen: list[int] = []
    handles = [
        optimizer.register_step_pre_hook(lambda o, a, k: seen.append(id(o))),
        optimizer.register_step_post_hook(_clamp),
    ]
    plain_optimizer.register_step_post_hook(_clamp)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, generator=generator), torch.randn(8, 1)) for _ in range(3)]

    def step(x: Any, y: Any) -> None:
        optimizer.zero_grad()
        (((model(x) - y) ** 2).sum() / 8).backward()
        optimizer.step()

    for x, y in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(x, y))
    for x, y in batches:
        plain_optimizer.zero_grad()
        (((plain(x) - y) ** 2).sum() / 8).backward()
        plain_optimizer.step()
    # Each replica's step ran the hook with its own optimizer (one where they share one).
    assert sorted(set(seen)) == sorted({id(o) for o in optimizer.replicas})
    assert len(seen) == 3 * len(set(map(id, optimizer.replicas)))
    assert max(float(p.detach().abs().max()) for p in plain.parameters()) == 0.3  # it clamps
    for replica in model.replicas:
        for a, b in zip(replica.parameters(), plain.parameters(), strict=True):
            assert float((a.detach() - b.detach()).abs().max()) <= 1e-12
    for handle in handles:
        handle.remove()
    strategy.run(step, args=next(iter(strategy.experimental_distribute_dataset(batches))))
    assert len(seen) == 3 * len(set(map(id, optimizer.replicas)))  # removed from every one


def test_state_dict_hooks_after_prepare_run_as_plain_torch(torch: Any, cdt: Any) -> None:
    net = _net(torch)
    strategy = mirrored(2)
    with strategy.scope():
        _, optimizer = cdt.prepare(
            net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), share_storage=False
        )

    def tag(opt: Any, state: dict[str, Any]) -> dict[str, Any]:
        state["tagged"] = True
        return state

    def halve_lr(opt: Any, state: dict[str, Any]) -> dict[str, Any]:
        state = copy.deepcopy(state)
        state["param_groups"][0]["lr"] /= 2
        return state

    loaded: list[int] = []
    with optimizer.register_state_dict_post_hook(tag):
        assert optimizer.state_dict()["tagged"] is True
    assert "tagged" not in optimizer.state_dict()  # the context removed it
    optimizer.register_load_state_dict_pre_hook(halve_lr)
    optimizer.register_load_state_dict_post_hook(lambda opt: loaded.append(id(opt)))
    optimizer.load_state_dict(optimizer.state_dict())
    assert [o.param_groups[0]["lr"] for o in optimizer.replicas] == [0.05, 0.05]
    assert sorted(loaded) == sorted(id(o) for o in optimizer.replicas)


def test_registering_an_optimizer_hook_inside_run_is_an_error(torch: Any, cdt: Any) -> None:
    net = _net(torch)
    strategy = mirrored(2)
    with strategy.scope():
        _, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"register optimizer hooks outside strategy\.run"):
        strategy.run(lambda: optimizer.register_step_pre_hook(lambda *a: None))


def test_a_torchscript_module_is_refused_clearly(torch: Any, cdt: Any) -> None:
    """It failed deep inside (`contains(): incompatible function arguments`)."""
    strategy = mirrored(2)
    with pytest.warns(DeprecationWarning, match="deprecated"):  # (torch 2.13: TorchScript)
        scripted = torch.jit.script(_net(torch))
    with strategy.scope(), pytest.raises(TypeError, match=r"TorchScript module .*eager"):
        cdt.prepare(scripted, torch.optim.SGD(scripted.parameters(), lr=0.1))


def test_an_optimizer_step_inside_backward_is_an_error_saying_so(torch: Any, cdt: Any) -> None:
    """torch's optimizer-in-backward idiom (a step from each parameter's post-accumulate
    hook) would step before the pass reduced the gradient: refused, naming the idiom (the
    error blamed `no_sync()`, the bug hunt of session 57)."""
    net = _net(torch)
    strategy = mirrored(2)
    with strategy.scope():
        params = list(net.parameters())
        model, *optimizers = cdt.prepare(net, *[torch.optim.SGD([p], lr=0.1) for p in params])
    by_param = dict(zip(params, optimizers, strict=True))

    def hook(p: Any) -> None:
        by_param[p].step()
        by_param[p].zero_grad()

    for p in params:  # replica 0's parameters: the hooks reach every replica
        p.register_post_accumulate_grad_hook(hook)
    x = torch.randn(8, 3)
    with pytest.raises(RuntimeError, match=r"during this replica's backward pass .*after loss"):
        strategy.run(lambda: (model(x) ** 2).sum().backward())
