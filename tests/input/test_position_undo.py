"""A distributed dataset's and iterator's own hooks for a checkpoint restore.

A restore checks every object before it loads any (`_check_state`: what `load_state_dict`
refuses, writing nothing), and puts back what it had loaded should a later load fail
(`_snapshot`, taken before the load). Each test compares with a twin built alike that never
saw the load: its `state_dict()`, its `epoch`, and the example ids it hands out next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from crossdevice._input.distributed import DistributedDataset, DistributedDatasetsFromFunction

pytestmark = pytest.mark.torch

DEVICES = ("CPU:0", "CPU:1")


def _shuffled(torch: Any) -> Any:
    """24 example ids in batches of 4, shuffled by a generator of the loader's own."""
    ids = torch.utils.data.TensorDataset(torch.arange(24))
    generator = torch.Generator().manual_seed(7)
    return torch.utils.data.DataLoader(ids, batch_size=4, shuffle=True, generator=generator)


def _kinds(torch: Any) -> dict[str, Callable[[], Any]]:
    return {
        "global batches": lambda: DistributedDataset(_shuffled(torch), devices=DEVICES),
        "from a function": lambda: DistributedDatasetsFromFunction(
            lambda _: _shuffled(torch), devices=DEVICES, num_replicas_in_sync=2
        ),
    }


def _ids(steps: Any, count: int | None = None) -> list[list[int]]:
    """Each step's example ids (every replica's), for `count` steps or to the end."""
    out = []
    for (batch,) in steps:
        out.append([int(i) for part in batch.values for i in part])
        if len(out) == count:
            break
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return bool(a == b)


def _other_position(make: Callable[[], Any]) -> dict[str, Any]:
    """A position of another epoch (2), 3 steps in, its loader's generator moved on."""
    other = make()
    for _ in range(2):
        _ids(iter(other))
    _ids(iter(other), 3)
    return other.state_dict()


@pytest.mark.parametrize("kind", ["global batches", "from a function"])
def test_a_snapshot_puts_back_a_dataset_read_part_way(torch_module: Any, kind: str) -> None:
    make = _kinds(torch_module)[kind]
    dist, twin = make(), make()
    assert _ids(iter(dist), 2) == _ids(iter(twin), 2)
    state = _other_position(make)
    undo = dist._snapshot()
    dist.load_state_dict(state)
    assert not _same(dist.state_dict(), twin.state_dict())  # the load moved it
    undo()
    # A state_dict() loaded back would resume the pass read part way; the twin goes on.
    assert _same(dist.state_dict(), twin.state_dict())
    assert dist.epoch == twin.epoch == 1
    for _ in range(2):
        assert _ids(iter(dist)) == _ids(iter(twin))


@pytest.mark.parametrize("kind", ["global batches", "from a function"])
def test_a_snapshot_puts_back_a_fresh_iterator(torch_module: Any, kind: str) -> None:
    make = _kinds(torch_module)[kind]
    it, twin = iter(make()), iter(make())
    state = _other_position(make)
    undo = it._snapshot()
    it.load_state_dict(state)
    assert it.epoch != twin.epoch
    undo()
    assert it.epoch == twin.epoch == 0
    assert _same(it.state_dict(), twin.state_dict())
    assert _ids(it) == _ids(twin)


@pytest.mark.parametrize("kind", ["global batches", "from a function"])
def test_check_state_refuses_what_a_load_refuses_and_writes_nothing(
    torch_module: Any, kind: str
) -> None:
    make = _kinds(torch_module)[kind]
    good = _other_position(make)
    plain = DistributedDataset([(np.arange(4),)] * 6, devices=DEVICES)
    _ids(iter(plain), 2)
    wrong_size = {**good, "generators_now": {"generator_0": np.zeros(10, np.uint8)}}
    states = {
        "good": good,
        "a negative step count": {**good, "steps": -1},
        "no epoch": {k: v for k, v in good.items() if k != "epoch"},
        "one generator too many": {**good, "generators": {**good["generators"], "generator_1": 0}},
        "a generator state of another size": wrong_size,
        "the states of no generator, for one": plain.state_dict() | {"generators": {}},
    }

    def started() -> Any:
        it = iter(make())
        _ids(it, 1)
        return it

    targets = {"dataset": make, "iterator": lambda: iter(make()), "started": started}
    for target, build in targets.items():
        for name, state in states.items():
            obj, twin = build(), build()
            try:
                obj._check_state(state, "checking")
                refused = ""
            except ValueError as err:
                refused = str(err)
            assert _same(obj.state_dict(), twin.state_dict()), (target, name)
            assert obj.epoch == twin.epoch, (target, name)
            try:
                obj.load_state_dict(state)
                failed = False
            except (ValueError, RuntimeError):
                failed = True
            assert bool(refused) == failed, (target, name, refused)
            assert not refused or refused.startswith("checking: "), refused
    with pytest.raises(ValueError, match="the tracked iterator has handed out 1 steps already"):
        started()._check_state(good, "checking")
