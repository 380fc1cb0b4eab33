"""Lazy modules (`LazyLinear`, ...): refused clearly until a forward sets their shapes.

Mirroring needs every parameter's shape; an uninitialised lazy parameter failed inside
`prepare` with torch's own error about `untyped_storage` (found by a bug hunt). Once a
forward on a sample batch has materialised it, the model trains as plain torch does.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.frameworks.helpers import (
    assert_trains_like,
    global_batches,
    mirrored,
    run_on_replicas,
    standard_step,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")


def _lazy_net(torch: Any) -> Any:
    torch.manual_seed(0)
    layers = [torch.nn.LazyLinear(5), torch.nn.Tanh(), torch.nn.Linear(5, 3)]
    return torch.nn.Sequential(*layers)


def test_an_uninitialised_lazy_module_is_refused_saying_what_to_do(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    net = _lazy_net(torch)
    with strategy.scope(), pytest.raises(ValueError, match=r"'0\.weight' of Sequential is not"):
        cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
    with strategy.scope(), pytest.raises(ValueError, match="Run one forward on a sample batch"):
        cdt.prepare(net)


def test_a_lazy_module_materialised_by_a_forward_trains_as_plain_torch(
    torch: Any, cdt: Any
) -> None:
    net = _lazy_net(torch)
    net(torch.zeros(1, 6))  # the shapes are set
    plain = copy.deepcopy(net)
    data = global_batches(torch, 3)
    step = standard_step(torch)
    start = train_plain(torch, plain, torch.optim.SGD(plain.parameters(), lr=0.5), data, step)
    strategy = mirrored(3)
    with strategy.scope():
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
    run_on_replicas(strategy, lambda x, y, i: step(model, optimizer, x, y, i), data)
    assert_trains_like(torch, plain, model, start)
