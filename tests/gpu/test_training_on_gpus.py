"""The digits training example (TF's custom-training tutorial, ported) on GPU:0..3."""

from __future__ import annotations

from typing import Any

import pytest

from tests.frameworks.helpers import load_example
from tests.gpu.conftest import NUM_GPUS, Gpus

pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def test_the_training_example_runs_on_gpus_and_matches_one_gpu(gpus: Gpus) -> None:
    import torch

    example = load_example("custom_training_loop")
    default_dtype = torch.get_default_dtype()
    if gpus.fake is not None:
        gpus.fake.counts.clear()
    try:
        result = example.main(
            [
                *("--device-type", "GPU", "--replicas", str(NUM_GPUS), "--epochs", "1"),
                *("--dtype", "float64", "--check", "--quiet"),
            ]
        )
    finally:
        torch.set_default_dtype(default_dtype)
    # N replicas with SUMmed gradients compute one device's step on the whole batch.
    assert result["max_difference"] < 1e-12
    assert result["test_accuracy"] > 0.3
    for replica in result["replica_params"][1:]:
        for a, b in zip(replica, result["replica_params"][0], strict=True):
            assert (a == b).all()
    if gpus.fake is not None:
        assert gpus.fake.counts["nccl_all_reduce"] > 0 or gpus.logical


def test_a_training_step_never_waits_for_the_gpus(gpus: Gpus) -> None:
    """Forward, backward with bucketed gradient all-reduces, and Adam: no host sync."""
    import torch

    import crossdevice
    import crossdevice.torch

    strategy = crossdevice.MirroredStrategy(gpus.names)
    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 2)
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        model, optimizer = crossdevice.torch.prepare(model, optimizer)
    batch = strategy.experimental_distribute_values_from_function(lambda ctx: torch.ones(4, 6))

    def step(x: Any) -> Any:
        loss = model(x).square().sum() / (4 * NUM_GPUS)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    strategy.run(step, args=(batch,))  # the first step creates Adam's state
    if gpus.fake is not None:
        gpus.fake.counts.clear()
    losses = strategy.run(step, args=(batch,))
    if gpus.fake is not None:
        counts = dict(gpus.fake.counts)
        for what in ("sync", "H2D", "D2H"):
            assert counts.get(what, 0) == 0, counts
    replicas = model.replicas
    for replica in replicas[1:]:
        for a, b in zip(replica.parameters(), replicas[0].parameters(), strict=True):
            assert torch.equal(a.detach().cpu(), b.detach().cpu())
    assert len(strategy.experimental_local_results(losses)) == NUM_GPUS
