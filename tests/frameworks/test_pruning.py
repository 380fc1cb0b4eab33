"""Iterative pruning between steps trains what plain torch trains.

`torch.nn.utils.prune` on an already-pruned parameter (prune k times, between steps,
outside `strategy.run`) removes its forward pre-hook and registers a `PruningContainer`
in one call, and gives the module a new mask buffer. The hook mirror forgot the new hook
with the old one (a bug hunt found it): the other replicas kept no pre-hook, used a
`weight` their last forward had made, and the next backward failed with torch's
"backward through the graph a second time". Compared with plain torch on the same global
batches in float64, on replica threads and cooperative replicas, with shared storage and
copies, 2 and 3 replicas. A parameter renamed by prune (the first pruning after prepare,
`prune.remove`) is a crossdevice error that says what to do.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.frameworks.helpers import (
    assert_trains_like,
    global_batches,
    mirrored,
    mlp,
    standard_step,
    train_plain,
)
from tests.strategies.conftest import replica_execution

pytestmark = pytest.mark.usefixtures("float64")


def _pruned(torch: Any) -> Any:
    from torch.nn.utils import prune

    model = mlp(torch)
    prune.l1_unstructured(model[0], "weight", amount=0.2)
    prune.l1_unstructured(model[2], "bias", amount=0.3)
    return model


def _prune_again(torch: Any, model: Any, i: int) -> None:
    """Between steps: prune what is pruned already (the mirrored model: replica 0's)."""
    from torch.nn.utils import prune

    if i == 1:
        prune.l1_unstructured(model[0], "weight", amount=0.3)
    if i == 3:
        prune.l1_unstructured(model[0], "weight", amount=0.3)
        prune.ln_structured(model[2], "bias", amount=0.34, n=1, dim=0)


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("mode", ["threads", "cooperative"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
def test_pruning_again_between_steps_trains_like_plain_torch(
    torch: Any, cdt: Any, shared: bool, mode: str, replicas: int
) -> None:
    from torch.nn.utils import prune

    data = global_batches(torch, 6)
    step = standard_step(torch)
    plain = _pruned(torch)
    plain_sgd = torch.optim.SGD(plain.parameters(), lr=0.5)

    def plain_step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        step(model, optimizer, x, y, i)
        _prune_again(torch, model, i)

    start = train_plain(torch, plain, plain_sgd, data, plain_step)
    with replica_execution(mode):
        strategy = mirrored(replicas)
        with strategy.scope():
            net = _pruned(torch)
            sgd = torch.optim.SGD(net.parameters(), lr=0.5)
            model, optimizer = cdt.prepare(net, sgd, share_storage=shared)
        for i, batch in enumerate(strategy.experimental_distribute_dataset(data)):
            strategy.run(step, args=(model, optimizer, *batch, i))
            _prune_again(torch, model, i)
        strategy.run(lambda: model(data[0][0][:4]))  # the last pruning reaches every replica
    assert_trains_like(torch, plain, model, start)
    masks = [dict(replica.named_buffers()) for replica in model.replicas]
    for name, mask in dict(plain.named_buffers()).items():
        for own in masks:
            assert torch.equal(own[name], mask), name
    for replica in model.replicas:  # one PruningContainer per pruned tensor, on each
        hooks = list(replica[0]._forward_pre_hooks.values())
        assert [type(h).__name__ for h in hooks] == ["PruningContainer"]
    # pruning made permanent once training is done, on replica 0's module (a deep copy
    # of a pruned module fails in plain torch: its `weight` is not a graph leaf)
    final = model.module
    for module in (plain, final):
        prune.remove(module[0], "weight")
        prune.remove(module[2], "bias")
    assert final.state_dict().keys() == plain.state_dict().keys()
    for name, value in plain.state_dict().items():
        assert float((final.state_dict()[name] - value).abs().max()) <= 1e-12, name
    x = data[0][0]
    assert float((final(x) - plain(x)).abs().max().detach()) <= 1e-12


@pytest.mark.parametrize("mode", ["threads", "cooperative"])
def test_hooks_removed_and_registered_in_one_section_reach_every_replica(
    torch: Any, cdt: Any, mode: str
) -> None:
    data = global_batches(torch, 4)
    step = standard_step(torch)

    def swap(model: Any, handles: list[Any], i: int) -> None:
        # what a re-prune does: drop a forward pre-hook, register another, in one section
        handles.pop().remove()
        scale = 1.0 + 0.5 * (i + 1)
        handles.append(model[2].register_forward_pre_hook(lambda m, a: (a[0] * scale,)))

    plain = mlp(torch)
    plain_handles = [plain[2].register_forward_pre_hook(lambda m, a: (a[0] * 0.5,))]
    plain_sgd = torch.optim.SGD(plain.parameters(), lr=0.5)

    def plain_step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        step(model, optimizer, x, y, i)
        swap(model, plain_handles, i)

    start = train_plain(torch, plain, plain_sgd, data, plain_step)
    with replica_execution(mode):
        strategy = mirrored(3)
        with strategy.scope():
            net = mlp(torch)
            handles = [net[2].register_forward_pre_hook(lambda m, a: (a[0] * 0.5,))]
            model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))

        def each(x: Any, y: Any, i: int) -> None:
            step(model, optimizer, x, y, i)

        for i, batch in enumerate(strategy.experimental_distribute_dataset(data)):
            strategy.run(each, args=(*batch, i))
            swap(model, handles, i)
    assert_trains_like(torch, plain, model, start)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
def test_prune_remove_then_a_step_is_an_error_that_says_what_to_do(
    torch: Any, cdt: Any, shared: bool
) -> None:
    from torch.nn.utils import prune

    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.prepare(_pruned(torch), share_storage=shared)
    prune.remove(model[0], "weight")  # renames '0.weight_orig' to '0.weight'
    with pytest.raises(RuntimeError, match=r"'0.weight_orig' .* now keeps it as '0.weight'"):
        strategy.run(lambda: model(torch.ones(2, 6)))
