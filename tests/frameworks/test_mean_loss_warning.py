"""The DDP-habit warning: a loss that is this replica's mean, under TF's SUM rule.

It sees the habit through the forms it takes in real scripts (a constant factor for
gradient accumulation, a sum divided by the local batch, several terms) and stays
silent for losses that are right: the global batch's share, and a local mean divided by
exactly the number of replicas (the TF idiom).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from tests.frameworks.helpers import global_batches, mirrored, mlp


def _average(torch: Any, o: Any, y: Any, n: int | None) -> Any:
    import crossdevice.torch

    per_example = torch.nn.functional.cross_entropy(o, y, reduction="none")
    return crossdevice.torch.compute_average_loss(per_example, n)


WRONG = {
    "cross_entropy": lambda t, o, y, n: t.nn.functional.cross_entropy(o, y),
    "over accumulation steps": lambda t, o, y, n: t.nn.functional.cross_entropy(o, y) / 2,
    "times a half": lambda t, o, y, n: 0.5 * t.nn.functional.cross_entropy(o, y),
    "negated": lambda t, o, y, n: -t.nn.functional.cross_entropy(o, y).neg(),
    "plus a penalty, halved": lambda t, o, y, n: (
        (o.square().sum() * 1e-3 + t.nn.functional.cross_entropy(o, y)) / 2
    ),
    "sum over local batch": lambda t, o, y, n: o.square().sum() / len(o),
    "sum over local elements": lambda t, o, y, n: o.square().sum().div(o.numel()) * 3.0,
    "mean over local batch, scaled": lambda t, o, y, n: t.mean(o.square()) * 0.1,
    "summed loss over local batch": lambda t, o, y, n: (
        t.nn.functional.cross_entropy(o, y, reduction="sum") / len(o)
    ),
    "summed loss over local elements": lambda t, o, y, n: (
        t.nn.functional.mse_loss(o, t.zeros_like(o), reduction="sum") / o.numel()
    ),
}
RIGHT = {
    "sum over global batch": lambda t, o, y, n: o.square().sum() / n,
    "summed loss over global batch": lambda t, o, y, n: (
        t.nn.functional.cross_entropy(o, y, reduction="sum") / n
    ),
    "compute_average_loss": _average,
    "compute_average_loss, default batch": lambda t, o, y, n: _average(t, o, y, None),
    "local mean over replicas": lambda t, o, y, n: t.nn.functional.cross_entropy(o, y) / 4,
    "local mean times 1/replicas": lambda t, o, y, n: 0.25 * t.mean(o.square()),
    "halved, over 2 replicas": lambda t, o, y, n: t.nn.functional.cross_entropy(o, y) / 2 / 2,
    "learned weight": lambda t, o, y, n: t.nn.functional.cross_entropy(o, y) * o.sum().tanh(),
}


def _backward(torch: Any, cdt: Any, loss: Any) -> list[Any]:
    strategy = mirrored(4)
    with strategy.scope():
        model = cdt.prepare(mlp(torch))
    x, y = global_batches(torch, 1)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x_, y_ in strategy.experimental_distribute_dataset([(x, y)]):
            strategy.run(lambda a, b: loss(torch, model(a), b, len(y)).backward(), args=(x_, y_))
    return [w for w in caught if "this replica's mean" in str(w.message)]


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_local_mean_in_any_form_warns(torch: Any, cdt: Any, name: str) -> None:
    assert len(_backward(torch, cdt, WRONG[name])) == 1, name


@pytest.mark.parametrize("name", sorted(RIGHT))
def test_a_loss_right_under_the_sum_rule_does_not_warn(torch: Any, cdt: Any, name: str) -> None:
    assert _backward(torch, cdt, RIGHT[name]) == [], name


def test_replica_threads_that_find_it_at_once_warn_once(
    torch: Any, cdt: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every replica thread looks at its own loss; a slow look keeps them all looking at
    # once, so marking the model warned must be one step with checking it.
    import time

    from crossdevice._frameworks.torch import backward
    from tests.strategies.conftest import replica_execution

    look = backward._local_mean

    def slow_look(*args: Any) -> Any:
        time.sleep(0.02)
        return look(*args)

    monkeypatch.setattr(backward, "_local_mean", slow_look)
    with replica_execution("threads"):
        assert len(_backward(torch, cdt, WRONG["cross_entropy"])) == 1


def test_a_habit_taken_up_later_is_found_at_the_next_power_of_two(torch: Any, cdt: Any) -> None:
    # The loss is looked at in each replica's passes 1-4, then 8, 16, ... (reading a
    # fresh graph's nodes every pass cost 40-60 us a step): a local mean from step 5 on
    # warns at step 8, once. (Three replicas: counted over all of them, step 6 would.)
    strategy = mirrored(3)
    with strategy.scope():
        model = cdt.prepare(mlp(torch))
    x, y = global_batches(torch, 1)[0]
    warned_at = []
    for n in range(1, 18):
        loss = RIGHT["compute_average_loss"] if n < 5 else WRONG["cross_entropy"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x_, y_ in strategy.experimental_distribute_dataset([(x, y)]):
                strategy.run(
                    lambda a, b, f=loss: f(torch, model(a), b, len(y)).backward(), args=(x_, y_)
                )
        if any("this replica's mean" in str(w.message) for w in caught):
            warned_at.append(n)
    assert warned_at == [8]
