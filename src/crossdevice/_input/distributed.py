"""Distributed datasets: global batches in, one `PerReplica` slice per replica out.

`DistributedDataset` is what `strategy.experimental_distribute_dataset(dataset)` returns;
`DistributedDatasetsFromFunction` is what `strategy.distribute_datasets_from_function`
returns. A dataset is any iterable of batches (a list, a generator, a torch
`DataLoader`), each a nest of NumPy arrays or torch tensors.

Wrapping follows TF's input_lib (`_create_per_replica` with `_always_wrap`): with one
local replica on a single worker the batch comes out plain (TF's regroup unwraps
1-tuples); with several local replicas, or on any worker of a multi-worker job, every
leaf is a `PerReplica` with one component per local replica.

Partial last steps follow TF's partial-batch handling: a replica without data gets an
empty batch (leading dimension 0, same dtype and trailing shape), and iteration stops
only when no replica has data. Across workers, `MultiWorkerMirroredStrategy` sets a
`_step_sync` on its datasets: the workers agree whether a step goes on (TF does the
same), so a worker whose pipeline ended first gets empty batches while another still has
data, and every worker stops at the same step (`crossdevice._input.agreement`: one
has-data all-reduce per step, or one per pass for a dataset of exact length).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from crossdevice._arrays import is_torch
from crossdevice._core import context
from crossdevice._input.agreement import PassAgreement, StepSync, exact_length
from crossdevice._input.batching import split_batch_leaves
from crossdevice._input.input_context import (
    InputContext,
    InputOptions,
    InputReplicationMode,
    check_options,
)
from crossdevice._input.layout import Layout as _Layout
from crossdevice._input.layout import empty_like as _empty_like
from crossdevice._input.optional import Optional
from crossdevice._input.position import EpochCounter, Pass, Positioned, skip_examples
from crossdevice._input.skipping import drop_examples, examples_in, skip_steps
from crossdevice._input.source import DescribedDataset, DescribedIterator, Source

__all__ = ["DistributedDataset", "DistributedDatasetsFromFunction", "DistributedIterator"]

#: Marks a pipeline that has run dry (a dataset may legitimately yield None).
_END: Any = object()


def _empty_step(last: Any) -> Any:
    """An empty batch shaped like `last`, for a worker that ran dry before its peers."""
    if last is _END:
        raise ValueError(
            "this worker's input pipeline yielded nothing while another worker's still has "
            "data, so there is no element to shape an empty batch from; expected every "
            "worker's pipeline to yield at least one element (shard the data so each "
            "worker gets some)"
        )
    return _empty_like(last, -1)


def _check_iterable(dataset: Any, what: str) -> None:
    """Reject values that iterate but are not a dataset of batches (a lone batch, a string)."""
    hint = (
        "pass an iterable of global batches: a list of batches, a generator, or a torch DataLoader"
    )
    if isinstance(dataset, np.ndarray) or is_torch(dataset):
        raise TypeError(
            f"{what} must be an iterable of batches, got a single array of shape "
            f"{tuple(dataset.shape)!r}; iterating it would treat every row as a batch. Split it "
            "into batches first, e.g. [x[i:i + B] for i in range(0, len(x), B)]"
        )
    if isinstance(dataset, Mapping):
        raise TypeError(
            f"{what} must be an iterable of batches, got a {type(dataset).__name__} (a single "
            f"batch?); {hint}, e.g. [batch] for one batch"
        )
    if isinstance(dataset, str | bytes) or not isinstance(dataset, Iterable):
        raise TypeError(f"{what} must be an iterable of batches, got {dataset!r}; {hint}")


class DistributedIterator(DescribedIterator, Positioned):
    """Iterator over a distributed dataset: `next(it)` (or `it.get_next()`) is one step.

    Raises StopIteration once no local replica has data left (TF raises OutOfRangeError
    from `get_next`; a Python iterator stops instead); `get_next_as_optional()` returns
    an empty `Optional` instead. Call it outside `strategy.run` and pass the step in:
    `strategy.run(step_fn, args=(next(it),))`.

    It is checkpointable, as TF's iterators are: `crossdevice.train.Checkpoint(it=it)`
    saves its position (`state_dict()`), and restoring that into a fresh iterator of the
    same data continues at the next global batch, on any layout.
    """

    def __init__(
        self,
        next_step: Callable[[], Any],
        tracker: Pass | None = None,
        sync: StepSync | None = None,
        spec: Callable[[], Any] | None = None,
    ) -> None:
        self._next_step = next_step
        self._spec = spec
        self._progress: Pass = tracker if tracker is not None else Pass(0, 0, None)
        self._sync = sync

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        _check_outside_replica_fn()
        return self._step()

    def get_next(self) -> Any:
        """The next step's per-replica values (TF's `DistributedIterator.get_next`)."""
        _check_outside_replica_fn()
        return self._step()

    def _step(self) -> Any:
        """One step; an error here reaches the other workers (`StepSync.failed`).

        A worker whose pipeline raised (an I/O error in its dataset, a batch this
        library refuses) left its peers waiting in the step's agreement until their
        timeout (600 s by default), learning nothing of the error (the bug hunt of
        session 53); they now raise `WorkerFailedError` naming it at once.
        """
        try:
            return self._next_step()
        except StopIteration:
            raise
        except BaseException as err:
            if self._sync is not None:
                self._sync.failed(err)
            raise

    def get_next_as_optional(self) -> Optional[Any]:
        """The next step's per-replica values as an `Optional`, empty at the end.

        TF's `DistributedIterator.get_next_as_optional`: `has_value()` is False once no
        replica has data left; otherwise `get_value()` is what `get_next()` returns.

        Example:
            >>> import numpy as np
            >>> it = iter(DistributedDataset([np.arange(4)], devices=("CPU:0", "CPU:1")))
            >>> it.get_next_as_optional().has_value(), it.get_next_as_optional().has_value()
            (True, False)
        """
        _check_outside_replica_fn()
        try:
            return Optional.from_value(self._step())
        except StopIteration:
            return Optional.empty()

    @property
    def epoch(self) -> int:
        """Which pass over its dataset this iterator reads (0 for the first `iter()`)."""
        return self._progress.position.epoch

    def state_dict(self) -> dict[str, Any]:
        """This iterator's position: epoch, steps and examples handed out, and more.

        Example:
            >>> import numpy as np
            >>> it = iter(DistributedDataset([np.arange(4)] * 3, devices=("CPU:0", "CPU:1")))
            >>> _ = next(it)
            >>> {k: it.state_dict()[k] for k in ("epoch", "steps", "examples")}
            {'epoch': 0, 'steps': 1, 'examples': 4}
        """
        return self._progress.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the saved iterator stopped; call it before the first `next()`.

        The pipeline is recreated under the random state it was first created under, its
        loader's own generators included (so a shuffling loader gives the same order), and
        the consumed global batches are read and dropped. A different global batch size
        is allowed: the position is recomputed from the examples consumed, and a log line
        says so.
        """
        self._progress.load(state)


