"""Ordinary torch code inside the step function trains what plain torch trains.

Each test compares against plain torch on the same global batches in float64 (replicas
bitwise equal to each other, within 1e-12 of plain torch), on replica threads and on
cooperative replicas: walking `modules()`, stepping an LR scheduler in the step function,
several `backward()` calls per step, the guard against shared modules, `prepare` twice.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

import crossdevice as cd
from tests.frameworks.helpers import (
    assert_mlp_trains_like_plain_torch,
    assert_trains_like,
    global_batches,
    global_loss,
    mirrored,
    mlp,
    replica_batch,
    run_on_replicas,
)
from tests.strategies.conftest import replica_execution

MODES = ["threads", "cooperative"]


pytestmark = pytest.mark.usefixtures("float64")


def _prepared(torch: Any, cdt: Any, strategy: Any, lr: float = 0.5, **kwargs: Any) -> Any:
    with strategy.scope():
        net = mlp(torch)
        return cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9), **kwargs)


def _plain(torch: Any, lr: float = 0.5) -> tuple[Any, Any, list[Any]]:
    model = mlp(torch)
    start = [p.detach().clone() for p in model.parameters()]
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), start


# --- the whole nn.Module surface is the running replica's module -----------------------------
@pytest.mark.parametrize("mode", MODES)
def test_module_surface_is_the_running_replicas_module(torch: Any, cdt: Any, mode: str) -> None:
    with replica_execution(mode):
        strategy = mirrored(4)
        model, _ = _prepared(torch, cdt, strategy)
        own = model.replicas[0]  # cross-replica context: replica 0's, like a MirroredVariable
        assert [type(m).__name__ for m in model.modules()] == [
            "Sequential",
            "Linear",
            "Tanh",
            "Linear",
        ]
        assert next(iter(model.modules())) is own
        assert [name for name, _ in model.named_modules()] == ["", "0", "1", "2"]
        assert model[0] is own[0]
        assert list(model.children()) == list(own.children())
        assert len(model) == 3
        assert list(model) == list(own)
        assert model.get_submodule("2") is own[2]
        assert model.get_parameter("0.weight") is own[0].weight
        assert bool(model)

        def step() -> Any:
            r = cd.get_replica_context().replica_id_in_sync_group
            mine = model.replicas[r]
            return [
                model[0] is mine[0],
                next(iter(model.modules())) is mine,
                list(model.children())[2] is mine[2],
                model.module is mine,
                model.get_submodule("0") is mine[0],
                dict(model.named_modules())["2"] is mine[2],
            ]

        for checks in strategy.experimental_local_results(strategy.run(step)):
            assert checks == [True] * 6


@pytest.mark.parametrize("mode", MODES)
def test_regulariser_over_modules_trains_like_plain_torch(torch: Any, cdt: Any, mode: str) -> None:
    data = global_batches(torch, 5)

    def l2(model: Any) -> Any:
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert len(linears) == 2  # walking modules() finds the layers
        return sum((m.weight**2).sum() for m in linears)

    plain, opt, start = _plain(torch)
    for x, y in data:
        opt.zero_grad()
        (global_loss(torch, plain, x, y) + 0.05 * l2(plain)).backward()
        opt.step()
    with replica_execution(mode):
        strategy = mirrored(4)
        model, optimizer = _prepared(torch, cdt, strategy)

        def step(x: Any, y: Any, i: int) -> None:
            optimizer.zero_grad()
            # Under the SUM rule each replica adds its share of the model-wide term
            # (TF's scale_regularization_loss).
            reg = 0.05 * l2(model) / strategy.num_replicas_in_sync
            (global_loss(torch, model, x, y) + reg).backward()
            optimizer.step()

        run_on_replicas(strategy, step, data)
    assert_trains_like(torch, plain, model, start)


# --- schedulers and other shared stateful objects: once per step ----------------------------
@pytest.mark.parametrize("mode", MODES)
def test_scheduler_stepped_inside_run_steps_once_per_step(torch: Any, cdt: Any, mode: str) -> None:
    data = global_batches(torch, 6)
    plain, opt, start = _plain(torch)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in data:
        opt.zero_grad()
        global_loss(torch, plain, x, y).backward()
        opt.step()
        scheduler.step()
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            net = mlp(torch)
            raw = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
            replica_scheduler = torch.optim.lr_scheduler.StepLR(raw, step_size=1, gamma=0.5)
            model, optimizer = cdt.prepare(net, raw)

        def step(x: Any, y: Any, i: int) -> None:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()
            optimizer.step()
            replica_scheduler.step()  # every replica calls it; it steps once

        run_on_replicas(strategy, step, data)
    assert replica_scheduler.last_epoch == len(data)
    assert optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.5 * 0.5**6
    assert_trains_like(torch, plain, model, start)


@pytest.mark.parametrize("mode", MODES)
def test_plateau_scheduler_takes_one_agreed_metric(torch: Any, cdt: Any, mode: str) -> None:
    with replica_execution(mode):
        strategy = mirrored(4)
        _, optimizer = _prepared(torch, cdt, strategy)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)

        def agreed() -> None:
            metric = torch.tensor(float(cd.get_replica_context().replica_id_in_sync_group))
            plateau.step(cd.get_replica_context().all_reduce("mean", metric))

        for _ in range(3):
            strategy.run(agreed)
        assert plateau.last_epoch == 3  # once per step, not once per replica

        def per_replica() -> None:
            metric = float(cd.get_replica_context().replica_id_in_sync_group)
            plateau.step(metric)

        with pytest.raises(ValueError, match=r"arguments differ: replica 0 passed 0\.0, replica 1"):
            strategy.run(per_replica)
    assert plateau.last_epoch == 3


# --- accumulation over several backward() calls ---------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rule", ["sum", "mean"])
@pytest.mark.parametrize("no_sync", [False, True], ids=["every-backward", "no_sync"])
def test_backward_calls_accumulate_like_plain_torch(
    torch: Any, cdt: Any, mode: str, rule: str, no_sync: bool
) -> None:
    data = global_batches(torch, 4)
    micro = 2  # micro-batches per step, each a backward() of its own

    def loss(model: Any, x: Any, y: Any) -> Any:
        if rule == "sum":
            return global_loss(torch, model, x, y)  # each micro-batch's share of the step
        return torch.nn.functional.cross_entropy(model(x), y) / micro  # DDP's habit

    plain, opt, start = _plain(torch)
    for x, y in data:
        opt.zero_grad()
        for part in range(micro):
            half = slice(part * 8, part * 8 + 8)
            loss(plain, x[half], y[half]).backward()
        opt.step()
    with replica_execution(mode):
        strategy = mirrored(4)
        model, optimizer = _prepared(torch, cdt, strategy, gradient_reduction=rule)

        def step(x: Any, y: Any, i: int) -> None:
            optimizer.zero_grad()
            for part in range(micro):
                piece = slice(part * 2, part * 2 + 2)
                last = part == micro - 1
                if no_sync and not last:
                    with model.no_sync():
                        loss(model, x[piece], y[piece]).backward()
                else:
                    loss(model, x[piece], y[piece]).backward()
            optimizer.step()

        run_on_replicas(strategy, step, data)
    assert_trains_like(torch, plain, model, start)


@pytest.mark.parametrize("mode", MODES)
def test_a_step_never_applies_an_unreduced_gradient(torch: Any, cdt: Any, mode: str) -> None:
    with replica_execution(mode):
        strategy = mirrored(2)
        model, optimizer = _prepared(torch, cdt, strategy)
        x, y = replica_batch(torch)
        before = [p.detach().clone() for p in model.replicas[1].parameters()]

        def only_no_sync() -> None:
            optimizer.zero_grad()
            with model.no_sync():
                global_loss(torch, model, x, y).backward()
            optimizer.step()

        with pytest.raises(RuntimeError, match=r"never reduced it across replicas.*no_sync"):
            strategy.run(only_no_sync)

        def replaced() -> None:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()
            weight = model.module[0].weight
            weight.grad = weight.grad.clamp(-1, 1)  # a new tensor: is it the same everywhere?
            optimizer.step()

        with pytest.raises(RuntimeError, match=r"'0\.weight' was replaced after backward"):
            strategy.run(replaced)
    for a, b in zip(before, model.replicas[1].parameters(), strict=True):
        assert torch.equal(a, b)  # neither step moved anything


# --- the guard tells the truth --------------------------------------------------------------
def test_guard_names_the_module_the_replica_and_the_local_count(torch: Any, cdt: Any) -> None:
    strategy = mirrored(4)
    shared = torch.nn.Linear(3, 1)
    with pytest.raises(
        RuntimeError,
        match=r"module Linear\(in_features=3, out_features=1, bias=True\) has trainable "
        r"parameters and belongs to no replica: replica \d called it, and every one of the "
        r"4 replicas that the MirroredStrategy runs.*mark_replica_copy",
    ):
        strategy.run(lambda: shared(torch.ones(1, 3)))
    # Under no_grad in eval mode it cannot change: sharing it is fine.
    shared.eval()
    with torch.no_grad():
        strategy.run(lambda: shared(torch.ones(1, 3)))


@pytest.mark.parametrize("mode", MODES)
def test_hand_made_replica_copies_pass_once_declared(torch: Any, cdt: Any, mode: str) -> None:
    with replica_execution(mode):
        strategy = mirrored(4)
        net = torch.nn.Linear(3, 1)
        copies = [copy.deepcopy(net) for _ in range(4)]

        def use(shift: int) -> Any:
            def step() -> Any:
                r = cd.get_replica_context().replica_id_in_sync_group
                return copies[(r + shift) % 4](torch.ones(1, 3)).sum()

            return step

        with pytest.raises(RuntimeError, match="mark_replica_copy"):
            strategy.run(use(0))
        for i, module in enumerate(copies):
            assert cdt.mark_replica_copy(module, i, strategy) is module
        assert len(strategy.experimental_local_results(strategy.run(use(0)))) == 4
        with pytest.raises(RuntimeError, match=r"which is replica \d's copy"):
            strategy.run(use(1))
        with pytest.raises(ValueError, match="replica_id must be a local replica"):
            cdt.mark_replica_copy(net, 4, strategy)


def test_prepare_of_a_prepared_model_is_an_error_at_prepare(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        net = mlp(torch)
        model = cdt.prepare(net)
        with pytest.raises(TypeError, match="prepared already"):
            cdt.prepare(model)
        with pytest.raises(ValueError, match=r"replica 0's copy of a model mirrored"):
            cdt.prepare(model.module)
        with pytest.raises(ValueError, match=r"replica 0's copy of a model mirrored"):
            cdt.prepare(net)  # the original became replica 0's copy
        # A new optimizer for a prepared model is what passing it again is for.
        same, optimizer = cdt.prepare(model, torch.optim.Adam(model.parameters()))
    assert same is model
    assert type(optimizer).__name__ == "MirroredOptimizer"


# --- torch.compile compiles the replicas' modules ----------------------------------------------
class _Net:
    """A user-defined module class (torch.compile traces user code, not torch.nn's)."""

    @staticmethod
    def make(torch: Any) -> Any:
        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1 = torch.nn.Linear(6, 8)
                self.fc2 = torch.nn.Linear(8, 3)

            def forward(self, x: Any) -> Any:
                return self.fc2(torch.tanh(self.fc1(x)))

        torch.manual_seed(0)
        return Net()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "mode"),
    [
        ("torch.compile(prepared)", "threads"),
        ("prepare(torch.compile(model))", "threads"),
        ("prepared.compile()", "threads"),
        ("torch.compile(prepared)", "cooperative"),
    ],
)
def test_torch_compile_compiles_the_replicas_and_trains_like_plain_torch(
    torch: Any, cdt: Any, how: str, mode: str
) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    data = global_batches(torch, 3)
    plain = _Net.make(torch)
    start = [p.detach().clone() for p in plain.parameters()]
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    for x, y in data:
        opt.zero_grad()
        global_loss(torch, plain, x, y).backward()
        opt.step()
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            net = _Net.make(torch)
            optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
            if how == "prepare(torch.compile(model))":
                model, optimizer = cdt.prepare(torch.compile(net), optimizer)
                mirrored_model = model
            else:
                mirrored_model, optimizer = cdt.prepare(net, optimizer)
                if how == "prepared.compile()":
                    mirrored_model.compile()
                    model = mirrored_model
                else:
                    model = torch.compile(mirrored_model)

        def step(x: Any, y: Any, i: int) -> None:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()
            optimizer.step()

        run_on_replicas(strategy, step, data)
    assert counters["frames"]["ok"] >= 1, dict(counters["frames"])
    assert counters["stats"]["calls_captured"] >= 3  # both layers and the tanh, in a graph
    # The one break allowed is the designed boundary: the dispatch to the running
    # replica (MirroredModule.forward) runs eagerly, the replica's module compiled.
    breaks = [b for b in counters["graph_break"] if "MirroredModule.forward" not in b]
    assert not breaks, breaks
    assert not counters["unimplemented"], dict(counters["unimplemented"])
    assert_trains_like(torch, plain, mirrored_model, start, tol=1e-9)


