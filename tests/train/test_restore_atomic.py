"""A restore that fails changes nothing: every tracked object is bitwise as it was.

Two lines of defence, tested apart: the checks before the first load (`trackable.validate`)
refuse what a load would fail on; a load that fails anyway (injected here) is undone
(`rollback.snapshot`), the objects loaded before it and the failing one itself.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._arrays import global_random
from tests.frameworks.helpers import global_batches, global_loss, mirrored, mlp
from tests.multi_worker.harness import run_workers
from tests.train.helpers import Holder

pytestmark = pytest.mark.torch


# --- what "unchanged" means -------------------------------------------------------------
def _state(obj: Any) -> Any:
    """A deep copy of everything a restore may write in `obj` (each replica's own)."""
    import torch

    if isinstance(obj, cd.Variable):
        return [np.array(v.numpy()) for v in getattr(obj, "values", (obj,))]
    if isinstance(obj, torch.nn.Module):
        replicas = getattr(obj, "replicas", (obj,))
        return [
            {k: v.detach().clone() for k, v in r.state_dict(keep_vars=True).items()}
            for r in replicas
        ]
    if isinstance(obj, torch.optim.Optimizer):
        replicas = getattr(obj, "replicas", (obj,))
        return [
            (
                [copy.deepcopy(r.state[p]) for g in r.param_groups for p in g["params"]],
                [
                    {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                    for g in r.param_groups
                ],
                [[id(p) for p in g["params"]] for g in r.param_groups],
            )
            for r in replicas
        ]
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, np.random.Generator):
        return copy.deepcopy(obj.bit_generator.state)
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):  # its attributes, inner ones'
        return copy.deepcopy(obj.state_dict()), sorted(vars(obj))
    if hasattr(obj, "epoch"):  # a distributed dataset or iterator
        return obj.state_dict(), obj.epoch
    if isinstance(obj, list | tuple):
        return [_state(item) for item in obj]
    if isinstance(obj, dict):
        return {key: _state(item) for key, item in obj.items()}
    return copy.deepcopy(obj.state_dict())


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _everything(ckpt: Any) -> dict[str, Any]:
    """Each tracked object's state, the global random state and `save_counter`."""
    state = {name: _state(obj) for name, obj in ckpt._objects.items()}
    return {**state, "random": global_random.capture(), "save_counter": ckpt.save_counter.numpy()}


def _assert_unchanged(ckpt: Any, before: dict[str, Any]) -> None:
    after = _everything(ckpt)
    changed = [name for name in before if not _same(before[name], after[name])]
    assert not changed, f"a failed restore changed {changed}"


# --- the objects --------------------------------------------------------------------------
def _stepped_adam(torch: Any, model: Any, features: int) -> Any:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, features)).sum().backward()
    optimizer.step()
    return optimizer


def _loader(torch: Any, seed: int) -> Any:
    data = torch.utils.data.TensorDataset(torch.arange(24.0)[:, None])
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=generator)


