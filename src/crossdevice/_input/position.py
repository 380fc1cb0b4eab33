"""Where a distributed dataset stands: the data position a checkpoint saves and restores.

A position counts what one pass over the data (one `iter(dataset)`, an *epoch*) has
handed out: its epoch number, the steps taken and, for global batches
(`experimental_distribute_dataset`), the examples consumed and the global batch size.
Nothing in it depends on the layout: every worker reads the same global batches, so the
position is the job's, and a run restored on another number of workers or replicas
continues at the next global batch, with no example repeated or skipped.

A pass also remembers the global random state at the moment its pipeline was created
(`global_random.capture`). A shuffling `DataLoader` draws its order from torch's global
generator exactly then, so recreating the pipeline under that state gives the epoch's
order again. Restoring a mid-epoch position replays it: the pipeline is recreated under
the saved state and the consumed prefix is read and dropped (fast-forwarded), then the
random state the checkpoint restored is put back.

A loader may draw from generators of its own instead (`DataLoader(generator=g)`, a
`RandomSampler(generator=g)`; `crossdevice._input.generators`), which advance once per
epoch. A pass remembers their states at the same moment, and a position also holds their
states when it was taken (`state_dict()`). Restoring a position sets them to the latter
at once, as restoring a tracked `torch.Generator` would, so that the next epochs draw what
they would have drawn, tracked or not; a mid-epoch replay runs under the former and then
puts the generators back. A saved mid-epoch position without their states (written
before they were kept) cannot be replayed: that is an error, not repeated examples.

A `DataLoader` with persistent workers draws more on its first `iter()` than on a later
one (`crossdevice._input.persistent`): a position records which its pass's was, and a
replay in a fresh process first makes the loader's workers when the saved pass's `iter()`
was a later one, so that it draws the same order.

With `distribute_datasets_from_function` the elements are per-replica batches of each
worker's own pipeline, so the position counts the elements read from each pipeline (in
`examples`): exact when the number of input pipelines is unchanged, whatever the number
of local replicas that take them. (A position written before counted steps alone, with
`examples` 0: it is replayed in steps, exact only on the saved local replica count.)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

import numpy as np

from crossdevice._arrays import global_random
from crossdevice._input import generators, persistent
from crossdevice._input.batching import batch_size_of

__all__ = ["DataPosition", "EpochCounter", "Pass", "Positioned", "skip_examples"]

_LOG: Final = logging.getLogger("crossdevice")

_FIELDS: Final = ("epoch", "steps", "examples", "global_batch_size", "input_pipelines")


@dataclasses.dataclass
class DataPosition:
    """One pass's progress: what `state_dict()` of a distributed dataset or iterator holds.

    Attributes:
        epoch: which pass over the data (0 for the first `iter()`).
        steps: steps taken in it (global batches handed out).
        examples: examples handed out in it (global batches); for datasets from a
            function, the elements read from each input pipeline.
        global_batch_size: examples in its first global batch (0 before the first).
        input_pipelines: the number of input pipelines (datasets from a function), or 0.
        exhausted: the pass ran to its end.
        random: the global random state when its pipeline was created, if it was.
        generators: the states of the dataset's own generators (`generators.find`) then.
        generators_now: their states when the position was taken (`state_dict()`).
        loaders_started: for each persistent-worker `DataLoader` of the pipeline
            (`persistent.find`), whether it had made its workers when the pass began;
            None where unknown (a position written before it was kept).
    """

    epoch: int = 0
    steps: int = 0
    examples: int = 0
    global_batch_size: int = 0
    input_pipelines: int = 0
    exhausted: bool = False
    random: dict[str, np.ndarray] | None = None
    generators: dict[str, np.ndarray] | None = None
    generators_now: dict[str, np.ndarray] | None = None
    loaders_started: list[bool] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The position as plain values (ints, a bool, uint8 arrays)."""
        state: dict[str, Any] = {name: getattr(self, name) for name in _FIELDS}
        state["exhausted"] = self.exhausted
        for name in ("random", "generators", "generators_now"):
            value = getattr(self, name)
            state[name] = dict(value) if value is not None else None
        state["loaders_started"] = self.loaders_started
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any], what: str) -> DataPosition:
        """Check and read a `state_dict()`; ValueError naming the field that is wrong."""
        if not isinstance(state, Mapping):
            raise TypeError(f"{what} expects a dict from state_dict(), got {state!r}")
        missing = [name for name in (*_FIELDS, "exhausted") if name not in state]
        if missing:
            raise ValueError(
                f"{what}: the saved data position lacks {missing!r}; expected the dict that "
                f"a distributed dataset's or iterator's state_dict() returns, got keys "
                f"{sorted(state)!r}"
            )
        values: dict[str, Any] = {}
        for name in _FIELDS:
            value = state[name]
            if isinstance(value, np.ndarray | np.generic) and np.ndim(value) == 0:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"{what}: the saved data position's {name!r} must be an int >= 0, got {value!r}"
                )
            values[name] = value
        states: dict[str, Any] = {}
        for name in ("random", "generators", "generators_now"):  # optional: older positions
            value = state.get(name)
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"{what}: the saved {name!r} state must be a dict, got {value!r}")
            states[name] = None if value is None else {k: np.asarray(v) for k, v in value.items()}
        started = state.get("loaders_started")  # optional: older positions
        if started is not None:
            flags = list(np.asarray(started).reshape(-1).tolist())
            if not all(isinstance(flag, bool) for flag in flags):
                raise ValueError(
                    f"{what}: the saved 'loaders_started' must be a list of bools, one per "
                    f"DataLoader with persistent workers, got {started!r}"
                )
            started = flags
        return cls(**values, exhausted=bool(state["exhausted"]), loaders_started=started, **states)