@pytest.mark.slow
# torch's own, as dynamo compiles the optimizer's step (plain torch's too):
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("share_storage", [None, False], ids=["default", "copies"])
@pytest.mark.parametrize("mode", MODES)
def test_a_compiled_training_step_trains_like_plain_torch(
    torch: Any, cdt: Any, mode: str, share_storage: Any
) -> None:
    """`@torch.compile` around the whole step (zero_grad, forward, backward, step): dynamo
    traced the patched backward (TypeError on its weak references) and the optimizer's
    zero_grad count (replica 0's index baked in): the bug hunt of session 54. They run
    eagerly now, the replica's module and optimizer step compiled."""
    import torch._dynamo

    torch._dynamo.reset()
    data = global_batches(torch, 3)

    def make_step(model: Any, optimizer: Any) -> Any:
        @torch.compile
        def step(x: Any, y: Any) -> Any:
            optimizer.zero_grad()
            loss = global_loss(torch, model, x, y)
            loss.backward()
            optimizer.step()
            return loss.detach()

        return step

    plain = _Net.make(torch)
    start = [p.detach().clone() for p in plain.parameters()]
    plain_step = make_step(plain, torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9))
    for x, y in data:
        plain_step(x, y)
    with replica_execution(mode):
        strategy = mirrored(2)
        with strategy.scope():
            net = _Net.make(torch)
            sgd = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
            model, optimizer = cdt.prepare(net, sgd, share_storage=share_storage)
        step = make_step(model, optimizer)
        for x, y in strategy.experimental_distribute_dataset(data):
            strategy.run(step, args=(x, y))
    assert_trains_like(torch, plain, model, start, tol=1e-9)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("unscale", [True, False], ids=["unscale", "step"])
