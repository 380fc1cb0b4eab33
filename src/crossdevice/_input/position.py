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

With `distribute_datasets_from_function` the elements are per-replica batches of each
worker's own pipeline, so the position is a number of steps, exact when the number of
input pipelines is unchanged.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import numpy as np

from crossdevice._arrays import global_random
from crossdevice._input.batching import batch_size_of

__all__ = ["DataPosition", "EpochCounter", "Pass", "skip_examples"]

_LOG: Final = logging.getLogger("crossdevice")

_FIELDS: Final = ("epoch", "steps", "examples", "global_batch_size", "input_pipelines")


@dataclasses.dataclass
class DataPosition:
    """One pass's progress: what `state_dict()` of a distributed dataset or iterator holds.

    Attributes:
        epoch: which pass over the data (0 for the first `iter()`).
        steps: steps taken in it (global batches handed out).
        examples: examples handed out in it (global batches only; 0 otherwise).
        global_batch_size: examples in its first global batch (0 before the first).
        input_pipelines: the number of input pipelines (datasets from a function), or 0.
        exhausted: the pass ran to its end.
        random: the global random state when its pipeline was created, if it was.
    """

    epoch: int = 0
    steps: int = 0
    examples: int = 0
    global_batch_size: int = 0
    input_pipelines: int = 0
    exhausted: bool = False
    random: dict[str, np.ndarray] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The position as plain values (ints, a bool, uint8 arrays)."""
        state: dict[str, Any] = {name: getattr(self, name) for name in _FIELDS}
        state["exhausted"] = self.exhausted
        state["random"] = dict(self.random) if self.random is not None else None
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
        values = {}
        for name in _FIELDS:
            value = state[name]
            if isinstance(value, np.ndarray | np.generic) and np.ndim(value) == 0:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"{what}: the saved data position's {name!r} must be an int >= 0, got {value!r}"
                )
            values[name] = value
        random = state.get("random")
        if random is not None and not isinstance(random, Mapping):
            raise ValueError(f"{what}: the saved 'random' state must be a dict, got {random!r}")
        return cls(
            **values,
            exhausted=bool(state["exhausted"]),
            random=None if random is None else {k: np.asarray(v) for k, v in random.items()},
        )


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
    """

    def __init__(self, epoch: int, input_pipelines: int, resume: DataPosition | None) -> None:
        self.position = DataPosition(epoch=epoch, input_pipelines=input_pipelines)
        self.resume = resume
        self.started = False

    def load(self, state: Mapping[str, Any]) -> None:
        """Fast-forward this not yet started pass to a saved position (`load_state_dict`)."""
        if self.started:
            raise RuntimeError(
                "load_state_dict() repositions a fresh iterator: this one has handed out "
                f"{self.position.steps} steps already. Call it on a new iter(dataset) before "
                "its first next(), or restore the dataset instead"
            )
        saved = DataPosition.from_state(state, "DistributedIterator.load_state_dict")
        self.position.epoch = saved.epoch
        self.resume = saved

    def open(self, make: Callable[[], Any], skip: Callable[[Any, DataPosition], Any]) -> Any:
        """Make the pipeline's iterator: fresh, or recreated and fast-forwarded to `resume`.

        `skip(iterator, saved)` drops what `saved` consumed and returns `(iterator, steps,
        examples, first_batch_size)`. None when the restored pass had ended.
        """
        self.started = True
        saved = self.resume
        position = self.position
        if saved is None or (saved.random is None and saved.steps == 0):
            position.random = global_random.capture()
            return make()
        if saved.exhausted:
            position.steps, position.examples = saved.steps, saved.examples
            position.global_batch_size = saved.global_batch_size
            position.exhausted = True
            return None
        if saved.input_pipelines != position.input_pipelines:
            _LOG.warning(
                "the data position was saved with %d input pipelines and this job has %d: "
                "each pipeline resumes after %d steps, which repeats or skips examples unless "
                "the pipelines shard the data alike",
                saved.input_pipelines,
                position.input_pipelines,
                saved.steps,
            )
        with global_random.replayed(saved.random):
            position.random = saved.random if saved.random is not None else global_random.capture()
            iterator, steps, examples, first = skip(make(), saved)
        position.steps, position.examples = steps, examples
        position.global_batch_size = first
        return iterator

    def advance(self, examples: int) -> None:
        """Count one step that handed out `examples` global examples."""
        position = self.position
        position.steps += 1
        position.examples += examples
        if not position.global_batch_size:
            position.global_batch_size = examples

    def end(self) -> None:
        """The pass ran to its end."""
        self.position.exhausted = True


class EpochCounter:
    """A distributed dataset's epochs: the next one to start, the latest pass, a resume.

    Args:
        input_pipelines: recorded in every position (datasets from a function), else 0.
        length: the number of steps an epoch has, when the dataset knows it (`len()`).
    """

    def __init__(self, input_pipelines: int, length: Callable[[], int | None]) -> None:
        self._input_pipelines = input_pipelines
        self._length = length
        self.next_epoch = 0
        self._latest: Pass | None = None
        self._pending: DataPosition | None = None

    def begin(self) -> Pass:
        """The pass of a new iterator: the next epoch, or the restored one."""
        pending, self._pending = self._pending, None
        epoch = pending.epoch if pending is not None else self.next_epoch
        self.next_epoch = epoch + 1
        self._latest = Pass(epoch, self._input_pipelines, pending)
        return self._latest

    def state_dict(self) -> dict[str, Any]:
        """Where the dataset stands: its latest pass, moved to the next epoch once complete."""
        if self._pending is not None:
            return self._pending.state_dict()
        latest = self._latest
        if latest is None:
            return DataPosition(self.next_epoch, input_pipelines=self._input_pipelines).state_dict()
        position = latest.position
        if latest.resume is not None and not latest.started:
            position = latest.resume
        length = self._length()
        if position.exhausted or (length is not None and position.steps >= length):
            return DataPosition(
                position.epoch + 1, input_pipelines=self._input_pipelines
            ).state_dict()
        return position.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next `iter()` resumes the saved position (the next epoch if it had ended)."""
        saved = DataPosition.from_state(state, "load_state_dict of a distributed dataset")
        if saved.exhausted:
            saved = DataPosition(saved.epoch + 1, input_pipelines=saved.input_pipelines)
        self._pending = saved
        self.next_epoch = saved.epoch
