"""A training-mode forward outside `strategy.run` (`update_bn`): every replica follows.

`torch.optim.swa_utils.update_bn(loader, model)` recomputes BatchNorm's running
statistics with forward passes in training mode, outside any step. On a mirrored module
with several local replicas that was an error ("only replica 0's buffers would change";
its advice, `model.eval()`, cannot apply: update_bn needs training mode). Now replica 0
runs the whole batch and every local replica takes its buffers, as TF sets every
component of a mirrored variable assigned in cross-replica context: the statistics are
plain torch's, bitwise, on every replica, and training goes on from them.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.frameworks.helpers import bn_dropout_model, mirrored


def _net(torch: Any) -> Any:
    torch.manual_seed(0)
    return bn_dropout_model(torch)


def _loader(torch: Any) -> list[Any]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(8, 1, 8, 8, generator=generator) * (k + 1) for k in range(3)]


@pytest.mark.parametrize("shared", [True, False])
def test_update_bn_outside_run_gives_every_replica_plain_torchs_statistics(
    torch: Any, cdt: Any, shared: bool
) -> None:
    from torch.optim.swa_utils import update_bn

    plain = _net(torch)
    update_bn(_loader(torch), plain)
    strategy = mirrored(4)
    with strategy.scope():
        model = cdt.prepare(_net(torch), share_storage=shared)
    update_bn(_loader(torch), model)
    expected = dict(plain.named_buffers())
    assert float(expected["1.running_var"].sub(1).abs().max()) > 0.1  # they moved
    for replica in model.replicas:
        for name, value in replica.named_buffers():
            assert torch.equal(value, expected[name]), name
    # Training goes on from them: a step's forward combines the replicas' statistics.
    x = _loader(torch)[0]
    model.train()
    for inputs in strategy.experimental_distribute_dataset([x]):
        strategy.run(lambda b: model(b).sum(), args=(inputs,))
    firsts = dict(model.replicas[0].named_buffers())
    for replica in model.replicas[1:]:
        for name, value in replica.named_buffers():
            assert torch.equal(value, firsts[name]), name
