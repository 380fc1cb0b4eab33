"""Loaders with persistent workers: their first `iter()` draws more than a later one.

A mid-epoch resume replays the epoch: the pipeline is recreated under the random state
of the epoch's start and the consumed prefix is dropped (`crossdevice._input.position`).
That gives the epoch's order only if the replayed `iter()` draws what the original one
drew. A torch `DataLoader(num_workers>0, persistent_workers=True)` does not, in a fresh
process (torch/utils/data/dataloader.py, torch 2.x):

* its first `iter()` makes the worker iterator: `_BaseDataLoaderIter.__init__` draws
  `_base_seed`, one int64 from `loader.generator` or torch's global generator, and then
  primes the workers (`_reset(first_iter=True)`), which starts the sampler: a
  `RandomSampler` draws its permutation's seed (one int64) from the same generator;
* every later `iter()` only calls `_reset` on that iterator: the sampler's draw alone.

So a replayed epoch >= 1 (whose original `iter()` was a later one) drew `_base_seed`
first in the restored process, and then another permutation: the dropped prefix was
another order's, and examples repeated and went missing, silently (the bug hunt of
session 58, finding 2). A position now records, per persistent loader, whether the pass's
`iter()` came after the loader had made its workers (`started`); before a replay (or a
restored epoch's start) `warm_up` makes the workers of a loader that had them, with every
generator put back, so that the replayed `iter()` is a later one again.

The workers themselves are seeded once, from the first `iter()`'s `_base_seed`, and keep
their random state from epoch to epoch: what they draw (augmentations, or the order of
an `IterableDataset` that shuffles in its workers) cannot be replayed after a restore.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Final

from crossdevice._arrays import global_random
from crossdevice._input import generators

__all__ = ["find", "started", "warm_up"]

_LOG: Final = logging.getLogger("crossdevice")


def find(datasets: Iterable[Any]) -> tuple[Any, ...]:
    """The `DataLoader`s among `datasets` that keep their workers (`persistent_workers`)."""
    data: Any = sys.modules.get("torch.utils.data")
    if data is None:
        return ()
    return tuple(
        d
        for d in datasets
        if isinstance(d, data.DataLoader) and d.persistent_workers and d.num_workers > 0
    )


def started(loaders: Sequence[Any]) -> list[bool]:
    """Whether each loader has made its workers: its next `iter()` is not its first."""
    return [getattr(loader, "_iterator", None) is not None for loader in loaders]


def warm_up(
    loaders: Sequence[Any],
    wanted: Sequence[bool] | None,
    own: Sequence[Any],
    *,
    epoch: int,
    mid_epoch: bool,
    what: str,
) -> list[bool]:
    """Make the loaders' workers where the saved pass's `iter()` was not their first.

    Args:
        loaders: the pipeline's persistent loaders (`find`).
        wanted: `started` as the saved pass saw it; None for a position written before
            it was kept: then the epoch says (a pass after the first is a later `iter()`).
        own: the datasets' own generators, put back after the warm-up as the global ones.
        epoch: the saved pass's epoch.
        mid_epoch: whether the pass is replayed (a prefix dropped): only then is a loader
            whose workers cannot be made anew an error.
        what: leads the error message.

    Returns:
        `started` for the pass: what it will record.

    Raises:
        ValueError: mid-epoch, the saved pass was a loader's first `iter()` and this
            loader has made its workers already: its `iter()` cannot draw the same order.
    """
    if not loaders:
        return []
    if wanted is None or len(wanted) != len(loaders):
        if mid_epoch and epoch > 0:
            _LOG.warning(
                "the restored data position (epoch %d) does not say whether its "
                "DataLoader's persistent workers were running when the epoch began (it was "
                "written by an older crossdevice): assuming they were, as in an epoch loop "
                "over one loader",
                epoch,
            )
        wanted = [epoch > 0] * len(loaders)
    now = started(loaders)
    for index, loader in enumerate(loaders):
        if wanted[index] and not now[index]:
            # The first iter() draws from the generators: put every one of them back.
            with (
                global_random.replayed(global_random.capture()),
                generators.replayed(own, generators.capture(own), what),
            ):
                iter(loader)
        elif mid_epoch and now[index] and not wanted[index]:
            raise ValueError(
                f"{what}: the saved data position is part way into epoch {epoch}, which was "
                "the first iter() of a DataLoader with persistent_workers=True, and this "
                "loader has made its workers already (it was iterated before the restore): "
                "its next iter() draws its order differently (no new base seed), so the "
                "epoch cannot be replayed and resuming would repeat and skip examples. "
                "Expected a loader not yet iterated: restore into a new DataLoader (a fresh "
                "process), or restore before the first epoch"
            )
        if mid_epoch and wanted[index] and _iterable(loader):
            _LOG.warning(
                "resuming epoch %d of a DataLoader over an IterableDataset with persistent "
                "workers: the workers' random state after the earlier epochs cannot be "
                "replayed, so the epoch's order is the saved one only if the dataset's "
                "__iter__ draws no random numbers in its workers",
                epoch,
            )
    return list(wanted)


def _iterable(loader: Any) -> bool:
    """Whether `loader` reads an `IterableDataset` (its workers decide the order)."""
    data: Any = sys.modules["torch.utils.data"]
    return isinstance(loader.dataset, data.IterableDataset)