def _check_outside_replica_fn() -> None:
    """TF's input_lib raises this ValueError: each replica would get the whole step."""
    frame = context.current_frame()
    if frame is not None and frame.replica_context is not None:
        raise ValueError(
            "next(iterator) should be called from outside of replica_fn, e.g. "
            "strategy.run(replica_fn, args=(next(iterator),)); inside strategy.run every "
            "replica would get the whole step's PerReplica values"
        )


def _length(dataset: Any) -> int | None:
    """`len(dataset)` (its number of global batches), or None when it has none."""
    try:
        return len(dataset)
    except TypeError:  # a generator, an iterator, an IterableDataset
        return None


def _summary(dataset: Any) -> str:
    """A one-line description of a user's dataset for reprs (never its contents)."""
    name = type(dataset).__name__
    try:
        return f"<{name} of {len(dataset)} batches>"
    except TypeError:  # no len(): a generator, an iterator, an IterableDataset
        return f"<{name}>"


class DistributedDataset(DescribedDataset, Positioned):
    """Global batches split across replicas (`strategy.experimental_distribute_dataset`).

    Each global batch is split along its first axis across the `num_workers * len(devices)`
    replicas of the job (see `crossdevice._input.batching` for the rule); this worker
    keeps the slices of its own replicas `[worker_index * R, (worker_index + 1) * R)`.
    Every worker must read the same global batches in the same order.

    Args:
        dataset: an iterable of global batches, each a nest of NumPy arrays or torch
            tensors with a common leading dimension.
        devices: this worker's replica devices, in replica order.
        num_workers: the number of workers in the job.
        worker_index: this worker's index in `[0, num_workers)`.
        options: `InputOptions`; `PER_REPLICA` mode is NotImplementedError here, as in TF.

    Example:
        >>> import numpy as np
        >>> dist = DistributedDataset([np.arange(4)], devices=("CPU:0", "CPU:1"))
        >>> [v.tolist() for v in next(iter(dist)).values]
        [[0, 1], [2, 3]]
    """

    def __init__(
        self,
        dataset: Iterable[Any],
        *,
        devices: Sequence[str],
        num_workers: int = 1,
        worker_index: int = 0,
        options: InputOptions | None = None,
    ) -> None:
        _check_iterable(dataset, "dataset")
        self._options = check_options(options, from_function=False)
        self._layout = _Layout(
            devices, num_workers, worker_index, self._options.experimental_fetch_to_device
        )
        self._dataset = dataset
        self._sources = (Source(dataset, "experimental_distribute_dataset"),)
        self._step_sync: StepSync | None = None
        self._progress: EpochCounter = EpochCounter(0, lambda: _length(dataset), (dataset,))

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas across all workers that each batch is split over."""
        return self._layout.num_global

    @property
    def epoch(self) -> int:
        """The epoch the next `iter()` reads: one more after each, the saved one after a restore.

        A resumable loop starts there: `for epoch in range(dist.epoch, EPOCHS)`.
        """
        return self._progress.next_epoch

    def state_dict(self) -> dict[str, Any]:
        """The data position of the latest iterator (see `DistributedIterator.state_dict`).

        Once that iterator has handed out a whole epoch (it ended, or it took `len(dataset)`
        steps), the position is the start of the next epoch.
        """
        return self._progress.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next `iter()` continue at the saved position (and `epoch` say which)."""
        self._progress.load_state_dict(state)

    def __iter__(self) -> DistributedIterator:
        layout = self._layout
        tracker = self._progress.begin()
        source: list[Any] = []
        agreement: list[PassAgreement] = []
        last: list[Any] = [_END]
        where = (layout.num_global, layout.replica_ids)

        def skip(batches: Any, saved: Any) -> Any:
            return skip_examples(batches, saved, layout.num_global)

        def next_step() -> Any:
            if not source:
                source.append(tracker.open(self._sources[0].batches, skip))
                # A pass from its start has as many steps as the dataset's exact length.
                fresh = source[0] is not None and tracker.position.steps == 0
                steps = exact_length(self._dataset) if fresh else None
                agreement.append(PassAgreement(self._step_sync, steps))
            batches = source[0]
            batch = _END if batches is None else next(batches, _END)
            ended = batch is _END
            split = None if ended else split_batch_leaves(batch, *where)
            if not agreement[0].goes_on(not ended, None if split is None else split[2]):
                tracker.end()
                raise StopIteration
            if split is None:
                batch = _empty_step(last[0])
                split = split_batch_leaves(batch, *where)
            last[0] = batch
            structure, sliced, size = split
            if not ended:
                tracker.advance(size)
            return layout.regroup_leaves(structure, sliced)

        return DistributedIterator(next_step, tracker, self._step_sync, self._element_spec)

    def __repr__(self) -> str:
        return (
            f"DistributedDataset(dataset={_summary(self._dataset)}, "
            f"devices={self._layout.devices!r}, "
            f"num_workers={self._layout.num_workers}, worker_index={self._layout.worker_index})"
        )


