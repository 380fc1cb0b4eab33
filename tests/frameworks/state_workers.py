"""Worker processes whose optimizers' settings or gradient clearing go apart, or not.

`train(rank, world_size, case, replicas)` trains the helpers' MLP with SGD (momentum) on
the same global batches on every worker, 4 steps, with a learning-rate change or a
`zero_grad()` that one worker makes and the other does not (`case`), and returns the
error (type and text) or the final parameters and the learning rates seen.

The cases that write buffers or the optimizer's state outside `strategy.run` (`BY_HAND`)
train `scaled_mlp` instead: the MLP with a layer holding two buffers, `scale` (read by
the forward, changed by no forward, undeclared) and `peak` (a running maximum that each
replica's forward updates in place or not, depending on its slice: combined by "max").
"""

from __future__ import annotations

from typing import Any

#: What each case does differently on worker 1 (rank 1), at which step.
CASES = (
    "alike",
    "chief_scheduler",
    "lr_by_hand",
    "numpy_lr",
    "skipped_zero_grad",
    "cleared_accumulation",
    "loaded_on_chief",
    "edited_in_place",
    "eval_on_one",
    "frozen_on_one",
    # the reduced gradients changed before the step on worker 1 only (session 56's
    # multi-worker bug hunt: DDP's workers go apart silently too), or on every worker
    "clipped_on_one",
    "grad_none_on_one",
    "clipped_alike",
    # only the last step goes apart (no next pass: the end of the data compares it)
    "clipped_last_on_one",
    "scheduler_last_on_chief",
    # a GradScaler never given to prepare, from step 1, on worker 1 only or on every worker
    "scaler_on_one",
    "scaler_alike",
    # by hand outside run, on worker 1 only (a later multi-worker bug hunt), or on all alike
    "optimizer_loaded_on_one",
    "optimizer_cleared_on_one",
    "optimizer_edited_on_one",
    "buffer_on_one",
    "declared_buffer_on_one",
    "attribute_on_one",
    "forward_on_one",
    "alike_by_hand",
)
#: The cases that train `scaled_mlp` and write buffers or optimizer state by hand.
BY_HAND = frozenset(c for c in CASES[CASES.index("optimizer_loaded_on_one") :])
STEPS = 4
#: The batches before whose backward `zero_grad()` is called, and after which the
#: optimizer steps: batch 2's gradients add to batch 1's (accumulation), and so on.
CLEARS = (0, 1, 3)
STEPPED = (0, 2, 3)


def train(rank: int, world_size: int, case: str, replicas: int) -> dict[str, Any]:
    """Train 4 steps (see the module doc); the error or the parameters and rates."""
    import numpy as np
    import torch

    import crossdevice.torch as cdt
    from tests.frameworks.helpers import (
        GLOBAL_BATCH,
        global_batches,
        global_loss,
        mlp,
        worker_strategy,
    )

    torch.set_default_dtype(torch.float64)
    strategy = worker_strategy(replicas)
    with strategy.scope():
        net = scaled_mlp(torch) if case in BY_HAND else mlp(torch)
        opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
        model, optimizer = cdt.prepare(
            net, opt, buffer_aggregation={"*peak": "max"} if case in BY_HAND else None
        )
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    assert GLOBAL_BATCH % (world_size * replicas) == 0
    odd = rank == 1

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # (prepared by no case)

    def step(x: Any, y: Any, i: int) -> None:
        loss = global_loss(torch, model, x, y)
        if i in CLEARS and not (case == "skipped_zero_grad" and odd and i == 3):
            optimizer.zero_grad()
        if case == "cleared_accumulation" and odd and i == 2:
            model.zero_grad()  # step 1's gradients gone on this worker only
        scaled = i >= 1 and (case == "scaler_alike" or (case == "scaler_on_one" and odd))
        (scaler.scale(loss) if scaled else loss).backward()
        change_gradients(torch, model, case, i, odd)
        if i in STEPPED and scaled:
            scaler.step(optimizer)
            scaler.update()
        elif i in STEPPED:
            optimizer.step()

    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    saved: list[Any] = []
    rates = []
    try:
        for i, (x, y) in enumerate(
            strategy.experimental_distribute_dataset(global_batches(torch, STEPS))
        ):
            strategy.run(step, args=(x, y, i))
            last_apart = case == "scheduler_last_on_chief" and i == STEPS - 1
            if (case != "chief_scheduler" and not last_apart) or rank == 0:
                schedule.step()
            if case == "lr_by_hand" and odd and i == 1:
                optimizer.param_groups[0]["lr"] = 0.3
            if case == "numpy_lr" and i == 1:  # a rate computed with NumPy, per worker
                optimizer.param_groups[0]["lr"] = np.float64(0.3 if odd else 0.2)
            if case == "loaded_on_chief" and rank == 0 and i == 1:
                model.load_state_dict(snapshot)  # DDP's habit: the chief loads, alone
            if case == "edited_in_place" and odd and i == 1:
                with torch.no_grad():
                    model[0].weight.add_(0.1)
            if case == "eval_on_one" and odd and i == 1:
                model.eval()
            if case == "frozen_on_one" and odd and i == 1:
                model[0].bias.requires_grad_(False)
            if case in BY_HAND:
                by_hand(torch, model, optimizer, case, i, odd, replicas, saved)
            rates.append(optimizer.param_groups[0]["lr"])
    except Exception as err:  # the worker's outcome, returned
        return {"error": f"{type(err).__name__}: {err}", "rates": rates}
    params = [p.detach().clone() for p in model.replicas[0].parameters()]
    buffers = [b.detach().clone() for b in model.replicas[0].buffers()]
    predictor = strategy.extended._worker_communicator._integrity.predictor
    return {"params": params, "buffers": buffers, "rates": rates, "guesses": predictor.guesses}


