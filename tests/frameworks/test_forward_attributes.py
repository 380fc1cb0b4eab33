"""Plain attributes a forward sets inside `strategy.run`: each replica's own, and said so.

A module that keeps state in a plain attribute (`self.scale = 0.9 * self.scale + ...`
in its forward) got one value per replica, each from its own slice, where plain torch
has one from the whole batch; outside `run` the model read replica 0's. Silently (the
bug hunt of session 57: parameters 1e-2 off plain torch). Now a value that differs
between replicas when the run ends is a UserWarning naming it, once; a cache every
replica sets alike, and a tensor computed from the parameters, are not.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from tests.frameworks.helpers import mirrored

pytestmark = pytest.mark.usefixtures("float64")


def _model(torch: Any, kind: str) -> Any:
    class Tracking(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(3, 1)
            self.scale = 1.0
            self.center = torch.zeros(3)

        def forward(self, x: Any) -> Any:
            if kind == "float":
                self.scale = 0.9 * self.scale + 0.1 * float(x.abs().mean())
            elif kind == "tensor":
                self.center = 0.9 * self.center + 0.1 * x.mean(0)
            elif kind == "cache":
                self.width = x.shape[1]  # alike on every replica
            elif kind == "graph":
                self.last = self.linear(x)  # needs grad: each replica's own by design
            return self.linear(x / self.scale - self.center)

    torch.manual_seed(0)
    return Tracking()


def _train(torch: Any, cdt: Any, kind: str, steps: int = 2) -> Any:
    strategy = mirrored(2)
    with strategy.scope():
        net = _model(torch, kind)
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 3, generator=generator) for _ in range(steps)]

    def step(x: Any) -> None:
        optimizer.zero_grad()
        (model(x) ** 2).sum().backward()
        optimizer.step()

    for x in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(x,))
    return model


@pytest.mark.parametrize(("kind", "name"), [("float", "scale"), ("tensor", "center")])
def test_an_attribute_forwards_set_apart_is_a_warning_once(
    torch: Any, cdt: Any, kind: str, name: str
) -> None:
    with pytest.warns(UserWarning, match=rf"attribute '{name}' .* differ between replicas") as w:
        _train(torch, cdt, kind, steps=3)
    assert len([x for x in w if "differ between replicas" in str(x.message)]) == 1
    assert all(x.filename == __file__ for x in w)  # pointing at the user's code


@pytest.mark.parametrize("kind", ["cache", "graph"])
def test_attributes_alike_or_computed_from_parameters_are_no_warning(
    torch: Any, cdt: Any, kind: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = _train(torch, cdt, kind)
    if kind == "cache":
        assert [r.width for r in model.replicas] == [3, 3]
