"""Buffers written in place without a version bump are combined or refused like others.

QAT's default fused observer (`FusedMovingAvgObsFakeQuantize`), writes through `.data`
and `F.batch_norm` on a module's own statistics change a buffer and leave its version
counter alone: each replica kept its own statistics, silently. They are compared by
value: the undeclared-buffer error, or the declared aggregation, as for any buffer.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from tests.frameworks.helpers import mirrored
from tests.strategies.conftest import replica_execution

MODES = ["threads", "cooperative"]
OBSERVERS = {"*activation_post_process*": "first_replica", "*weight_fake_quant*": "first_replica"}


def _qat(torch: Any, version: int) -> Any:
    """A QAT model; qconfig version 1 (the default) is the fused observer, 0 is not."""
    from torch.ao import quantization as q

    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(q.QuantStub(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    model.append(q.DeQuantStub())
    model.train()
    model.qconfig = q.get_default_qat_qconfig("fbgemm", version=version)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on reduce_range and its observers
        q.prepare_qat(model, inplace=True)
    return model


def _train(torch: Any, cdt: Any, make: Any, replicas: int, shared: bool, **kw: Any) -> Any:
    strategy = mirrored(replicas)
    with strategy.scope():
        net = make()
        model, optimizer = cdt.prepare(
            net, torch.optim.SGD(net.parameters(), lr=0.3), share_storage=shared, **kw
        )
    generator = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(12, 6, generator=generator), torch.randint(0, 3, (12,), generator=generator))
        for _ in range(3)
    ]

    def step(x: Any, y: Any) -> None:
        optimizer.zero_grad()
        (torch.nn.functional.cross_entropy(model(x), y, reduction="sum") / 12).backward()
        optimizer.step()

    for x, y in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(x, y))
    return model


def _assert_replicas_agree(torch: Any, model: Any) -> None:
    first, *others = model.replicas
    for other in others:
        for (name, a), b in zip(first.named_buffers(), other.buffers(), strict=True):
            assert torch.equal(a, b), name
        for a, b in zip(first.parameters(), other.parameters(), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("version", [1, 0], ids=["fused", "not fused"])
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [False, True], ids=["copies", "shared"])
def test_qat_observers_are_refused_until_declared(
    torch: Any, cdt: Any, version: int, replicas: int, mode: str, shared: bool
) -> None:
    with replica_execution(mode):
        with pytest.raises(RuntimeError, match="no declared aggregation") as raised:
            _train(torch, cdt, lambda: _qat(torch, version), replicas, shared)
        assert "'first_replica', '*weight_fake_quant*'" in str(raised.value)
        model = _train(
            torch, cdt, lambda: _qat(torch, version), replicas, shared, buffer_aggregation=OBSERVERS
        )
    _assert_replicas_agree(torch, model)
    observed = dict(model.replicas[0].named_buffers())["0.activation_post_process.scale"]
    assert not torch.equal(observed, torch.ones_like(observed))  # they did observe


class _DataWriter:
    """Modules whose buffer changes bypass the version counter, from forward `start` on."""

    @staticmethod
    def make(torch: Any, how: str, start: int = 1) -> Any:
        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = torch.nn.Linear(6, 3)
                self.register_buffer("average", torch.zeros(6))
                self.register_buffer("var", torch.ones(6))
                self.forwards = 0

            def forward(self, x: Any) -> Any:
                self.forwards += 1
                if self.training and self.forwards >= start:
                    if how == "data":  # an EMA the old way
                        self.average.data.mul_(0.9).add_(0.1 * x.detach().mean(0))
                    elif how == "data =":
                        self.average.data = 0.9 * self.average + 0.1 * x.detach().mean(0)
                    else:  # torch's kernel updates the running statistics
                        torch.nn.functional.batch_norm(x, self.average, self.var, training=True)
                return self.linear(x)

        torch.manual_seed(0)
        return Net()


@pytest.mark.parametrize("how", ["data", "data =", "batch_norm"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [False, True], ids=["copies", "shared"])
def test_writes_around_the_version_counter_are_found(
    torch: Any, cdt: Any, how: str, mode: str, shared: bool
) -> None:
    with replica_execution(mode):
        with pytest.raises(RuntimeError, match=r"changed buffer\(s\) \['average'"):
            _train(torch, cdt, lambda: _DataWriter.make(torch, how), 2, shared)
        model = _train(
            torch,
            cdt,
            lambda: _DataWriter.make(torch, how),
            3,
            shared,
            buffer_aggregation={"average": "mean", "var": "mean"},
        )
    _assert_replicas_agree(torch, model)


def test_a_write_around_the_counter_taken_up_later_is_found_at_the_next_power_of_two(
    torch: Any, cdt: Any
) -> None:
    # Values are compared in each replica's forwards 1-4, then 8, 16, ... (copying and
    # comparing every undeclared buffer every forward would cost as much as the buffers).
    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.prepare(_DataWriter.make(torch, "data", start=6))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    for n in range(1, 9):
        if n < 8:
            strategy.run(lambda: model(x[: 2 + cd_replica()]))
        else:
            with pytest.raises(RuntimeError, match=r"changed buffer\(s\) \['average'\]"):
                strategy.run(lambda: model(x[: 2 + cd_replica()]))


def cd_replica() -> int:
    import crossdevice as cd

    return int(cd.get_replica_context().replica_id_in_sync_group)
