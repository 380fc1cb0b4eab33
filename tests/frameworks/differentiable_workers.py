"""Workers whose differentiable collectives disagree (see test_differentiable_mismatch)."""

from __future__ import annotations

from typing import Any


def mismatched_collective(rank: int, world_size: int, case: str) -> Any:
    """One step whose collectives differ on worker 1 the way `case` says; its result.

    `requires_grad`: worker 0 all-reduces values that require grad, worker 1 the same
    values detached (same shapes, same line). `backward`: both all-reduce values that
    require grad; worker 0 then runs backward through it (an all-reduce of the upstream
    gradients), worker 1 makes a plain all-reduce of the same shapes instead.
    """
    del world_size
    import torch

    import crossdevice

    options = crossdevice.experimental.CommunicationOptions(timeout_seconds=30)
    strategy = crossdevice.MultiWorkerMirroredStrategy(
        devices=["CPU:0"], communication_options=options
    )
    w = torch.ones(2, dtype=torch.float64, requires_grad=True)

    def step() -> Any:
        ctx = crossdevice.get_replica_context()
        if case == "requires_grad":
            t = w * 2
            value = [t, t * 3] if rank == 0 else [t.detach(), (t * 3).detach()]
            return ctx.all_reduce("sum", value)[0].detach()
        reduced = ctx.all_reduce("sum", [w * 2, w * 3])
        if rank == 0:
            reduced[0].sum().backward()
            return w.grad
        plain = [torch.full((2,), 5.0, dtype=torch.float64), torch.ones(2, dtype=torch.float64)]
        return ctx.all_reduce("sum", plain)[0]

    return strategy.run(step).numpy()