def test_a_grad_scaler_not_prepared_is_an_error_naming_prepare(
    torch: Any, cdt: Any, mode: str, unscale: bool
) -> None:
    """A GradScaler left out of `prepare`, shared by the replicas, failed inside torch
    ("No inf checks were recorded prior to update", "unscale_() has already been
    called"), by the replicas' timing; now its first call in the step names the fix."""
    data = global_batches(torch, 1)
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            net = mlp(torch)
            model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
            scaler = torch.amp.GradScaler("cpu")

        def step(x: Any, y: Any) -> None:
            optimizer.zero_grad()
            scaler.scale(global_loss(torch, model, x, y)).backward()
            if unscale:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()

        called = "unscale_" if unscale else "step"
        with pytest.raises(RuntimeError, match=rf"GradScaler\.{called}\(\) .* not prepared"):
            run_on_replicas(strategy, lambda x, y, i: step(x, y), data)


@pytest.mark.parametrize("mode", MODES)
def test_a_disabled_grad_scaler_needs_no_prepare(torch: Any, cdt: Any, mode: str) -> None:
    """`GradScaler(enabled=use_amp)` with AMP off does nothing: shared, it trains alike."""
    torch.set_default_dtype(torch.float64)
    data = global_batches(torch, 3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        optimizer.zero_grad()
        scaler.scale(global_loss(torch, model, x, y)).backward()
        scaler.step(optimizer)
        scaler.update()

    assert_mlp_trains_like_plain_torch(torch, cdt, mode, data, step)