class DistributedDatasetsFromFunction(DescribedDataset, Positioned):
    """Per-replica batches from a user's `dataset_fn` (`distribute_datasets_from_function`).

    In `PER_WORKER` mode (the default) `dataset_fn(InputContext(num_workers, worker_index,
    num_replicas_in_sync))` is called once, here, and each step every local replica takes
    the next element in turn. In `PER_REPLICA` mode it is called once per local replica
    with `InputContext(num_workers * R, worker_index * R + i, num_replicas_in_sync)` and
    each replica reads its own iterable. Elements are per-replica batches: nothing is
    rebatched or sharded, so `dataset_fn` should shard by `input_pipeline_id` and batch by
    `get_per_replica_batch_size`.

    Args:
        dataset_fn: a function from `InputContext` to an iterable of per-replica batches.
        devices: this worker's replica devices, in replica order.
        num_workers: the number of workers (input pipelines in `PER_WORKER` mode).
        worker_index: this worker's index.
        num_replicas_in_sync: the number of replicas across all workers.
        options: `InputOptions`.

    Example:
        >>> import numpy as np
        >>> def dataset_fn(ctx):
        ...     size = ctx.get_per_replica_batch_size(4)
        ...     return [np.arange(i, i + size) for i in range(0, 8, size)]
        >>> dist = DistributedDatasetsFromFunction(
        ...     dataset_fn, devices=("CPU:0", "CPU:1"), num_replicas_in_sync=2
        ... )
        >>> [[v.tolist() for v in step.values] for step in dist]
        [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    """

    def __init__(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        *,
        devices: Sequence[str],
        num_workers: int = 1,
        worker_index: int = 0,
        num_replicas_in_sync: int,
        options: InputOptions | None = None,
    ) -> None:
        if not callable(dataset_fn):
            raise TypeError(
                f"dataset_fn must be a function taking an InputContext, got {dataset_fn!r}"
            )
        self._options = check_options(options, from_function=True)
        self._layout = _Layout(
            devices, num_workers, worker_index, self._options.experimental_fetch_to_device
        )
        layout = self._layout
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            self._input_contexts = tuple(
                InputContext(layout.num_global, replica, num_replicas_in_sync)
                for replica in layout.replica_ids
            )
        else:
            self._input_contexts = (InputContext(num_workers, worker_index, num_replicas_in_sync),)
        self._datasets = tuple(self._call(dataset_fn, ctx) for ctx in self._input_contexts)
        self._sources = tuple(Source(d, "dataset_fn's result") for d in self._datasets)
        self._step_sync: StepSync | None = None
        pipelines = num_workers if len(self._datasets) == 1 else layout.num_global
        self._progress: EpochCounter = EpochCounter(pipelines, lambda: None, self._datasets)

    @staticmethod
    def _call(dataset_fn: Callable[[InputContext], Iterable[Any]], ctx: InputContext) -> Any:
        dataset = dataset_fn(ctx)
        _check_iterable(dataset, f"dataset_fn({ctx!r})'s result")
        return dataset

    @property
    def input_contexts(self) -> tuple[InputContext, ...]:
        """The `InputContext` of each call of `dataset_fn` on this worker."""
        return self._input_contexts

    @property
    def epoch(self) -> int:
        """The epoch the next `iter()` reads (see `DistributedDataset.epoch`)."""
        return self._progress.next_epoch

    def state_dict(self) -> dict[str, Any]:
        """The data position of the latest iterator, in steps (see `DistributedDataset`)."""
        return self._progress.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next `iter()` continue after the saved number of steps.

        Exact when the number of input pipelines is the saved one; otherwise a log line
        warns that examples may repeat or be skipped.
        """
        self._progress.load_state_dict(state)

    def __iter__(self) -> DistributedIterator:
        layout = self._layout
        tracker = self._progress.begin()
        iterators: list[Any] = []
        per_worker = len(self._datasets) == 1
        exhausted = [False] * len(self._datasets)
        agreement: list[PassAgreement] = []
        last: list[Any] = [_END]

        def pull(source: int) -> Any:
            if exhausted[source]:
                return _END
            try:
                return next(iterators[source])
            except StopIteration:
                exhausted[source] = True
                return _END

        def step_elements() -> list[Any]:
            if per_worker:
                # Each local replica takes the next element in turn; once the pipeline
                # runs dry, the rest of the step is padded and the next step stops.
                return [pull(0) for _ in range(layout.num_local)]
            return [pull(i) for i in range(layout.num_local)]

        def skip(made: list[Any], saved: Any) -> tuple[list[Any], int, int, int]:
            iterators.extend(made)
            if not per_worker or (saved.steps and not saved.examples):  # steps
                return (
                    iterators,
                    *skip_steps(saved.steps, layout.num_local, per_worker, pull, _END),
                    0,
                )
            # The examples the pipeline had handed out, however many local replicas took
            # them (the bug hunt of session 58: 2 replicas' steps replayed on 3 skipped 4).
            read = drop_examples(saved.examples, functools.partial(pull, 0), _END, keep)
            steps = saved.steps if read == saved.examples else 0
            return iterators, steps, read, 0

        def keep(element: Any) -> None:
            iterators[0] = itertools.chain([element], iterators[0])

        def next_step() -> Any:
            if not tracker.started:
                made = tracker.open(lambda: [s.batches() for s in self._sources], skip)
                if made is None:
                    exhausted[:] = [True] * len(exhausted)
                elif not iterators:
                    iterators.extend(made)
                # Each worker's own pipelines: lengths may differ, every step agrees.
                agreement.append(PassAgreement(self._step_sync, None))
            elements = step_elements()
            present = [e for e in elements if e is not _END]
            if not agreement[0].goes_on(bool(present)):
                tracker.end()
                raise StopIteration
            if present:  # per worker: the examples its pipeline handed out
                examples = sum(examples_in(e) for e in present) if per_worker else 0
                tracker.advance(examples, global_batch=False)
            template = present[0] if present else _empty_step(last[0])
            last[0] = template
            per_replica = [
                _empty_like(template, i) if e is _END else e for i, e in enumerate(elements)
            ]
            return layout.regroup(per_replica)

        return DistributedIterator(next_step, tracker, self._step_sync, self._element_spec)

    def __repr__(self) -> str:
        return (
            f"DistributedDatasetsFromFunction(input_contexts={self._input_contexts!r}, "
            f"devices={self._layout.devices!r})"
        )
