"""A regulariser added to each replica's loss counts once, as on one device.

Every replica adds it, and the gradients are SUMmed across replicas: as it is, an L2
penalty counted once per replica (7.6e-2 off plain torch after a few steps, seen).
`crossdevice.torch.scale_regularization_loss` (TF's `tf.nn.scale_regularization_loss`)
gives each replica its share.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.frameworks.helpers import (
    assert_trains_like,
    global_batches,
    global_loss,
    mlp,
    prepared_mlp,
    run_on_replicas,
    train_plain,
)
from tests.strategies.conftest import replica_execution

pytestmark = pytest.mark.usefixtures("float64")


def _l2(torch: Any, model: Any) -> Any:
    return [0.05 * p.pow(2).sum() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["threads", "cooperative"])
def test_a_scaled_l2_penalty_trains_like_plain_torch(torch: Any, cdt: Any, mode: str) -> None:
    data = global_batches(torch, 4)
    plain = mlp(torch)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.3)

    def plain_step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        optimizer.zero_grad()
        (global_loss(torch, model, x, y) + sum(_l2(torch, model))).backward()  # once
        optimizer.step()

    start = train_plain(torch, plain, plain_optimizer, data, plain_step)
    with replica_execution(mode):
        strategy, model, optimizer = prepared_mlp(torch, cdt, lambda p: torch.optim.SGD(p, lr=0.3))

        def step(x: Any, y: Any, i: int) -> None:
            loss = global_loss(torch, model, x, y) + cdt.scale_regularization_loss(
                _l2(torch, model)
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        run_on_replicas(strategy, step, data)
        with strategy.scope(), pytest.raises(RuntimeError, match="cross-replica context"):
            cdt.scale_regularization_loss(torch.tensor(1.0))
    assert_trains_like(torch, plain, model, start)
