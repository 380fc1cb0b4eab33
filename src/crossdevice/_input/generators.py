"""The random generators of a dataset's own: what its iterator draws from besides the global ones.

torch's reproducibility idiom gives a `DataLoader` its own generator
(`DataLoader(dataset, shuffle=True, generator=g)`), or gives one to a sampler
(`RandomSampler`, `SubsetRandomSampler`, `WeightedRandomSampler`, or any sampler with a
`generator` attribute). Iterating such a loader draws from `g`, never from torch's global
generator: `iter(loader)` takes the workers' base seed from `g`, and the sampler draws
the epoch's permutation (or, with replacement, indices 32 at a time) from `g` as batches
are read. So `g` advances once per epoch, and a data position that kept only the global
random state replayed a resumed epoch from whatever state `g` had at the restore: the
state after the epoch (when `g` is tracked in the checkpoint) or after no epoch at all
(when it is not), which repeats and skips examples (the bug hunt's `s_loader_generator`).

`find(datasets)` lists those generators: a dataset's `generator`, and that of its
`sampler`, its `batch_sampler` (and that one's `sampler`) and its `dataset`, whatever
their classes, when it is a `torch.Generator`. Their states are named `uint8` arrays, as
`global_random`'s are, so that any checkpoint format stores them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

import numpy as np

__all__ = ["capture", "check", "find", "replayed", "restore"]

#: The attributes that lead from a loader to the objects that draw for it.
_LINKS: Final = ("sampler", "batch_sampler", "dataset")
#: Loader → batch sampler → sampler is two links; a wrapper or two more is allowed.
_MAX_DEPTH: Final = 4


def find(datasets: Iterable[Any]) -> tuple[Any, ...]:
    """The distinct `torch.Generator`s that iterating `datasets` draws from, in a fixed order.

    Empty when torch is not imported: then no dataset can hold a torch generator.
    """
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return ()
    found: dict[int, Any] = {}
    visited: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if obj is None or depth > _MAX_DEPTH or id(obj) in visited:
            return
        visited.add(id(obj))
        generator = getattr(obj, "generator", None)
        if isinstance(generator, torch.Generator):
            found.setdefault(id(generator), generator)
        for link in _LINKS:
            visit(getattr(obj, link, None), depth + 1)

    for dataset in datasets:
        visit(dataset, 0)
    return tuple(found.values())


def capture(generators: Sequence[Any]) -> dict[str, np.ndarray] | None:
    """The generators' states as `{"generator_<i>": uint8 array}`; None for no generators."""
    if not generators:
        return None
    return {
        f"generator_{i}": generator.get_state().numpy().copy()
        for i, generator in enumerate(generators)
    }


def restore(generators: Sequence[Any], states: Mapping[str, Any], what: str) -> None:
    """Set each generator to its state in `states` (what `capture` returned for them)."""
    check(generators, states, what)
    if not generators:
        return
    import torch

    names = [f"generator_{i}" for i in range(len(generators))]
    for name, generator in zip(names, generators, strict=True):
        data = torch.from_numpy(np.asarray(states[name], dtype=np.uint8).copy())
        try:
            generator.set_state(data)
        except RuntimeError as err:
            raise ValueError(
                f"{what}: the saved state {name!r} ({data.numel()} bytes) does not fit the "
                f"dataset's generator on {generator.device}: {err}. Expected the generator "
                "kind the checkpoint was written with (same device)"
            ) from err


def check(generators: Sequence[Any], states: Mapping[str, Any], what: str) -> None:
    """ValueError unless `states` has one state per generator (what `capture` names)."""
    names = [f"generator_{i}" for i in range(len(generators))]
    if sorted(states) != sorted(names):
        raise ValueError(
            f"{what}: the saved data position holds the states of {len(states)} random "
            f"generators its pipeline drew from ({sorted(states)!r}), and this dataset's "
            f"pipeline draws from {len(generators)} of its own (the generator= of its "
            "DataLoader and samplers). Expected the dataset the checkpoint was written with: "
            "build the DataLoader with the same samplers and generators"
        )


@contextlib.contextmanager
def replayed(
    generators: Sequence[Any], states: Mapping[str, Any] | None, what: str
) -> Iterator[None]:
    """Run the enclosed code with the generators in `states`, then put them back as they were.

    `None` (no saved states) runs it with the generators as they are.
    """
    if states is None:
        yield
        return
    current = capture(generators) or {}
    restore(generators, states, what)
    try:
        yield
    finally:
        restore(generators, current, what)