def _objects(torch: Any, seed: int, strategy: Any) -> dict[str, Any]:
    """One of each kind, in a state that depends on `seed`; the dataset read part way."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1 + seed)
    model(torch.randn(5, 4)).sum().backward()  # BatchNorm's running stats move too
    optimizer.step()
    scheduler.step()
    data = strategy.experimental_distribute_dataset(_loader(torch, seed))
    for _, _ in zip(range(1 + seed % 3), data, strict=False):
        pass
    return {
        "v": cd.Variable(np.full(3, seed, np.float32)),
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "gen": torch.Generator().manual_seed(seed),
        "rng": np.random.default_rng(seed),
        "data": data,
        "iterator": iter(strategy.experimental_distribute_dataset(_loader(torch, seed))),
        "group": {"w": cd.Variable(np.float32(seed)), "list": [torch.nn.Linear(2, 2)]},
    }


class FailsOnce(Holder):
    """Writes the state it is given, then fails, once: a load no check can foresee."""

    failures = 1

    def load_state_dict(self, state: Any) -> None:
        self.state = state
        if FailsOnce.failures:
            FailsOnce.failures -= 1
            raise RuntimeError("the injected failure")


def _chained(torch: Any, length: int) -> Any:
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    steps = [torch.optim.lr_scheduler.StepLR(optimizer, 2) for _ in range(length)]
    return torch.optim.lr_scheduler.ChainedScheduler(steps)


# --- 1. refused by the checks, before the first load --------------------------------------
def _bad_cases(torch: Any, strategy: Any) -> list[tuple[str, dict[str, Any], dict[str, Any], str]]:
    """(id, what was saved, what restores it, the error) for checks run before any load."""
    lin = torch.nn.Linear
    sgd = torch.optim.SGD
    two_groups = lin(4, 3)
    started = iter(strategy.experimental_distribute_dataset([np.arange(4.0)] * 3))
    next(started)
    return [
        (
            "a later layer changed shape",
            {"m": torch.nn.Sequential(lin(4, 3), lin(3, 2))},
            {"m": torch.nn.Sequential(lin(4, 3), lin(3, 5))},
            r"cannot restore m.1.weight: the checkpoint holds shape \(2, 3\)",
        ),
        (
            "Adam state of another model",
            {"o": _stepped_adam(torch, lin(4, 3), 4)},
            {"o": _stepped_adam(torch, lin(5, 2), 5)},
            r"its state 'exp_avg' of parameter 0 has shape \(3, 4\) in the checkpoint, and "
            r"that parameter \(shape \(2, 5\)\) takes \(2, 5\)",
        ),
        (
            "Adam state of another model, into a fresh Adam",
            {"o": _stepped_adam(torch, lin(4, 3), 4)},
            {"o": torch.optim.Adam(lin(5, 2).parameters())},
            r"'exp_avg' of parameter 0 has shape \(3, 4\)",
        ),
        (
            "another number of param groups",
            {"o": sgd([{"params": [two_groups.weight]}, {"params": [two_groups.bias]}], lr=1.0)},
            {"o": sgd(lin(4, 3).parameters(), lr=1.0)},
            r"the checkpoint holds 2 param groups, the optimizer has 1",
        ),
        (
            "a dtype that cannot cast",
            {"b": cd.Variable(np.complex64(1j))},
            {"b": cd.Variable(np.float32(2.0))},
            r"dtype complex64, and the variable .* dtype float32",
        ),
        (
            "a module entry saved as a NumPy array",
            {"m": Holder({"weight": torch.ones(3, 4), "bias": np.ones(3, np.float32)})},
            {"m": lin(4, 3)},
            r"cannot restore m.bias: the checkpoint holds a ndarray there, the module a Tensor",
        ),
        (
            "a torch.Generator state of another size",
            {"g": Holder(torch.zeros(10, dtype=torch.uint8))},
            {"g": torch.Generator().manual_seed(1)},
            r"cannot restore 'g': its saved state does not load into a torch.Generator",
        ),
        (
            "a damaged numpy Generator state",
            {"g": Holder({"bit_generator": "PCG64", "state": {"state": 1}})},
            {"g": np.random.default_rng(1)},
            r"does not load into a numpy Generator like the tracked one \(KeyError: 'inc'\)",
        ),
        (
            "a damaged ReduceLROnPlateau",
            {"s": Holder({"mode": "lowest", "threshold": 0.1, "threshold_mode": "rel"})},
            {"s": torch.optim.lr_scheduler.ReduceLROnPlateau(sgd(lin(2, 2).parameters()))},
            r"ReduceLROnPlateau like the tracked one \(ValueError: mode lowest is unknown!\)",
        ),
        (
            "a chained scheduler of another length",
            {"s": _chained(torch, 2)},
            {"s": _chained(torch, 3)},
            r"the checkpoint holds 2 inner schedulers, the tracked one chains 3",
        ),
        (
            "a corrupt data position",
            {"it": Holder({**started.state_dict(), "steps": -1})},
            {"it": iter(strategy.experimental_distribute_dataset([np.arange(4.0)] * 3))},
            r"the data position 'it': the saved data position's 'steps' must be an int >= 0",
        ),
        (
            "an iterator that has started",
            {"it": started},
            {"it": started},
            r"the tracked iterator has handed out 1 steps already",
        ),
        (
            "a variable of another shape",
            {"b": cd.Variable(np.zeros(3, np.float32))},
            {"b": cd.Variable(np.zeros(4, np.float32))},
            r"cannot restore 'b': the checkpoint holds shape \(3,\) dtype float32",
        ),
    ]


_CASES = [
    "a later layer changed shape",
    "Adam state of another model",
    "Adam state of another model, into a fresh Adam",
    "another number of param groups",
    "a dtype that cannot cast",
    "a module entry saved as a NumPy array",
    "a torch.Generator state of another size",
    "a damaged numpy Generator state",
    "a damaged ReduceLROnPlateau",
    "a chained scheduler of another length",
    "a corrupt data position",
    "an iterator that has started",
    "a variable of another shape",
]


@pytest.mark.parametrize("case", _CASES)
def test_every_check_refuses_before_the_first_load(
    torch_module: Any, tmp_path: Path, case: str
) -> None:
    torch = torch_module
    strategy = mirrored(2)
    cases = {name: rest for name, *rest in _bad_cases(torch, strategy)}
    assert sorted(cases) == sorted(_CASES)
    saved, restoring, error = cases[case]
    # The bad object last, after objects that load fine: none of them may change.
    path = cd.train.Checkpoint(**_objects(torch, 1, strategy), **saved).write(tmp_path / "c")
    ckpt = cd.train.Checkpoint(**_objects(torch, 2, strategy), **restoring)
    before = _everything(ckpt)
    # Whatever the error, nothing may change (checked first); then it must be the check's.
    with pytest.raises(Exception) as caught:  # noqa: PT011 (its type is asserted below)
        ckpt.read(path)
    _assert_unchanged(ckpt, before)
    assert caught.type is ValueError, caught.value
    assert re.search(error, str(caught.value)), caught.value
    assert caught.value.__notes__ == [
        f"The checkpoint {path!r} was not restored: nothing was changed."
    ]


def test_a_prepared_model_of_another_shape_changes_no_replica(
    torch_module: Any, tmp_path: Path
) -> None:
    import crossdevice.torch as cdt

    torch = torch_module
    strategy = mirrored(2)

    def prepared(out: int) -> tuple[Any, Any]:
        with strategy.scope():
            net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, out))
            return cdt.prepare(net, torch.optim.Adam(net.parameters(), lr=0.1))

    model, optimizer = prepared(2)
    path = cd.train.Checkpoint(model=model, optimizer=optimizer).write(tmp_path / "c")
    other, other_optimizer = prepared(5)
    ckpt = cd.train.Checkpoint(optimizer=other_optimizer, model=other)
    before = _everything(ckpt)
    with pytest.raises(ValueError, match=r"cannot restore model.1.weight"):
        ckpt.read(path)
    _assert_unchanged(ckpt, before)


# --- 2. a load that fails anyway is undone ---------------------------------------------------
def test_a_load_that_fails_puts_back_every_object_loaded_before_it(
    torch_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = torch_module
    strategy = mirrored(2)
    path = cd.train.Checkpoint(**_objects(torch, 1, strategy), last=Holder(7)).write(tmp_path / "c")
    ckpt = cd.train.Checkpoint(**_objects(torch, 2, strategy), last=FailsOnce(0))
    ckpt.save_counter.assign(np.int64(5))
    np.random.seed(3)
    before = _everything(ckpt)
    monkeypatch.setattr(FailsOnce, "failures", 1)
    with pytest.raises(RuntimeError, match="was not restored: loading 'last' failed") as caught:
        ckpt.read(path)
    assert "nothing was changed" in str(caught.value)
    assert str(caught.value.__cause__) == "the injected failure"
    _assert_unchanged(ckpt, before)
    # The next restore loads it all.
    ckpt.read(path).assert_consumed()
    assert float(ckpt.v.numpy()[0]) == 1.0
    assert ckpt.last.state == 7


def test_a_module_that_fails_half_loaded_is_put_back(torch_module: Any, tmp_path: Path) -> None:
    torch = torch_module
    torch.manual_seed(0)
    path = cd.train.Checkpoint(m=torch.nn.Sequential(torch.nn.Linear(3, 3))).write(tmp_path / "c")
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    model.register_load_state_dict_post_hook(lambda *_: (_ for _ in ()).throw(OSError("late")))
    ckpt = cd.train.Checkpoint(m=model)
    before = _everything(ckpt)
    with pytest.raises(RuntimeError, match=r"loading 'm' failed \(OSError: late\)"):
        ckpt.read(path)
    _assert_unchanged(ckpt, before)


def test_a_failed_random_restore_is_put_back(
    torch_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = torch_module
    ckpt = cd.train.Checkpoint(m=torch.nn.Linear(2, 2), v=cd.Variable(1.0))
    path = ckpt.write(tmp_path / "c")
    np.random.seed(1)
    torch.manual_seed(1)
    ckpt.m.weight.data.add_(1.0)
    ckpt.v.assign(2.0)
    before = _everything(ckpt)
    restore = global_random.restore
    calls = []

    def numpy_then_fail(state: Any) -> None:
        calls.append(state)
        if len(calls) == 1:  # NumPy's generator is set, then the rest fails
            restore({"numpy": state["numpy"]})
            raise ValueError("a damaged python random state")
        restore(state)

    monkeypatch.setattr(global_random, "restore", numpy_then_fail)
    with pytest.raises(RuntimeError, match="loading 'the global random state' failed"):
        ckpt.read(path)
    _assert_unchanged(ckpt, before)


def test_training_after_a_failed_restore_is_plain_torchs(torch_module: Any, tmp_path: Path) -> None:
    # A prepared model and optimizer (2 replicas) take a failed restore between steps;
    # the run must go on as plain torch's on the same global batches (float64).
    import crossdevice.torch as cdt

    torch = torch_module
    torch.set_default_dtype(torch.float64)
    try:
        batches = global_batches(torch, 4)
        plain = mlp(torch)
        plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.05)
        strategy = mirrored(2)
        with strategy.scope():
            net = copy.deepcopy(plain)
            adam = torch.optim.Adam(net.parameters(), lr=0.05)
            model, optimizer = cdt.prepare(net, adam, share_storage=False)  # a copy each
        other = mlp(torch)
        other_optimizer = _stepped_adam(torch, other, 6)
        other_ckpt = cd.train.Checkpoint(model=other, optimizer=other_optimizer, last=Holder(1))
        path = other_ckpt.write(tmp_path / "other")

        def step(x: Any, y: Any) -> None:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()
            optimizer.step()

        for i, (x, y) in enumerate(batches):
            plain_optimizer.zero_grad()
            global_loss(torch, plain, x, y).backward()
            plain_optimizer.step()
            for xs, ys in strategy.experimental_distribute_dataset([(x, y)]):
                strategy.run(step, args=(xs, ys))
            if i == 1:
                ckpt = cd.train.Checkpoint(model=model, optimizer=optimizer, last=FailsOnce(0))
                FailsOnce.failures = 1
                before = _everything(ckpt)  # each replica's parameters and Adam state
                with pytest.raises(RuntimeError, match="nothing was changed"):
                    ckpt.read(path)
                _assert_unchanged(ckpt, before)
        for mine, theirs in zip(model.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_failed_restore_on_create_tracks_nothing_and_keeps_the_value(
    torch_module: Any, tmp_path: Path
) -> None:
    torch = torch_module
    path = cd.train.Checkpoint(m=torch.nn.Linear(2, 2), last=Holder(5)).write(tmp_path / "c")
    ckpt = cd.train.Checkpoint(m=torch.nn.Linear(2, 2))
    ckpt.read(path)
    FailsOnce.failures = 1
    late = FailsOnce(0)
    with pytest.raises(RuntimeError, match=r"the value for 'last' .* was not restored"):
        ckpt.last = late
    assert late.state == 0
    assert "last" not in ckpt._objects
    with pytest.raises(ValueError, match="cannot restore 'last'") as caught:
        ckpt.last = cd.Variable(1.0)  # refused by the checks: not tracked either
    assert "nothing was changed or tracked" in caught.value.__notes__[0]
    assert "last" not in ckpt._objects
    ckpt.last = Holder(0)  # the held value still waits for its object
    assert ckpt.last.state == 5


def test_a_put_back_that_fails_says_what_may_be_left_restored(
    torch_module: Any, tmp_path: Path
) -> None:
    torch = torch_module

    class Broken(Holder):
        def load_state_dict(self, state: Any) -> None:
            self.state = "half"
            raise RuntimeError("always")

    path = cd.train.Checkpoint(m=torch.nn.Linear(2, 2), b=Holder(1)).write(tmp_path / "c")
    model = torch.nn.Linear(2, 2)
    before = _state(model)
    with pytest.raises(RuntimeError, match=r"putting back 'b' failed too .* \['b'\] may be left"):
        cd.train.Checkpoint(m=model, b=Broken(0)).read(path)
    assert _same(before, _state(model))


# --- 3. across workers ------------------------------------------------------------------------
def load_fails_on_worker_one(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Restore `path` into changed objects; worker 1's last load fails. What each saw."""
    import torch

    options = cd.experimental.CommunicationOptions(timeout_seconds=60)
    strategy = cd.MultiWorkerMirroredStrategy(communication_options=options, devices=["CPU:0"])
    FailsOnce.failures = 1
    with strategy.scope():
        ckpt = cd.train.Checkpoint(
            v=cd.Variable(np.float32(2.0)),
            m=torch.nn.Linear(2, 2),
            last=FailsOnce(0) if rank == 1 else Holder(0),
        )
    before = _everything(ckpt)
    try:
        ckpt.read(path)
        error = ""
    except RuntimeError as err:
        error = str(err)
    unchanged = all(_same(before[k], after) for k, after in _everything(ckpt).items())
    return {"error": error, "unchanged": unchanged}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_load_that_fails_on_one_worker_changes_no_worker(
    torch_module: Any, tmp_path: Path
) -> None:
    torch = torch_module
    objects = {"v": cd.Variable(np.float32(1.0)), "m": torch.nn.Linear(2, 2), "last": Holder(1)}
    saved = cd.train.Checkpoint(**objects)
    path = saved.write(tmp_path / "c")
    saved.sync()
    results = [
        r.unwrap() for r in run_workers(load_fails_on_worker_one, 2, args=(path,), timeout=90)
    ]
    assert results[1]["error"].startswith(
        f"the checkpoint {path!r} was not restored: loading 'last'"
    )
    assert (
        f"the checkpoint {path!r} was not restored: worker(s) [1] could not load it"
        in (results[0]["error"])
    )
    assert results[0]["unchanged"]
    assert results[1]["unchanged"]
