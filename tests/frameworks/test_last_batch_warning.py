"""The local-mean warning on a step where one replica holds the whole global batch.

A last global batch of 1 over 2 replicas splits 1/0: the replica with the example has
the global batch, so `compute_average_loss(per_example, global_batch_size=1)` (a sum over
its batch, 1) is right, and so is any mean over it. The warning said "this replica's
mean ... 2 times plain torch's" there (the bug hunt of session 58, finding 5): it must stay
silent on every such step, and still warn on the habit it is for.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

import crossdevice as cd

MESSAGE = "this replica's mean"


def _losses(torch: Any) -> dict[str, Any]:
    import crossdevice.torch as cdt

    return {
        "compute_average_loss": lambda per, b: cdt.compute_average_loss(per, global_batch_size=b),
        "sum over the global batch": lambda per, b: per.sum() / b,
        "local mean (wrong)": lambda per, b: per.mean(),
        "sum over the local batch (wrong)": lambda per, b: per.sum() / len(per),
    }


def _train(torch: Any, loss_name: str, sizes: list[int]) -> tuple[list[Any], list[str], Any]:
    """Train a float64 linear model on global batches of `sizes` over 2 replicas."""
    import crossdevice.torch as cdt

    torch.manual_seed(0)
    total = sum(sizes)
    x = torch.randn(total, 3, dtype=torch.float64)
    y = torch.randn(total, dtype=torch.float64)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    batches = [(x[s : s + n], y[s : s + n]) for s, n in zip(starts, sizes, strict=True)]
    net = torch.nn.Linear(3, 1, dtype=torch.float64)
    reference = torch.nn.Linear(3, 1, dtype=torch.float64)
    reference.load_state_dict(net.state_dict())
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model, opt = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loss_fn = _losses(torch)[loss_name]

    def step(xb: Any, yb: Any, size: int) -> None:
        per_example = (model(xb).squeeze(1) - yb) ** 2
        opt.zero_grad()
        loss_fn(per_example, size).backward()
        opt.step()

    messages = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, (xb, yb) in enumerate(strategy.experimental_distribute_dataset(batches)):
            strategy.run(step, args=(xb, yb, sizes[k]))
            messages.append(" | ".join(str(w.message) for w in caught if MESSAGE in str(w.message)))
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for xb, yb in batches:  # plain torch on the same global batches
        plain.zero_grad()
        ((reference(xb).squeeze(1) - yb) ** 2).mean().backward()
        plain.step()
    return messages, [p.detach() for p in model.parameters()], reference


@pytest.mark.parametrize("loss_name", ["compute_average_loss", "sum over the global batch"])
@pytest.mark.parametrize(
    "sizes", [[4, 4, 1], [1, 4], [1]], ids=["last of 1", "first of 1", "only 1"]
)
def test_a_right_loss_on_a_batch_of_one_is_silent_and_trains_as_plain_torch(
    torch: Any, loss_name: str, sizes: list[int]
) -> None:
    messages, params, reference = _train(torch, loss_name, sizes)
    assert messages[-1] == ""
    for mine, theirs in zip(params, reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs.detach(), rtol=1e-12, atol=1e-12)


def test_one_replica_holding_every_example_of_the_step_is_silent(torch: Any) -> None:
    """Per-replica values 3/0 (as a dataset function gives them): 3 is the global batch."""
    import crossdevice.torch as cdt

    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    net = torch.nn.Linear(3, 1, dtype=torch.float64)
    with strategy.scope():
        model = cdt.prepare(net)
    x = torch.randn(3, 3, dtype=torch.float64)
    parts = strategy.experimental_distribute_values_from_function(
        lambda ctx: x if ctx.replica_id_in_sync_group == 0 else x[:0]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.run(lambda xb: (model(xb) ** 2).sum().div(len(xb) or 1).backward(), args=(parts,))
    assert [str(w.message) for w in caught if MESSAGE in str(w.message)] == []


@pytest.mark.parametrize("loss_name", ["local mean (wrong)", "sum over the local batch (wrong)"])
@pytest.mark.parametrize("sizes", [[4, 4, 1], [1, 4]], ids=["last of 1", "first of 1"])
def test_the_habit_still_warns_on_a_step_with_full_slices(
    torch: Any, loss_name: str, sizes: list[int]
) -> None:
    messages, _, _ = _train(torch, loss_name, sizes)
    first_full = sizes.index(4)
    assert messages[:first_full] == [""] * first_full  # the step of 1 is not the evidence
    assert "2 times plain torch's" in messages[first_full]
