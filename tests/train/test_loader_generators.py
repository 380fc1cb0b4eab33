"""A DataLoader with a generator of its own resumes with the uninterrupted run's examples.

torch's reproducibility idiom, `DataLoader(dataset, shuffle=True, generator=g)`, draws each
epoch's order from `g`, not from torch's global generator. The data position once kept
only the global random state, so a resumed epoch drew its order from whatever state `g`
had at the restore, repeating and skipping examples (the bug hunt's `s_loader_generator`):
with `g` tracked in the checkpoint, from its state after the saved epoch; untracked, from
its seed, i.e. epoch 0's order. Each test compares the example ids a saved-and-resumed run
sees with an uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import crossdevice as cd

pytestmark = pytest.mark.torch

EPOCHS = 3
NUM_EXAMPLES = 20
BATCH = 4  # 5 steps an epoch


def _shuffled(torch: Any, generator: Any) -> Any:
    ids = torch.utils.data.TensorDataset(torch.arange(NUM_EXAMPLES))
    return torch.utils.data.DataLoader(ids, batch_size=BATCH, shuffle=True, generator=generator)


def _job(
    torch: Any, make_loader: Callable[[Any, Any], Any], track: bool
) -> tuple[Any, Any, Any, Any]:
    """A fresh process's objects: strategy, distributed loader, checkpoint, generator."""
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    generator = torch.Generator().manual_seed(123)
    dist = strategy.experimental_distribute_dataset(make_loader(torch, generator))
    objects = {"data": dist, "gen": generator} if track else {"data": dist}
    return strategy, dist, cd.train.Checkpoint(**objects), generator


def _epochs(strategy: Any, dist: Any, stop_after: int | None = None) -> list[list[int]]:
    """The resumable loop: each step's example ids, until `stop_after` steps or the end."""
    seen: list[list[int]] = []
    for _ in range(dist.epoch, EPOCHS):
        for (batch,) in dist:
            seen.append([int(i) for t in strategy.experimental_local_results(batch) for i in t])
            if len(seen) == stop_after:
                return seen
    return seen


def _resumed(
    torch: Any,
    tmp_path: Path,
    make_loader: Callable[[Any, Any], Any],
    track: bool,
    save_after: int,
) -> tuple[list[list[int]], list[list[int]]]:
    """(the uninterrupted run's steps, the steps of a run saved after `save_after` and resumed)."""
    strategy, dist, _, _ = _job(torch, make_loader, track)
    full = _epochs(strategy, dist)

    strategy, dist, ckpt, generator = _job(torch, make_loader, track)
    seen = _epochs(strategy, dist, stop_after=save_after)
    path = ckpt.save(tmp_path / "ckpt")
    torch.randint(0, 10, (5,), generator=generator)  # the job goes on drawing, then dies

    torch.manual_seed(99)  # a new process: another global state until the restore
    strategy, dist, ckpt, _ = _job(torch, make_loader, track)
    ckpt.restore(path).assert_consumed()
    return full, seen + _epochs(strategy, dist)


@pytest.mark.parametrize("track", [True, False], ids=["tracked", "untracked"])
@pytest.mark.parametrize(
    "save_after",
    [2, 5, 7, 10],
    ids=["mid-epoch-0", "end-of-epoch-0", "mid-epoch-1", "end-of-epoch-1"],
)
def test_a_loader_with_its_own_generator_resumes_exactly(
    torch_module: Any, tmp_path: Path, track: bool, save_after: int
) -> None:
    full, resumed = _resumed(torch_module, tmp_path, _shuffled, track, save_after)
    assert resumed == full
    assert len(full) == EPOCHS * NUM_EXAMPLES // BATCH
    for epoch in range(EPOCHS):  # every example once an epoch
        ids = [i for step in resumed[epoch * 5 : epoch * 5 + 5] for i in step]
        assert sorted(ids) == list(range(NUM_EXAMPLES))


def _random_sampler(torch: Any, generator: Any) -> Any:
    ids = torch.utils.data.TensorDataset(torch.arange(NUM_EXAMPLES))
    sampler = torch.utils.data.RandomSampler(ids, generator=generator)
    return torch.utils.data.DataLoader(ids, batch_size=BATCH, sampler=sampler)


def _with_replacement(torch: Any, generator: Any) -> Any:
    # Draws its indices 32 at a time as batches are read, and a tail at the end.
    ids = torch.utils.data.TensorDataset(torch.arange(NUM_EXAMPLES))
    sampler = torch.utils.data.RandomSampler(
        ids, replacement=True, num_samples=NUM_EXAMPLES, generator=generator
    )
    return torch.utils.data.DataLoader(ids, batch_size=BATCH, sampler=sampler)


def _subset(torch: Any, generator: Any) -> Any:
    ids = torch.utils.data.TensorDataset(torch.arange(NUM_EXAMPLES))
    sampler = torch.utils.data.SubsetRandomSampler(range(NUM_EXAMPLES), generator=generator)
    return torch.utils.data.DataLoader(ids, batch_size=BATCH, sampler=sampler)


def _weighted(torch: Any, generator: Any) -> Any:
    ids = torch.utils.data.TensorDataset(torch.arange(NUM_EXAMPLES))
    weights = torch.linspace(1.0, 2.0, NUM_EXAMPLES)
    sampler = torch.utils.data.WeightedRandomSampler(weights, NUM_EXAMPLES, generator=generator)
    return torch.utils.data.DataLoader(ids, batch_size=BATCH, sampler=sampler)


