"""Where a distributed dataset's passes read from: `Source`, and `element_spec`.

A `tf.data.Dataset` starts over on every `iter()`. A Python generator (any one-shot
iterator: `iter(x) is x`) does not: an epoch loop over a distributed dataset made from
one would train one epoch and then run empty epochs, silently. `Source` refuses the pass
after the one that exhausted it, naming what to pass instead.

`element_spec` describes the per-replica batches, as TF's does (`PerReplicaSpec` of
`TensorSpec`s with a None batch dimension), from a batch: one already read, or the first
of a list or tuple. Reading one only to describe it would consume a generator's batch or
move a shuffling DataLoader's random stream, so for those it waits for the first step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from crossdevice._arrays import backend_for
from crossdevice._core import nest

__all__ = [
    "ArraySpec",
    "DescribedDataset",
    "DescribedIterator",
    "PerReplicaSpec",
    "Source",
    "element_spec",
]


class Source:
    """One dataset that passes read: `batches()` starts a pass; remembers the first batch.

    Args:
        dataset: an iterable of batches (a list, a re-iterable, or a one-shot iterator).
        what: how the user gave it, for the error (`"experimental_distribute_dataset"`).
    """

    __slots__ = ("_dataset", "_exhausted", "_one_shot", "_what", "first")

    def __init__(self, dataset: Any, what: str) -> None:
        self._dataset = dataset
        self._what = what
        # An iterator's `__iter__` returns itself (the protocol); asking costs nothing.
        self._one_shot = isinstance(dataset, Iterator) and iter(dataset) is dataset
        self._exhausted = False
        #: A batch read by some pass (the first), for `element_spec`; None before.
        self.first: Any = None

    def batches(self) -> Iterator[Any]:
        """The batches of a new pass.

        Raises:
            ValueError: the dataset is a one-shot iterator a previous pass read to its
                end: this pass would have no batches.
        """
        if self._exhausted:
            raise ValueError(
                f"{self._what} was given a one-shot iterator ({self._dataset!r}), and a "
                "previous pass read it to its end, so this pass (the next epoch?) would get "
                "no batches: a generator cannot start over as a tf.data.Dataset does. Pass "
                "a list of batches, or a re-iterable object whose __iter__ starts a new "
                "pass (a torch DataLoader, a class whose __iter__ makes the generator), or "
                "use strategy.distribute_datasets_from_function with a dataset_fn that "
                "returns one"
            )
        batches = iter(self._dataset)
        if self._one_shot or self.first is None:
            return self._watch(batches)
        return batches

    def _watch(self, batches: Iterator[Any]) -> Iterator[Any]:
        # A plain loop, not `yield from`: closing an abandoned pass must not close a
        # generator that the next pass goes on reading.
        for batch in batches:
            if self.first is None:
                self.first = batch
            yield batch
        self._exhausted = self._one_shot


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """The shape and dtype of one array of a batch (TF's `tf.TensorSpec`, unnamed).

    Attributes:
        shape: the shape; None where sizes vary (the batch dimension).
        dtype: the NumPy or torch dtype.
    """

    shape: tuple[int | None, ...]
    dtype: Any

    def __repr__(self) -> str:
        return f"ArraySpec(shape={self.shape}, dtype={self.dtype})"


@dataclasses.dataclass(frozen=True, init=False)
class PerReplicaSpec:
    """One spec per local replica of a `PerReplica` value (TF's `values.PerReplicaSpec`).

    Example:
        >>> PerReplicaSpec(ArraySpec((None,), "int64"), ArraySpec((None,), "int64"))
        PerReplicaSpec(ArraySpec(shape=(None,), dtype=int64), ArraySpec(shape=(None,), dtype=int64))
    """

    component_specs: tuple[Any, ...]

    def __init__(self, *component_specs: Any) -> None:
        object.__setattr__(self, "component_specs", component_specs)

    def __repr__(self) -> str:
        return f"PerReplicaSpec({', '.join(map(repr, self.component_specs))})"


def element_spec(sources: Sequence[Source], num_local: int, wrap: bool) -> Any:
    """The spec of one step: each leaf's `ArraySpec`, in a `PerReplicaSpec` when wrapped.

    Raises:
        ValueError: no batch has been read and none can be without side effects.
    """
    batch = next((s.first for s in sources if s.first is not None), None)
    if batch is None:
        dataset = sources[0]._dataset
        if not isinstance(dataset, list | tuple) or not dataset:
            raise ValueError(
                "element_spec describes the batches, but this dataset "
                f"({type(dataset).__name__}) has not given one yet, and reading one to "
                "describe it would use it up (a generator) or move its random order (a "
                "shuffling DataLoader); ask after the first step (next(iterator)), or pass "
                "a list of batches"
            )
        batch = dataset[0]

    def describe(leaf: Any) -> Any:
        shape = tuple(backend_for(leaf).shape(leaf))
        dtype = getattr(leaf, "dtype", None)
        dtype = np.asarray(leaf).dtype if dtype is None else dtype  # (a NumPy dtype is falsy)
        spec = ArraySpec((None, *shape[1:]) if shape else (), dtype)
        return PerReplicaSpec(*[spec] * num_local) if wrap else spec

    return nest.map_structure(describe, batch)


class DescribedDataset:
    """`element_spec` for a distributed dataset (a base class of each)."""

    _sources: tuple[Source, ...]
    _layout: Any

    @property
    def element_spec(self) -> Any:
        """The spec of each step's per-replica values (TF's `element_spec`).

        The batch's nest with an `ArraySpec` per leaf (shape with None for the batch
        dimension, dtype), in a `PerReplicaSpec` of one per local replica where steps are
        `PerReplica` values. Taken from a batch: the first of a list, else the first one
        read (ask after the first step).

        Raises:
            ValueError: no batch has been read yet and reading one would consume it.

        Example:
            >>> import numpy as np, crossdevice
            >>> s = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> spec = s.experimental_distribute_dataset([np.arange(4)]).element_spec
            >>> spec.component_specs[1]
            ArraySpec(shape=(None,), dtype=int64)
        """
        return self._element_spec()

    def _element_spec(self) -> Any:
        return element_spec(self._sources, self._layout.num_local, self._layout.wrap)


class DescribedIterator:
    """`element_spec` for a distributed iterator: its dataset's (a base class of it)."""

    _spec: Any

    @property
    def element_spec(self) -> Any:
        """The spec of each step's values: its dataset's `element_spec`.

        Raises:
            ValueError: see `DistributedDataset.element_spec`; also for an iterator made
                without a dataset.
        """
        if self._spec is None:
            raise ValueError(
                "this iterator was made without a distributed dataset, so it has no "
                "element_spec; ask the dataset's (strategy.experimental_distribute_dataset)"
            )
        return self._spec()
