"""Training whose reduced gradients each replica edits alike in count, maybe not in value.

`train_on(strategy, case, storage)` trains the helpers' MLP with SGD (momentum) on the
same global batches, `STEPS` steps; between backward and `step()` every replica edits
its reduced gradients (`edit`, one in-place write per gradient on every replica, so the
replicas' counts of changes agree). It returns the error or each local replica's
parameters. `train(rank, world_size, case, replicas, storage)` does it in a worker
process of a `MultiWorkerMirroredStrategy`; `plain(case)` is plain torch's result.
"""

from __future__ import annotations

from typing import Any

#: What every replica does to its reduced gradients after backward (`edit`).
CASES = ("noise", "scale", "clip", "mul", "seeded")
#: The cases whose edits differ between replicas: an error.
APART = ("noise", "scale")
STEPS = 3


def edit(torch: Any, model: Any, case: str, i: int) -> None:
    """Step `i`'s change to `model`'s reduced gradients (on plain torch: replica 0's)."""
    import crossdevice as cd

    ctx = cd.get_replica_context()
    replica = 0 if ctx is None else ctx.replica_id_in_sync_group
    if case == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        return
    generator = torch.Generator().manual_seed(1000 + i)
    for p in model.parameters():
        if case == "noise":  # each replica's own random stream
            p.grad.add_(torch.randn_like(p.grad), alpha=0.01)
        elif case == "scale":  # a scale that depends on the (global) replica
            p.grad.mul_(1.0 + 0.25 * replica)
        elif case == "mul":
            p.grad.mul_(0.5)
        else:
            assert case == "seeded"  # a generator seeded alike on every replica
            noise = torch.randn(p.grad.shape, generator=generator, dtype=p.grad.dtype)
            p.grad.add_(noise, alpha=0.01)


def train_on(strategy: Any, case: str, storage: str) -> dict[str, Any]:
    """Train on `strategy` (see the module doc); the error, or each replica's parameters.

    `storage`: "copies" (`share_storage=False`) or "shared". With shared storage the
    replicas keep one reduced gradient, and an in-place change that every replica makes
    would land on it once per replica: the alike edits other than torch's clipping
    (which runs once there) are made in `call_once`.
    """
    import torch

    import crossdevice.torch as cdt
    from tests.frameworks.helpers import global_batches, global_loss, mlp, steps_outcome

    with strategy.scope():
        net = mlp(torch)
        sgd = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
        model, optimizer = cdt.prepare(net, sgd, share_storage=storage == "shared")
    once = storage == "shared" and case in ("mul", "seeded")

    def step(x: Any, y: Any, i: int) -> None:
        optimizer.zero_grad()
        global_loss(torch, model, x, y).backward()
        if once:
            cdt.call_once(lambda: edit(torch, model, case, i))
        else:
            edit(torch, model, case, i)
        optimizer.step()

    return steps_outcome(strategy, step, model, global_batches(torch, STEPS))


def train(rank: int, world_size: int, case: str, replicas: int, storage: str) -> dict[str, Any]:
    """`train_on` in worker `rank` of `world_size`, with `replicas` local replicas."""
    del rank, world_size
    import torch

    from tests.frameworks.helpers import worker_strategy

    torch.set_default_dtype(torch.float64)
    return train_on(worker_strategy(replicas), case, storage)


def plain(case: str) -> list[Any]:
    """Plain torch's parameters after the same training (one edit per step)."""
    from tests.frameworks.helpers import plain_sgd

    return plain_sgd(STEPS, lambda torch, net, i: edit(torch, net, case, i))
