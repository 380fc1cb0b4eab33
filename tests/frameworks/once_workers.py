"""`call_once` across worker processes: the function a scheduler step runs, given a metric."""

from __future__ import annotations

from typing import Any


def plateau_training(rank: int, world_size: int, reduced: bool, replicas: int) -> dict[str, Any]:
    """Train an MLP 3 steps with `ReduceLROnPlateau.step(metric)` in the step function:
    the worker's own loss, or (`reduced`) the mean over every replica. Returns the error
    (type and text) or the learning rates after each step."""
    import torch

    import crossdevice
    import crossdevice.torch as cdt
    from tests.frameworks.helpers import (
        GLOBAL_BATCH,
        global_batches,
        global_loss,
        mlp,
        worker_strategy,
    )

    strategy = worker_strategy(replicas)
    with strategy.scope():
        net = mlp(torch)
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    assert GLOBAL_BATCH % (world_size * replicas) == 0

    def step(x: Any, y: Any) -> None:
        loss = global_loss(torch, model, x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        metric = float(loss.detach()) * (1 + rank)  # this worker's own: differs
        if reduced:
            ctx = crossdevice.get_replica_context()
            metric = float(ctx.all_reduce("mean", torch.tensor(metric)))
        plateau.step(metric)

    rates = []
    try:
        for x, y in strategy.experimental_distribute_dataset(global_batches(torch, 3)):
            strategy.run(step, args=(x, y))
            rates.append(optimizer.param_groups[0]["lr"])
    except ValueError as err:
        return {"error": str(err)}
    return {"rates": rates}
