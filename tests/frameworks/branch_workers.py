"""Data-dependent control flow across workers: a layer one worker's replicas skip."""

from __future__ import annotations

from typing import Any

#: Examples per replica, steps, and the step at which worker 1's replicas skip `mid`.
PER_REPLICA = 4
STEPS = 4
SKIP_STEP = 2


def branch_net(torch: Any) -> Any:
    """6 -> 8 -> (8 -> 8, or skipped) -> 3, seeded; `forward(x, skip)`."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inp = torch.nn.Linear(6, 8)
            self.mid = torch.nn.Linear(8, 8)
            self.out = torch.nn.Linear(8, 3)

        def forward(self, x: Any, skip: bool = False) -> Any:
            h = torch.tanh(self.inp(x))
            if not skip:
                h = torch.tanh(self.mid(h))
            return self.out(h)

    return Net()


def skips(step: int, worker: int) -> bool:
    """Whether worker `worker`'s replicas skip `mid` at `step` (a branch on their data)."""
    return step == SKIP_STEP and worker == 1


def batches(torch: Any, global_batch: int) -> list[Any]:
    """The global batches every worker reads (float64)."""
    generator = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(global_batch, 6, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (global_batch,), generator=generator),
        )
        for _ in range(STEPS)
    ]


def branch_training(rank: int, world_size: int, replicas: int) -> list[Any]:
    """Train `branch_net` with SGD, worker 1's replicas skipping `mid` at `SKIP_STEP`
    (its parameters get no gradient there, and its bucket is issued at the end of the
    backward pass instead of from a hook). Returns the final parameters."""
    import torch

    import crossdevice
    import crossdevice.torch as cdt

    torch.set_default_dtype(torch.float64)
    if replicas > 1:
        crossdevice.config.set_logical_cpu_devices(replicas)
    devices = [f"CPU:{i}" for i in range(replicas)]
    strategy = crossdevice.MultiWorkerMirroredStrategy(devices=devices)
    global_batch = PER_REPLICA * replicas * world_size
    with strategy.scope():
        net = branch_net(torch)
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.3, momentum=0.5))

    def step(x: Any, y: Any, k: int) -> None:
        per_example = torch.nn.functional.cross_entropy(
            model(x, skips(k, rank)), y, reduction="none"
        )
        optimizer.zero_grad()
        cdt.compute_average_loss(per_example, global_batch_size=global_batch).backward()
        optimizer.step()

    data = batches(torch, global_batch)
    for k, (x, y) in enumerate(strategy.experimental_distribute_dataset(data)):
        strategy.run(step, args=(x, y, k))
    return [p.detach().numpy() for p in model.parameters()]
