"""`scale_grad_by_freq` lookups count each row over the global batch, on every replica.

One device divides each row's gradient by the row's count in the global batch's lookup;
each replica sees its slice only, and dividing by its own counts trained a different
model with no error (DDP has the same gap). Every replica now divides by the counts over
every replica's (and worker's) indices, and the gradient reduction adds up plain torch's.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest

import crossdevice as cd
from tests.frameworks.frequency_workers import (
    frequency_data,
    frequency_net,
    frequency_step,
    frequency_training,
)
from tests.frameworks.helpers import mirrored
from tests.strategies.conftest import replica_execution

pytestmark = pytest.mark.usefixtures("float64")
MODES = ["threads", "cooperative"]


def _plain(torch: Any) -> tuple[Any, list[Any]]:
    """The reference model trained on the global batches; its parameters at the start."""
    plain = frequency_net(torch, reference=True)
    start = [p.detach().clone() for p in plain.parameters()]
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.2)
    for x, y in frequency_data(torch):
        frequency_step(plain, optimizer, x, y)
    return plain, start


def test_the_data_repeats_rows_across_slices(torch: Any) -> None:
    """Counting each slice alone gives other counts (so the tests below say something)."""
    for x, _ in frequency_data(torch):
        whole = torch.bincount(x.reshape(-1), minlength=9)
        halves = [torch.bincount(x[r::2].reshape(-1), minlength=9) for r in range(2)]
        assert all(not torch.equal(whole, half) for half in halves)


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [False, True], ids=["copies", "shared"])
def test_frequency_scaled_lookups_train_like_torch(
    torch: Any, cdt: Any, replicas: int, mode: str, shared: bool
) -> None:
    plain, start = _plain(torch)
    with replica_execution(mode):
        strategy = mirrored(replicas)
        with strategy.scope():
            net = frequency_net(torch)
            model, optimizer = cdt.prepare(
                net, torch.optim.SGD(net.parameters(), lr=0.2), share_storage=shared
            )
        for batch in strategy.experimental_distribute_dataset(frequency_data(torch)):
            strategy.run(lambda b: frequency_step(model, optimizer, *b), args=(batch,))
    first, *others = model.replicas
    for other in others:
        for a, b in zip(first.parameters(), other.parameters(), strict=True):
            assert torch.equal(a, b), "replicas differ"
    for (name, want), got, was in zip(
        plain.named_parameters(), first.parameters(), start, strict=True
    ):
        assert float((want - got).detach().abs().max()) <= 1e-12, name
        assert float((want - was).detach().abs().max()) > 1e-6, f"{name} never moved"


@pytest.mark.parametrize("mode", MODES)
def test_a_lookup_every_replica_makes_alike_warns_once(torch: Any, cdt: Any, mode: str) -> None:
    """Positions built alike on every replica count once on one device, N times here."""
    torch.manual_seed(0)
    net = torch.nn.Embedding(6, 2, scale_grad_by_freq=True)
    with replica_execution(mode):
        strategy = mirrored(2)
        with strategy.scope():
            model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))

        def step() -> None:
            optimizer.zero_grad()
            model(torch.arange(4)).sum().div(5).backward()
            optimizer.step()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            strategy.run(step)
            strategy.run(step)
    assert len([w for w in caught if "looked up the same indices" in str(w.message)]) == 1


def test_lookups_without_gradients_exchange_nothing(torch: Any, cdt: Any) -> None:
    """Under no_grad (evaluation) the counts matter to no gradient: no collective, so
    replicas may look up different numbers of times."""
    torch.manual_seed(0)
    net = torch.nn.Embedding(6, 2, scale_grad_by_freq=True)
    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.prepare(net)

    def look() -> Any:
        r = cd.get_replica_context().replica_id_in_sync_group
        with torch.no_grad():
            return [model(torch.tensor([r, r, 1])) for _ in range(r + 1)][-1]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = strategy.experimental_local_results(strategy.run(look))
    assert torch.equal(out[1][0], net.weight[1].detach())


def test_outside_a_run_the_lookup_is_torchs(torch: Any, cdt: Any) -> None:
    torch.manual_seed(0)
    net = torch.nn.Embedding(6, 2, scale_grad_by_freq=True)
    plain = copy.deepcopy(net)
    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.prepare(net)
    x = torch.tensor([1, 1, 2, 3, 3, 3])
    model(x).sum().backward()
    plain(x).sum().backward()
    assert torch.equal(model.replicas[0].weight.grad, plain.weight.grad)


@pytest.mark.multiprocess
@pytest.mark.parametrize("replicas", [1, 2])
def test_frequency_scaled_lookups_train_like_torch_across_workers(
    torch: Any, replicas: int
) -> None:
    from tests.multi_worker.harness import run_workers

    plain, _ = _plain(torch)
    for result in run_workers(frequency_training, 2, args=(replicas,), timeout=90):
        for params in result.unwrap():
            for got, want in zip(params, plain.parameters(), strict=True):
                assert abs(got - want.detach().numpy()).max() <= 1e-12
