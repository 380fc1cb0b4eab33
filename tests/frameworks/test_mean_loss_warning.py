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
    return crossdevice.torch.compute_average_loss(per_example, global_batch_size=n)


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


def _warnings(torch: Any, strategy: Any, model: Any, loss: Any, outputs: int) -> list[Any]:
    """The local-mean warnings of one step of `model` (6 features in, `outputs` out)."""
    x, _ = global_batches(torch, 1)[0]
    y = torch.arange(len(x)) % outputs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x_, y_ in strategy.experimental_distribute_dataset([(x, y)]):
            strategy.run(lambda a, b: loss(torch, model(a), b, len(y)).backward(), args=(x_, y_))
    return [w for w in caught if "this replica's mean" in str(w.message)]


# (the other right losses divide a local mean by 4: right on 4 replicas only)
ANY_REPLICAS = [n for n in sorted(RIGHT) if "replicas" not in n]


@pytest.mark.parametrize(
    ("replicas", "name"), [(2, n) for n in ANY_REPLICAS] + [(4, n) for n in sorted(RIGHT)]
)
def test_a_right_loss_with_as_many_classes_as_replicas_does_not_warn(
    torch: Any, cdt: Any, replicas: int, name: str
) -> None:
    # The local batch times the classes is then the global batch: a summed cross entropy
    # over the global batch (one term per example) looked like a local mean.
    strategy = mirrored(replicas)
    with strategy.scope():
        model = cdt.prepare(torch.nn.Linear(6, replicas))
    assert _warnings(torch, strategy, model, RIGHT[name], replicas) == [], name


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize(
    "name", ["cross_entropy", "summed loss over local batch", "sum over local batch"]
)
def test_a_local_mean_with_as_many_classes_as_replicas_still_warns(
    torch: Any, cdt: Any, replicas: int, name: str
) -> None:
    strategy = mirrored(replicas)
    with strategy.scope():
        model = cdt.prepare(torch.nn.Linear(6, replicas))
    assert len(_warnings(torch, strategy, model, WRONG[name], replicas)) == 1, name


def test_only_the_models_a_loss_trains_are_looked_at(torch: Any, cdt: Any) -> None:
    # A model with DDP's rule and DDP's loss is right, whatever other model (with the SUM
    # rule) the strategy holds; that other model keeps its own warning for its own habit.
    strategy = mirrored(2)
    with strategy.scope():
        summed = cdt.prepare(torch.nn.Linear(6, 3))
        averaged = cdt.prepare(torch.nn.Linear(6, 3), gradient_reduction="mean")
    mean = WRONG["cross_entropy"]
    assert _warnings(torch, strategy, averaged, mean, 3) == []
    assert _warnings(torch, strategy, averaged, mean, 3) == []
    assert len(_warnings(torch, strategy, summed, mean, 3)) == 1
    # Both in one loss: the SUM-rule model's gradients are N times too large.
    with strategy.scope():
        other = cdt.prepare(torch.nn.Linear(6, 3))

    def both(x: Any) -> Any:
        return other(x) + averaged(x)

    assert len(_warnings(torch, strategy, both, mean, 3)) == 1
