"""Training whose replicas write their parameters (or accumulated gradients) in place.

`train_on(strategy, case, storage)` trains the helpers' MLP with SGD (momentum) on the
same global batches, `STEPS` steps, and returns the error or each local replica's
parameters. In the parameter cases every replica writes every parameter in place inside
`strategy.run` besides the optimizer's step (`write`: one write per parameter on every
replica, so the replicas' counts of writes agree); in the gradient cases (`GRADIENT`)
each replica accumulates two backward passes and then changes its gradients
(`edit`). `train(rank, world_size, case, replicas, storage)` does it in a worker
process of a `MultiWorkerMirroredStrategy`; `plain(case)` is plain torch's result.
"""

from __future__ import annotations

from typing import Any

#: Parameter writes that leave the same bits on every replica and worker.
ALIKE = ("clamp", "clamp_before", "decay", "seeded")
#: Parameter writes from each replica's own random stream: an error.
NOISE = ("noise", "noise_last", "noise_no_sync")
#: Changes to the gradients after accumulation: replica 1 alone zeroes its gradients,
#: or each replica adds its own noise (errors); every replica halves them alike.
GRADIENT = ("grad_zero_on_1", "grad_noise", "grad_mul")
STEPS = 3


def write(torch: Any, model: Any, case: str, i: int) -> None:
    """Step `i`'s in-place write to `model`'s parameters (on plain torch, once)."""
    if case == "none":  # the optimizer's step alone
        return
    generator = torch.Generator().manual_seed(2000 + i)
    with torch.no_grad():
        for p in model.parameters():
            if case.startswith("noise"):  # each replica's (and worker's) own random stream
                if case != "noise_last" or i == STEPS - 1:
                    p.add_(torch.randn_like(p), alpha=0.01)
            elif case.startswith("clamp"):  # WGAN's weight clipping
                p.clamp_(-0.3, 0.3)
            elif case == "decay":
                p.mul_(0.99)
            else:
                assert case == "seeded"  # a generator seeded alike on every replica
                noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
                p.add_(noise, alpha=0.01)


def edit(torch: Any, model: Any, case: str) -> None:
    """A gradient case's change to `model`'s accumulated gradients (plain torch: none)."""
    import crossdevice as cd

    ctx = cd.get_replica_context()
    replica = 0 if ctx is None else ctx.replica_id_in_sync_group
    for p in model.parameters():
        if case == "grad_zero_on_1" and replica == 1:
            p.grad.mul_(0)
        elif case == "grad_noise":
            p.grad.add_(torch.randn_like(p.grad), alpha=0.01)
        elif case == "grad_mul":
            p.grad.mul_(0.5)


def _backward(torch: Any, model: Any, case: str, x: Any, y: Any) -> None:
    """The step's backward passes: two (accumulated) in the gradient cases."""
    from tests.frameworks.helpers import global_loss

    if case in GRADIENT or case == "noise_no_sync":
        half = len(x) // 2
        if case == "noise_no_sync":  # the first accumulates only, the second reduces
            with model.no_sync():
                global_loss(torch, model, x[:half], y[:half]).backward()
        else:
            global_loss(torch, model, x[:half], y[:half]).backward()
        global_loss(torch, model, x[half:], y[half:]).backward()
        return
    global_loss(torch, model, x, y).backward()


def train_on(strategy: Any, case: str, storage: str) -> dict[str, Any]:
    """Train on `strategy` (see the module doc); the error, or each replica's parameters.

    `storage`: "copies" (`share_storage=False`) or "shared". With shared storage a
    parameter written in place inside `run` is refused: the writes alike on every
    replica are made once, in `call_once`.
    """
    import torch

    import crossdevice.torch as cdt
    from tests.frameworks.helpers import global_batches, mlp, steps_outcome

    with strategy.scope():
        net = mlp(torch)
        sgd = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
        model, optimizer = cdt.prepare(net, sgd, share_storage=storage == "shared")
    once = storage == "shared" and case in ALIKE

    def writes(i: int) -> None:
        if once:
            cdt.call_once(lambda: write(torch, model, case, i))
        else:
            write(torch, model, case, i)

    def step(x: Any, y: Any, i: int) -> None:
        optimizer.zero_grad()
        _backward(torch, model, case, x, y)
        if case in GRADIENT:
            edit(torch, model, case)
        elif case == "clamp_before":
            writes(i)
        optimizer.step()
        if case not in GRADIENT and case != "clamp_before":
            writes(i)

    return steps_outcome(strategy, step, model, global_batches(torch, STEPS))


def train(rank: int, world_size: int, case: str, replicas: int, storage: str) -> dict[str, Any]:
    """`train_on` in worker `rank` of `world_size`, with `replicas` local replicas."""
    del rank, world_size
    import torch

    from tests.frameworks.helpers import worker_strategy

    torch.set_default_dtype(torch.float64)
    return train_on(worker_strategy(replicas), case, storage)


def plain(case: str) -> list[Any]:
    """Plain torch's parameters after the same training (each write once per step)."""
    from tests.frameworks.helpers import plain_sgd

    def before_step(torch: Any, net: Any, i: int) -> None:
        if case == "grad_mul":
            for p in net.parameters():
                p.grad.mul_(0.5)
        if case == "clamp_before":
            write(torch, net, case, i)

    def after_step(torch: Any, net: Any, i: int) -> None:
        if case in (*ALIKE, "none") and case != "clamp_before":
            write(torch, net, case, i)

    return plain_sgd(STEPS, before_step, after_step)