def skip_examples(
    batches: Iterator[Any], saved: DataPosition, num_replicas: int
) -> tuple[Iterator[Any], int, int, int]:
    """Read and drop the global batches that `saved` had consumed.

    Batches are dropped while they fit in the saved number of examples, so with the
    saved global batch size exactly `saved.steps` are dropped. With another batch size
    the position is recomputed from the examples (and logged); a batch that straddles
    the saved position is kept, so its first examples are seen twice rather than never.

    Returns:
        `(batches, steps, examples, first_batch_size)`: the iterator to go on with (the
        straddling batch put back in front), and what was dropped.
    """
    steps = examples = first = 0
    while examples < saved.examples:
        batch = next(batches, _END)
        if batch is _END:
            _LOG.warning(
                "the restored data position is %d examples into epoch %d, but this dataset "
                "ended after %d: the epoch is over (is it the dataset the checkpoint was "
                "written with?)",
                saved.examples,
                saved.epoch,
                examples,
            )
            return iter(()), steps, examples, first
        size = batch_size_of(batch, num_replicas)
        first = first or size
        if examples + size > saved.examples:
            batches = itertools.chain([batch], batches)
            break
        examples += size
        steps += 1
    if first and saved.global_batch_size and first != saved.global_batch_size:
        again = saved.examples - examples
        _LOG.warning(
            "the checkpoint was written with global batch size %d and this dataset's batches "
            "have %d examples: the data position is recomputed from the %d examples consumed "
            "in epoch %d, so %d batches are skipped%s",
            saved.global_batch_size,
            first,
            saved.examples,
            saved.epoch,
            steps,
            f" and the first {again} examples of the next batch are seen again" if again else "",
        )
    return batches, steps, examples, first


_END: Final[Any] = object()