def _batch_sampler(torch: Any, generator: Any) -> Any:
    ids = torch.utils.data.TensorDataset(torch.arange(NUM_EXAMPLES))
    sampler = torch.utils.data.RandomSampler(ids, generator=generator)
    batches = torch.utils.data.BatchSampler(sampler, BATCH, drop_last=False)
    return torch.utils.data.DataLoader(ids, batch_sampler=batches)


class _OwnSampler:
    """A user's sampler: any class whose `generator` attribute is a torch.Generator."""

    def __init__(self, torch: Any, generator: Any) -> None:
        self.torch = torch
        self.generator = generator

    def __iter__(self) -> Iterator[int]:
        yield from self.torch.randperm(NUM_EXAMPLES, generator=self.generator).tolist()

    def __len__(self) -> int:
        return NUM_EXAMPLES


def _own_sampler(torch: Any, generator: Any) -> Any:
    ids = torch.utils.data.TensorDataset(torch.arange(NUM_EXAMPLES))
    return torch.utils.data.DataLoader(ids, batch_size=BATCH, sampler=_OwnSampler(torch, generator))


@pytest.mark.parametrize(
    "make_loader",
    [_random_sampler, _with_replacement, _subset, _weighted, _batch_sampler, _own_sampler],
    ids=["RandomSampler", "replacement", "SubsetRandomSampler", "Weighted", "BatchSampler", "own"],
)
@pytest.mark.parametrize("track", [True, False], ids=["tracked", "untracked"])
def test_every_sampler_with_a_generator_resumes_exactly(
    torch_module: Any, tmp_path: Path, make_loader: Callable[[Any, Any], Any], track: bool
) -> None:
    for save_after in (3, 5, 8):  # mid-epoch 0, its end, mid-epoch 1
        path = tmp_path / str(save_after)
        full, resumed = _resumed(torch_module, path, make_loader, track, save_after)
        assert resumed == full, f"saved after {save_after} steps"


def _ids(strategy: Any, step: Any) -> list[int]:
    return [int(i) for t in strategy.experimental_local_results(step[0]) for i in t]


def test_a_checkpointed_iterator_of_such_a_loader_resumes_too(
    torch_module: Any, tmp_path: Path
) -> None:
    strategy, dist, _, _ = _job(torch_module, _shuffled, track=False)
    full = [[_ids(strategy, step) for step in dist] for _ in range(2)]

    strategy, dist, _, _ = _job(torch_module, _shuffled, track=False)
    for _ in dist:  # epoch 0
        pass
    it = iter(dist)  # epoch 1
    first = [_ids(strategy, next(it)) for _ in range(2)]
    path = cd.train.Checkpoint(it=it).save(tmp_path / "ckpt")

    strategy, dist, _, _ = _job(torch_module, _shuffled, track=False)
    fresh = iter(dist)
    cd.train.Checkpoint(it=fresh).restore(path).assert_consumed()
    assert fresh.epoch == 1
    assert first + [_ids(strategy, step) for step in fresh] == full[1]


def test_a_position_without_the_generators_states_is_an_error_mid_epoch(
    torch_module: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch = torch_module
    strategy, dist, _, _ = _job(torch, _shuffled, track=False)
    _epochs(strategy, dist, stop_after=2)
    state = dist.state_dict()
    older = {k: v for k, v in state.items() if k not in ("generators", "generators_now")}

    _, again, _, _ = _job(torch, _shuffled, track=False)
    with pytest.raises(ValueError, match=r"2 steps into epoch 0.*holds no state of them"):
        again.load_state_dict(older)
    with pytest.raises(ValueError, match=r"holds the states of 1 random generators.*draws from 0"):
        strategy.experimental_distribute_dataset([torch.arange(4)]).load_state_dict(state)
    at_start = {**older, "epoch": 1, "steps": 0, "examples": 0, "random": None}
    again.load_state_dict(at_start)  # an epoch's start: right if the generator is tracked
    assert "only if they are tracked in the checkpoint too" in caplog.text


@pytest.mark.parametrize("track", [True, False], ids=["tracked", "untracked"])
@pytest.mark.parametrize("save_after", [2, 5, 7])
def test_datasets_from_a_function_resume_exactly_too(
    torch_module: Any, tmp_path: Path, save_after: int, track: bool
) -> None:
    torch = torch_module

    def job() -> tuple[Any, Any, Any]:
        strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
        generator = torch.Generator().manual_seed(123)

        def dataset_fn(ctx: Any) -> Any:
            loader = _shuffled(torch, generator)
            size = ctx.get_per_replica_batch_size(BATCH)
            ids = torch.utils.data.TensorDataset(torch.arange(NUM_EXAMPLES))
            return torch.utils.data.DataLoader(
                ids, batch_size=size, sampler=loader.sampler, generator=generator
            )

        dist = strategy.distribute_datasets_from_function(dataset_fn)
        objects = {"data": dist, "gen": generator} if track else {"data": dist}
        return strategy, dist, cd.train.Checkpoint(**objects)

    strategy, dist, _ = job()
    full = _epochs(strategy, dist)
    strategy, dist, ckpt = job()
    seen = _epochs(strategy, dist, stop_after=save_after)
    path = ckpt.save(tmp_path / "ckpt")
    strategy, dist, ckpt = job()
    ckpt.restore(path).assert_consumed()
    assert seen + _epochs(strategy, dist) == full
