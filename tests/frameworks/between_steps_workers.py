"""Workers with one or two replicas each that write an undeclared buffer outside `run`.

`train(rank, world_size, how, replicas)` trains an MLP with a `scale` buffer (read by
the forward, changed by no forward, no declared aggregation) on the same global
batches on every worker, and writes `scale` outside `strategy.run` on every worker
alike (`how`): loaded before training (`load_state_dict`), cast with the model after
prepare (`model.to(torch.float64)`), or scaled in place between steps. Returns the
error (type and text) or the final parameters and buffers.
"""

from __future__ import annotations

from typing import Any

STEPS = 4


def net(torch: Any) -> Any:
    """The helpers' MLP with a `scale` buffer between its layers."""
    from tests.frameworks.helpers import mlp

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(8))

        def forward(self, x: Any) -> Any:
            return x * self.scale

    first, act, last = mlp(torch)
    return torch.nn.Sequential(first, act, Scaled(), last)


def checkpoint(torch: Any) -> dict[str, Any]:
    """A state dict with other parameters and a `scale` of 2 (a run to resume)."""
    source = net(torch)
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(0.5)
        source[2].scale.fill_(2.0)
    return source.state_dict()


def write(torch: Any, model: Any, how: str, i: int) -> None:
    """What `how` writes outside the run before step `i`."""
    if how == "loaded" and i == 0:
        model.load_state_dict(checkpoint(torch))
    if how == "cast" and i == 0:
        model.to(torch.float64)
    if how == "scaled" and i == 2:
        with torch.no_grad():
            model[2].scale.mul_(1.5)


def train(rank: int, world_size: int, how: str, replicas: int) -> dict[str, Any]:
    """Train STEPS steps, writing `scale` by `how` (module doc)."""
    import torch

    import crossdevice.torch as cdt
    from tests.frameworks.helpers import global_batches, global_loss, worker_strategy

    del rank, world_size
    torch.set_default_dtype(torch.float32 if how == "cast" else torch.float64)
    strategy = worker_strategy(replicas)
    data = global_batches(torch, STEPS)
    with strategy.scope():
        module = net(torch)
        model, optimizer = cdt.prepare(module, torch.optim.SGD(module.parameters(), lr=0.5))

    def step(x: Any, y: Any) -> None:
        optimizer.zero_grad()
        global_loss(torch, model, x.to(torch.float64), y).backward()
        optimizer.step()

    try:
        for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(data)):
            write(torch, model, how, i)
            strategy.run(step, args=(x, y))
    except Exception as err:  # the test shows it
        return {"error": f"{type(err).__name__}: {err}"}
    return {
        "params": [p.detach().clone() for p in model.replicas[0].parameters()],
        "buffers": [b.detach().clone() for b in model.replicas[0].buffers()],
    }


def plain(how: str) -> list[Any]:
    """Plain torch's parameters and buffers for `how` on the global batches."""
    import torch

    from tests.frameworks.helpers import global_batches, global_loss

    torch.set_default_dtype(torch.float32 if how == "cast" else torch.float64)
    data = global_batches(torch, STEPS)
    model = net(torch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for i, (x, y) in enumerate(data):
        write(torch, model, how, i)
        optimizer.zero_grad()
        global_loss(torch, model, x.to(torch.float64), y).backward()
        optimizer.step()
    torch.set_default_dtype(torch.float64)
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