class Pass:
    """One iterator's progress over its dataset, and the position it resumes from.

    Args:
        epoch: the pass's epoch number.
        input_pipelines: recorded in the position (datasets from a function), else 0.
        resume: a restored position to fast-forward to when the pipeline is made.
        datasets: what the pipeline iterates, searched for generators of its own.
        length: the number of global batches a pass has (`len()`), or None when unknown
            (then the pipeline may be anything, not only an iterator of batches).
    """

    def __init__(
        self,
        epoch: int,
        input_pipelines: int,
        resume: DataPosition | None,
        datasets: Sequence[Any] = (),
        length: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.position = DataPosition(epoch=epoch, input_pipelines=input_pipelines)
        self.resume = resume
        self.started = False
        self._datasets = datasets
        self._length = length

    def state_dict(self) -> dict[str, Any]:
        """Where this pass stands (its restored position until it starts), as plain values."""
        position = self.position
        if self.resume is not None and not self.started:
            position = self.resume
        return _taken(position, self._datasets)

    def load(self, state: Mapping[str, Any]) -> None:
        """Fast-forward this not yet started pass to a saved position (`load_state_dict`)."""
        if self.started:
            raise RuntimeError(
                "load_state_dict() repositions a fresh iterator: this one has handed out "
                f"{self.position.steps} steps already. Call it on a new iter(dataset) before "
                "its first next(), or restore the dataset instead"
            )
        what = "DistributedIterator.load_state_dict"
        saved = DataPosition.from_state(state, what)
        _restore_generators(saved, generators.find(self._datasets), what)
        self.position.epoch = saved.epoch
        self.resume = saved

    def check_state(self, state: Any, what: str) -> None:
        """What `load(state)` checks, writing nothing: ValueError if it would fail.

        Raises:
            TypeError: `state` is not a dict (`DataPosition.from_state`).
            ValueError: a damaged position, generator states that do not fit the
                dataset's own generators, or a pass that has started.
        """
        saved = DataPosition.from_state(state, what)
        if self.started:
            raise ValueError(
                f"{what}: the tracked iterator has handed out {self.position.steps} steps "
                "already, and a restore repositions a fresh iterator. Track a new "
                "iter(dataset) and restore before its first next(), or track the dataset itself"
            )
        _check_generators(saved, self._datasets, what)

    def snapshot(self) -> Callable[[], None]:
        """A function that puts back what `load` sets (epoch, resume, generators), as now."""
        position, epoch, resume = self.position, self.position.epoch, self.resume
        put_back = _generators_kept(self._datasets)

        def undo() -> None:
            position.epoch, self.resume = epoch, resume
            put_back()

        return undo

    def open(self, make: Callable[[], Any], skip: Callable[[Any, DataPosition], Any]) -> Any:
        """Make the pipeline's iterator: fresh, or recreated and fast-forwarded to `resume`.

        `skip(iterator, saved)` drops what `saved` consumed and returns `(iterator, steps,
        examples, first_batch_size)`. None when the restored pass had ended.
        """
        self.started = True
        saved = self.resume
        position = self.position
        own = generators.find(self._datasets)
        loaders = persistent.find(self._datasets)
        what = "resuming a distributed dataset"
        if saved is None or (saved.random is None and saved.steps == 0):
            if saved is not None:  # a restored epoch's start: its iter() as it would have been
                persistent.warm_up(
                    loaders,
                    saved.loaders_started,
                    own,
                    epoch=saved.epoch,
                    mid_epoch=False,
                    what=what,
                )
            position.loaders_started = persistent.started(loaders)
            position.random = global_random.capture()
            position.generators = generators.capture(own)
            return self._read_end_early(make(), own)
        if saved.exhausted:
            position.steps, position.examples = saved.steps, saved.examples
            position.global_batch_size = saved.global_batch_size
            position.exhausted = True
            return None
        if saved.input_pipelines != position.input_pipelines:
            _LOG.warning(
                "the data position was saved with %d input pipelines and this job has %d: "
                "each pipeline resumes after the %d elements (steps, in an older position) "
                "it had read, which repeats or skips examples unless the pipelines shard the "
                "data alike",
                saved.input_pipelines,
                position.input_pipelines,
                saved.examples or saved.steps,
            )
        # A replayed iter() must be a persistent loader's first or later one as the saved
        # pass's was: they draw differently (`persistent`).
        position.loaders_started = persistent.warm_up(
            loaders, saved.loaders_started, own, epoch=saved.epoch, mid_epoch=True, what=what
        )
        # The epoch's order comes from the generators' states when it began; after the
        # replay, they are put back to the states the restore gave them.
        with global_random.replayed(saved.random), generators.replayed(own, saved.generators, what):
            position.random = saved.random if saved.random is not None else global_random.capture()
            position.generators = saved.generators
            if saved.generators is None:
                position.generators = generators.capture(own)
            iterator, steps, examples, first = skip(self._read_end_early(make(), own), saved)
        position.steps, position.examples = steps, examples
        position.global_batch_size = first
        return iterator

    def _read_end_early(self, batches: Any, own: Sequence[Any]) -> Any:
        """`batches`, read to its end as soon as the pass's last batch is handed out.

        A position taken after an epoch's last step is the start of the next epoch, and
        holds the generators' states of that moment. But a loader with generators of its
        own draws from them once more when it is read to its end (a `RandomSampler`
        draws the empty tail of its permutation), so their states are the next epoch's
        only after that read: done at once, they are in the position too. A replay reads
        the end where the saved pass read it, before the generators are put back.
        """
        length = self._length()
        if not own or length is None or length < 1:
            return batches
        return _ending_early(batches, length)

    def advance(self, examples: int, *, global_batch: bool = True) -> None:
        """Count one step that handed out `examples` global examples.

        With `global_batch=False` (datasets from a function), `examples` is the number of
        elements the step read from each input pipeline, and no batch size is recorded.
        """
        position = self.position
        position.steps += 1
        position.examples += examples
        if global_batch and not position.global_batch_size:
            position.global_batch_size = examples

    def end(self) -> None:
        """The pass ran to its end."""
        self.position.exhausted = True


def _ending_early(batches: Iterator[Any], steps: int) -> Iterator[Any]:
    """The elements of `batches`; the one after the `steps`-th is read before that is handed out."""
    for count, batch in enumerate(batches, 1):
        if count == steps:
            after = next(batches, _END)
            yield batch
            if after is not _END:  # longer than its len(): hand the rest out as it comes
                yield after
                yield from batches
            return
        yield batch


def _taken(position: DataPosition, datasets: Sequence[Any]) -> dict[str, Any]:
    """`position.state_dict()` with the states the datasets' own generators have now.

    A position at an epoch's start that says nothing of the persistent loaders gets
    whether they have made their workers now: the next epoch's `iter()` is then a later one.
    """
    now = generators.capture(generators.find(datasets))
    started = position.loaders_started
    if started is None and position.steps == 0 and not position.exhausted:
        started = persistent.started(persistent.find(datasets))
    return dataclasses.replace(position, generators_now=now, loaders_started=started).state_dict()


def _check_generators(saved: DataPosition, datasets: Sequence[Any], what: str) -> None:
    """What `_restore_generators` checks of the saved states, writing nothing.

    The states must name the datasets' own generators, and those of now must load into
    generators like them (tried on fresh ones).
    """
    own = generators.find(datasets)
    for states in (saved.generators, saved.generators_now):
        if states is not None:
            generators.check(own, states, what)
    if own and saved.generators_now is not None:
        fresh = [type(g)(g.device) for g in own]
        generators.restore(fresh, saved.generators_now, what)


def _generators_kept(datasets: Sequence[Any]) -> Callable[[], None]:
    """A function that sets the datasets' own generators back to their states now."""
    own = generators.find(datasets)
    states = generators.capture(own)

    def undo() -> None:
        if states is not None:
            generators.restore(own, states, "putting a data position back")

    return undo


def _restore_generators(saved: DataPosition, own: Sequence[Any], what: str) -> None:
    """Set the dataset's own generators to their states in `saved`, after checking them.

    A position without them (written before they were kept) is an error mid-epoch: the
    epoch's order cannot be drawn again, and resuming would repeat and skip examples.
    """
    if saved.generators is not None:
        generators.check(own, saved.generators, what)
    if saved.generators_now is not None:
        generators.restore(own, saved.generators_now, what)
    if not own or saved.generators is not None or saved.generators_now is not None:
        return
    if saved.steps and not saved.exhausted:
        raise ValueError(
            f"{what}: the saved data position is {saved.steps} steps into epoch "
            f"{saved.epoch}, and this dataset's pipeline draws its order from "
            f"{len(own)} random generator(s) of its own (the generator= of a DataLoader or "
            "sampler), but the position holds no state of them (it was written before "
            "crossdevice kept them, or by a dataset without them): the epoch cannot be "
            "replayed, and resuming would repeat and skip examples. Expected a position "
            "saved by this dataset; restore a checkpoint written at an epoch's end, or "
            "restart the epoch with load_state_dict({**state, 'steps': 0, 'examples': 0})"
        )
    if saved.epoch or saved.exhausted:
        _LOG.warning(
            "the restored data position (epoch %d) holds no state of the %d random "
            "generator(s) of this dataset's own (the generator= of a DataLoader or sampler): "
            "the epoch draws its order from their current state, which is the uninterrupted "
            "run's only if they are tracked in the checkpoint too",
            saved.epoch,
            len(own),
        )


class EpochCounter:
    """A distributed dataset's epochs: the next one to start, the latest pass, a resume.

    Args:
        input_pipelines: recorded in every position (datasets from a function), else 0.
        length: the number of steps an epoch has, when the dataset knows it (`len()`).
        datasets: what each pass iterates, searched for generators of its own.
    """

    def __init__(
        self,
        input_pipelines: int,
        length: Callable[[], int | None],
        datasets: Sequence[Any] = (),
    ) -> None:
        self._input_pipelines = input_pipelines
        self._length = length
        self._datasets = datasets
        self.next_epoch = 0
        self._latest: Pass | None = None
        self._pending: DataPosition | None = None

    def begin(self) -> Pass:
        """The pass of a new iterator: the next epoch, or the restored one."""
        pending, self._pending = self._pending, None
        epoch = pending.epoch if pending is not None else self.next_epoch
        self.next_epoch = epoch + 1
        self._latest = Pass(epoch, self._input_pipelines, pending, self._datasets, self._length)
        return self._latest

    def state_dict(self) -> dict[str, Any]:
        """Where the dataset stands: its latest pass, moved to the next epoch once complete."""
        if self._pending is not None:
            return _taken(self._pending, self._datasets)
        latest = self._latest
        if latest is None:
            start = DataPosition(self.next_epoch, input_pipelines=self._input_pipelines)
            return _taken(start, self._datasets)
        position = latest.position
        if latest.resume is not None and not latest.started:
            position = latest.resume
        length = self._length()
        if position.exhausted or (length is not None and position.steps >= length):
            start = DataPosition(position.epoch + 1, input_pipelines=self._input_pipelines)
            return _taken(start, self._datasets)
        return _taken(position, self._datasets)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next `iter()` resumes the saved position (the next epoch if it had ended)."""
        what = "load_state_dict of a distributed dataset"
        saved = DataPosition.from_state(state, what)
        _restore_generators(saved, generators.find(self._datasets), what)
        if saved.exhausted:  # the next epoch: a later iter() of loaders that ran this one
            started = None if saved.loaders_started is None else [True] * len(saved.loaders_started)
            saved = DataPosition(
                saved.epoch + 1, input_pipelines=saved.input_pipelines, loaders_started=started
            )
        self._pending = saved
        self.next_epoch = saved.epoch

    def check_state(self, state: Any, what: str) -> None:
        """What `load_state_dict(state)` checks, writing nothing: ValueError if it would fail.

        Raises:
            TypeError: `state` is not a dict (`DataPosition.from_state`).
            ValueError: a damaged position, or generator states that do not fit the
                dataset's own generators.
        """
        _check_generators(DataPosition.from_state(state, what), self._datasets, what)

    def snapshot(self) -> Callable[[], None]:
        """A function that puts back what `load_state_dict` sets, as it is now.

        Not a `state_dict()` loaded back: of a dataset read part way, that would make the
        next `iter()` resume the latest pass instead of starting the next epoch.
        """
        pending, next_epoch = self._pending, self.next_epoch
        put_back = _generators_kept(self._datasets)

        def undo() -> None:
            self._pending, self.next_epoch = pending, next_epoch
            put_back()

        return undo


class Positioned:
    """Internal: a base class of the distributed datasets and iterator, for a restore.

    `crossdevice.train.Checkpoint` checks every value against its object before it loads
    any (`_check_state`), and should a load fail anyway, puts back what it had loaded
    (`_snapshot`, taken before; `crossdevice._train.rollback`). A subclass keeps its
    position in `_progress`: an iterator its `Pass`, a dataset its `EpochCounter`.
    """

    _progress: Pass | EpochCounter

    def _check_state(self, state: Any, what: str) -> None:
        """ValueError if `load_state_dict(state)` would fail, `what` leading the message.

        Writes nothing. Raises TypeError for a `state` that is not a dict.
        """
        self._progress.check_state(state, what)

    def _snapshot(self) -> Callable[[], None]:
        """A function that puts back what `load_state_dict` changes, as it is now."""
        return self._progress.snapshot()
