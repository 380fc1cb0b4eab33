"""A training-mode forward under `torch.inference_mode()` inside `strategy.run`.

Plain torch updates BatchNorm's statistics in place there, and its buffers stay ordinary
tensors. The mirrored module's combined buffers were made there, as inference tensors:
every later run failed ("Inference tensors do not track version counter"), the model
lost for good, where plain torch trains on.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.frameworks.helpers import global_batches, mirrored
from tests.strategies.conftest import replica_execution

pytestmark = pytest.mark.usefixtures("float64")


def _after_a_look(torch: Any, cdt: Any, mode: str, guard: Any) -> list[Any]:
    """A BatchNorm model's state after a training-mode forward under `guard`, then 2 steps."""
    x = global_batches(torch, 1)[0][0]
    with replica_execution(mode):
        strategy = mirrored(4)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8))
        with strategy.scope():
            model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))

        def look(x: Any) -> None:
            with guard():
                model(x)  # training mode: the statistics move

        def train(x: Any) -> None:
            optimizer.zero_grad()
            cdt.compute_average_loss(
                model(x).pow(2).sum(1), global_batch_size=len(x) * 4
            ).backward()
            optimizer.step()

        (inputs,) = strategy.experimental_distribute_dataset([x])
        for fn in (look, train, train):
            strategy.run(fn, args=(inputs,))
    assert not model.replicas[0][1].running_mean.is_inference()
    return [t.detach().clone() for t in model.state_dict().values()]


@pytest.mark.parametrize("mode", ["threads", "cooperative"])
def test_a_training_forward_under_inference_mode_changes_buffers_as_under_no_grad(
    torch: Any, cdt: Any, mode: str
) -> None:
    inference = _after_a_look(torch, cdt, mode, torch.inference_mode)
    no_grad = _after_a_look(torch, cdt, mode, torch.no_grad)
    for a, b in zip(inference, no_grad, strict=True):
        assert torch.equal(a, b)