def change_gradients(torch: Any, model: Any, case: str, i: int, odd: bool) -> None:
    """After batch `i`'s backward: what `case` does to the reduced gradients."""
    if case == "clipped_last_on_one" and odd and i == STEPS - 1:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    if i != 0:
        return
    if case == "clipped_alike" or (case == "clipped_on_one" and odd):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    if case == "grad_none_on_one" and odd:
        model[0].bias.grad = None


def scaled_mlp(torch: Any) -> Any:
    """The helpers' MLP with a layer that holds buffers between its layers (module doc)."""
    from tests.frameworks.helpers import mlp

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(8))
            self.register_buffer("peak", torch.zeros(()))

        def forward(self, x: Any) -> Any:
            self.widest = max(getattr(self, "widest", 0), x.shape[0])  # a forward's cache
            if self.training:
                with torch.no_grad():
                    top = x.abs().max()
                    if top > self.peak:  # written in place by some replicas' forwards only
                        self.peak.copy_(top)
            return x * self.scale

    first, act, last = mlp(torch)
    return torch.nn.Sequential(first, act, Scaled(), last)


def by_hand(
    torch: Any,
    model: Any,
    optimizer: Any,
    case: str,
    i: int,
    odd: bool,
    replicas: int,
    saved: list[Any],
) -> None:
    """What `case` writes outside the run after step `i` (all workers, or `odd` only)."""
    import copy

    from tests.frameworks.helpers import GLOBAL_BATCH

    if i == 0:
        saved.append(copy.deepcopy(optimizer.state_dict()))
    if i != 1:
        return
    alike = case == "alike_by_hand"
    if alike or (case == "optimizer_loaded_on_one" and odd):
        optimizer.load_state_dict(saved[0])  # "only one rank resumed the optimizer"
    if case == "optimizer_cleared_on_one" and odd:
        optimizer.state.clear()
    with torch.no_grad():
        if alike or (case == "optimizer_edited_on_one" and odd):
            for entry in optimizer.state.values():
                entry["momentum_buffer"].mul_(0.5)
        if alike or (case == "buffer_on_one" and odd):
            model[2].scale.mul_(1.5)
        if alike or (case == "declared_buffer_on_one" and odd):
            model[2].peak.mul_(0.5)
    if alike or (case == "attribute_on_one" and odd):
        model[1].slope = 0.5  # a plain attribute (a dropout p, a temperature)
    if case == "forward_on_one" and odd:  # an evaluation on one worker: caches only
        model.eval()
        with torch.no_grad():
            model(torch.zeros(GLOBAL_BATCH + 5, 6))
        model.train()


def plain(case: str, replicas: int = 1) -> list[Any]:
    """The `alike` (or `alike_by_hand`, `clipped_alike`) case's parameters (and buffers)
    trained by plain torch on the global batches."""
    import torch

    from tests.frameworks.helpers import global_batches, global_loss, mlp

    assert case in ("alike", "alike_by_hand", "clipped_alike")
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # in the test's own process: restored below
    saved: list[Any] = []
    try:
        net = scaled_mlp(torch) if case in BY_HAND else mlp(torch)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for i, (x, y) in enumerate(global_batches(torch, STEPS)):
            loss = global_loss(torch, net, x, y)
            if i in CLEARS:
                optimizer.zero_grad()
            loss.backward()
            change_gradients(torch, net, case, i, False)
            if i in STEPPED:
                optimizer.step()
            schedule.step()
            if case in BY_HAND:
                by_hand(torch, net, optimizer, case, i, False, replicas, saved)
    finally:
        torch.set_default_dtype(before)
    return [p.detach().clone() for p in net.parameters()] + [
        b.detach().clone() for b in net.buffers()
    ]
