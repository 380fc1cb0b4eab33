"""Checkpoints of torch state: DCP on disk, mirrored modules, schedulers, bad restores."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from tests.frameworks.helpers import bn_dropout_model, mirrored

pytestmark = pytest.mark.torch


def _prepared(torch: Any, strategy: Any, seed: int = 0) -> tuple[Any, Any]:
    import crossdevice.torch as cdt

    torch.manual_seed(seed)
    with strategy.scope():
        model = bn_dropout_model(torch)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        return cdt.prepare(model, optimizer)


def _batches(torch: Any, steps: int) -> list[tuple[Any, Any]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(8, 1, 8, 8, generator=generator),
            torch.randint(0, 10, (8,), generator=generator),
        )
        for _ in range(steps)
    ]


def _train(
    torch: Any, strategy: Any, model: Any, optimizer: Any, batches: Any, scheduler: Any = None
) -> None:
    import crossdevice.torch as cdt

    def step(x: Any, y: Any) -> None:
        losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        optimizer.zero_grad()
        cdt.compute_average_loss(losses, global_batch_size=8).backward()
        optimizer.step()

    for x, y in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(x, y))
        if scheduler is not None:
            scheduler.step()


def test_torch_state_is_written_as_dcp_that_torch_reads(torch_module: Any, tmp_path: Path) -> None:
    torch = torch_module
    import torch.distributed.checkpoint as dcp

    strategy = mirrored(2)
    model, optimizer = _prepared(torch, strategy)
    _train(torch, strategy, model, optimizer, _batches(torch, 2))
    step = cd.Variable(np.int64(2))
    ckpt = cd.train.Checkpoint(model=model, optimizer=optimizer, step=step)
    path = Path(ckpt.save(tmp_path / "ckpt"))
    ckpt.sync()
    assert {p.name for p in path.iterdir()} == {".metadata", "__0_0.distcp", "crossdevice.json"}
    index = json.loads((path / "crossdevice.json").read_text())
    assert index["storage"] == "dcp"
    assert index["arrays"]["step"] == {"shape": [], "dtype": "int64", "lib": "numpy"}
    # A torch user loads the model's tensors from it by their usual names, with DCP.
    plain = bn_dropout_model(torch)
    state = {"model": plain.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # DCP's "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=str(path))
    for name, value in model.state_dict().items():
        assert torch.equal(state["model"][name], value), name
    step.assign(0)
    ckpt.restore(path).assert_consumed()  # a 0-d NumPy value comes back 0-d from DCP
    assert int(step.numpy()) == 2


@pytest.mark.parametrize("mode", ["threads", "cooperative"])
def test_training_continues_bitwise_after_a_restore(
    torch_module: Any, tmp_path: Path, mode: str
) -> None:
    from tests.strategies.conftest import replica_execution

    torch = torch_module
    batches = _batches(torch, 6)
    with replica_execution(mode):
        strategy = mirrored(2)
        model, optimizer = _prepared(torch, strategy)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        ckpt = cd.train.Checkpoint(model=model, optimizer=optimizer, scheduler=scheduler)
        _train(torch, strategy, model, optimizer, batches[:3], scheduler)
        torch.manual_seed(11)  # dropout draws from here on depend on it
        path = ckpt.save(tmp_path / "ckpt")
        _train(torch, strategy, model, optimizer, batches[3:], scheduler)
        expected = {k: v.clone() for k, v in model.state_dict().items()}

        other = mirrored(2)
        model2, optimizer2 = _prepared(torch, other, seed=5)  # other initial values
        scheduler2 = torch.optim.lr_scheduler.StepLR(optimizer2, step_size=2, gamma=0.5)
        cd.train.Checkpoint(model=model2, optimizer=optimizer2, scheduler=scheduler2).restore(
            path
        ).assert_consumed()
        assert scheduler2.last_epoch == 3
        _train(torch, other, model2, optimizer2, batches[3:], scheduler2)
    for name, value in model2.state_dict().items():
        assert torch.equal(value, expected[name]), name
    for replica in model2.replicas:
        for name, value in replica.state_dict().items():
            assert torch.equal(value, expected[name]), name


def test_grad_scaler_and_plain_modules_round_trip(torch_module: Any, tmp_path: Path) -> None:
    torch = torch_module
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    linear = torch.nn.Linear(3, 2)
    generator = torch.Generator().manual_seed(4)
    ckpt = cd.train.Checkpoint(scaler=scaler, linear=linear, generator=generator)
    path = ckpt.write(tmp_path / "w")
    expected = torch.rand(3, generator=generator)
    weight = linear.weight.detach().clone()
    with torch.no_grad():
        linear.weight.zero_()
    scaler.scale(torch.ones(1))  # makes its scale tensor
    scaler.update(new_scale=7.0)
    ckpt.read(path).assert_consumed()
    assert scaler.get_scale() == 1024.0
    assert torch.equal(linear.weight, weight)
    assert torch.equal(torch.rand(3, generator=generator), expected)


def test_restoring_into_a_model_of_another_shape_names_the_key(
    torch_module: Any, tmp_path: Path
) -> None:
    torch = torch_module
    ckpt = cd.train.Checkpoint(model=torch.nn.Linear(4, 3), bias=cd.Variable(1.0))
    path = ckpt.write(tmp_path / "c")
    other = torch.nn.Linear(5, 3)
    before = other.weight.detach().clone()
    bias = cd.Variable(9.0)
    with pytest.raises(
        ValueError,
        match=r"cannot restore model.weight: the checkpoint holds shape \(3, 4\) dtype float32, "
        r"the module has shape \(3, 5\)",
    ):
        cd.train.Checkpoint(bias=bias, model=other).read(path)
    assert torch.equal(other.weight, before)
    assert float(bias.numpy()) == 9.0
    deeper = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['0.bias', '0.weight'\]"):
        cd.train.Checkpoint(model=deeper).read(path)


def test_a_truncated_dcp_file_is_refused(torch_module: Any, tmp_path: Path) -> None:
    ckpt = cd.train.Checkpoint(model=torch_module.nn.Linear(64, 64))
    path = Path(ckpt.write(tmp_path / "c"))
    ckpt.sync()
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"truncated or damaged: '__0_0.distcp' has 1000 bytes"):
        ckpt.read(path)


def test_a_shuffling_dataloader_resumes_its_epoch_on_another_layout(
    torch_module: Any, tmp_path: Path
) -> None:
    torch = torch_module
    ids = torch.arange(48)
    loader = torch.utils.data.DataLoader(ids, batch_size=8, shuffle=True)
    torch.manual_seed(0)
    strategy = mirrored(4)
    dist = strategy.experimental_distribute_dataset(loader)
    ckpt = cd.train.Checkpoint(data=dist)
    it = iter(dist)
    seen = [torch.cat(strategy.experimental_local_results(next(it))) for _ in range(2)]
    path = ckpt.save(tmp_path / "ckpt")
    rest = [torch.cat(strategy.experimental_local_results(step)) for step in it]

    torch.manual_seed(99)
    other = mirrored(2)
    again = other.experimental_distribute_dataset(loader)
    cd.train.Checkpoint(data=again).restore(path)
    resumed = [torch.cat(other.experimental_local_results(step)) for step in again]
    assert [t.tolist() for t in resumed] == [t.tolist() for t in rest]
    assert sorted(torch.cat(seen + resumed).tolist()) == list(range(48))


def test_a_mirrored_grad_scaler_round_trips_on_every_replica(
    torch_module: Any, tmp_path: Path
) -> None:
    import crossdevice.torch as cdt

    torch = torch_module
    strategy = mirrored(2)
    with strategy.scope():
        net = torch.nn.Linear(3, 2)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
        model, optimizer, scaler = cdt.prepare(net, torch.optim.Adam(net.parameters()), scaler)
    assert model.shares_storage

    def step() -> None:
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()  # grows the scale every step (growth_interval=1)

    for _ in range(3):
        strategy.run(step)
    ckpt = cd.train.Checkpoint(model=model, optimizer=optimizer, scaler=scaler)
    path = ckpt.write(tmp_path / "s")
    saved = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        strategy.run(step)
    assert strategy.experimental_local_results(strategy.run(scaler.get_scale)) == (65536.0,) * 2
    ckpt.read(path).assert_consumed()
    assert strategy.experimental_local_results(strategy.run(scaler.get_scale)) == (8192.0,) * 2
    for replica in model.replicas:
        for value, expected in zip(replica.parameters(), saved, strict=True):
            assert torch.equal(value, expected)


def test_an_optimizer_restores_only_into_its_own_class(torch_module: Any, tmp_path: Path) -> None:
    # torch's load_state_dict takes another class's state silently: Adam's into AdamW
    # replaces its weight_decay 0.01 by 0, Adam's into SGD fails at the first step.
    torch = torch_module
    strategy = mirrored(2)
    model, optimizer = _prepared(torch, strategy)
    _train(torch, strategy, model, optimizer, _batches(torch, 1))
    ckpt = cd.train.Checkpoint(model=model, optimizer=optimizer)
    path = Path(ckpt.write(tmp_path / "c"))
    ckpt.sync()
    index = json.loads((path / "crossdevice.json").read_text())
    assert index["objects"]["optimizer"]["optimizer_class"] == "torch.optim.adam.Adam"

    def restore(make: Any) -> Any:
        torch.manual_seed(1)
        net = bn_dropout_model(torch)
        before = [p.detach().clone() for p in net.parameters()]
        opt = make(net.parameters())
        ckpt = cd.train.Checkpoint(model=net, optimizer=opt)
        try:
            status = ckpt.read(path)
        except ValueError:  # a refused restore loads nothing, not even the model
            assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
            raise
        return status, opt

    for make, name in [
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "torch.optim.sgd.SGD"),
        (lambda p: torch.optim.AdamW(p, lr=1e-2), "torch.optim.adamw.AdamW"),
    ]:
        with pytest.raises(
            ValueError,
            match=rf"cannot restore the optimizer 'optimizer': the checkpoint holds the state of "
            rf"a torch.optim.adam.Adam, and the tracked optimizer is a {name}; .* Build the "
            r"optimizer as it was when the checkpoint was written",
        ):
            restore(make)
    status, adam = restore(lambda p: torch.optim.Adam(p, lr=1e-2))
    status.assert_consumed()
    assert adam.state_dict()["state"][0]["step"] == 1
    assert "optimizer_class" not in adam.state_dict()

    # Checkpoints of older versions name no class: a key the optimizer needs and the
    # checkpoint lacks tells another class. Keys only the checkpoint has are no mismatch
    # (a scheduler's initial_lr, restored before the scheduler is made).
    del index["objects"]["optimizer"]["optimizer_class"]
    index["objects"]["optimizer"]["param_groups"][0]["initial_lr"] = 1e-2
    (path / "crossdevice.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError,
        match=r"its param group 0 needs \['dampening', 'momentum', 'nesterov'\], which the "
        r"checkpoint's lacks \(it holds an optimizer of a class not recorded, with "
        r"\['amsgrad', 'betas', ",
    ):
        restore(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    status, adam = restore(lambda p: torch.optim.Adam(p, lr=1e-2))
    status.assert_consumed()
    assert adam.param_groups[0]["initial_lr"] == 1e-2

    def two_groups(params: Any) -> Any:
        params = list(params)
        return torch.optim.Adam([{"params": params[:1]}, {"params": params[1:]}])

    with pytest.raises(
        ValueError, match=r"the checkpoint holds 1 param groups, the optimizer has 2"
    ):
        restore(two_groups)


def test_an_lr_scheduler_restores_only_into_its_own_class(
    torch_module: Any, tmp_path: Path
) -> None:
    # torch's LRScheduler.load_state_dict copies any state into its attributes: a
    # CosineAnnealingLR given StepLR's keeps its T_max and gains a stray step_size.
    torch = torch_module
    schedulers = torch.optim.lr_scheduler
    strategy = mirrored(2)
    model, optimizer = _prepared(torch, strategy)
    scheduler = schedulers.StepLR(optimizer, step_size=2, gamma=0.5)
    _train(torch, strategy, model, optimizer, _batches(torch, 3), scheduler)
    ckpt = cd.train.Checkpoint(model=model, optimizer=optimizer, sched=scheduler)
    path = Path(ckpt.write(tmp_path / "c"))
    ckpt.sync()

    def restore(make: Any) -> Any:
        model, optimizer = _prepared(torch, strategy, seed=1)
        before = [p.detach().clone() for p in model.parameters()]
        sched = make(optimizer)
        state = sched.state_dict()
        try:
            cd.train.Checkpoint(model=model, optimizer=optimizer, sched=sched).read(path)
        except ValueError:  # a refused restore loads nothing: model and scheduler as built
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            assert sched.state_dict() == state
            raise
        return sched

    for make, name in [
        (lambda o: schedulers.CosineAnnealingLR(o, T_max=10), "CosineAnnealingLR"),
        (schedulers.ReduceLROnPlateau, "ReduceLROnPlateau"),
    ]:
        with pytest.raises(
            ValueError,
            match=rf"cannot restore the LR scheduler 'sched': the checkpoint holds the state of "
            rf"a torch.optim.lr_scheduler.StepLR, and the tracked scheduler is a "
            rf"torch.optim.lr_scheduler.{name}; .* Build the scheduler as it was",
        ):
            restore(make)
    restored = restore(lambda o: schedulers.StepLR(o, step_size=5))
    assert restored.state_dict() == scheduler.state_dict()
    assert restored.step_size == 2
    assert not hasattr(restored, "scheduler_class")

    # Checkpoints of older versions name no class: not checked, loaded as before.
    index = json.loads((path / "crossdevice.json").read_text())
    del index["objects"]["sched"]["scheduler_class"]
    (path / "crossdevice.json").write_text(json.dumps(index))
    assert restore(lambda o: schedulers.StepLR(o, step_size=5)).step_size == 2
