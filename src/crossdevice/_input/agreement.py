"""Whether a pass over the data goes on: decided alone, or agreed by every worker.

On one worker a pass goes on while its pipeline has data. Across workers
(`MultiWorkerMirroredStrategy`) every worker must stop at the same step, or one would
wait in a collective its peers never make: each step all-reduces a has-data flag (TF's
`get_next_as_optional` does the same), and a worker whose pipeline ran dry gets empty
batches while another still has data.

When the dataset's length is exact (`exact_length`: a list or tuple of global batches, a
map-style torch `DataLoader`), the first step's flag carries it too, in the same one
collective. If every worker gave the same length, every one has data for exactly that
many steps, and a later step needs no collective when one ran since the last agreement
(a training step's all-reduce). A step that made none agrees for real: so a worker that
takes a `next()` more than its peers, having made no collective since its last one,
agrees against a peer's collective, and both get the mismatch the per-step agreement
would have given. The skipped agreement is still numbered as a collective on every
worker (`has_data_known`), so sequence numbers and the flight recorder read as before.
With lengths that differ, or unknown, every step agrees. A dataset whose `len()` was
not what it yielded is an error on the worker that sees it, never a silent difference:
its peers fail in their next collective.

Each step the workers also compare what they hold: a digest of the global batch each
one read (`batch_digest`), in the step's has-data agreement, or, where that is skipped,
in the state of the step's next collective. Each worker keeps its own replicas' slices
of its own batch, so workers that read different batches of the same size (a
`DistributedSampler`, per-worker shards, a shuffle seeded by rank) would train some
examples and never the rest, silently: a `CollectiveMismatchError` on every worker
instead, before the step combines anything.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from crossdevice._core.callers import user_stacklevel
from crossdevice._input.batch_digest import batch_digest
from crossdevice._input.batching import last_split

__all__ = ["Agreed", "PassAgreement", "StepSync", "exact_length"]


class StepSync(Protocol):
    """The workers' agreement whether a step goes on (a multi-worker strategy's)."""

    def agree(
        self,
        has_data: bool,
        steps: int | None,
        size: int | None = None,
        batch: tuple[int, int] | None = None,
    ) -> tuple[bool, Agreed | None]:
        """One has-data collective: (whether any worker has data, `agreed`).

        `steps`: this worker's exact count of steps left (the first step of a pass over
        a dataset of exact length), else None; `agreed()` (None without `steps`) then
        gives the count every worker gave, or None where they differ. `size`: this
        worker's global batch size (the first step of a pass), compared with the other
        workers' that have data: a difference is a `CollectiveMismatchError` where the
        agreement completes. `batch`: `(step, digest)` of this worker's global batch
        (the step's number in the pass, `batch_digest`), compared alike.
        """

    def failed(self, error: BaseException) -> None:
        """This worker's step input raised `error`: tell the other workers (they may wait)."""

    def ended(self) -> None:
        """The pass is over on every worker: compare what its last step left.

        A step's state (its optimizers' settings, the changes to its reduced gradients)
        is compared by the next step's collectives; after the last one there is none.
        """

    def skip(self, size: int | None, batch: tuple[int, int] | None = None) -> bool:
        """Count this step's agreement as made, without a collective, if that is safe.

        Safe when a collective ran since the last agreement (the workers' collectives are
        compared): a step that made none agrees for real, so a worker that calls `next()`
        once more than its peers meets their collective with its agreement. `size`: this
        worker's global batch size for the step, which the step's collectives then carry
        in their call sites (workers that sliced global batches of different sizes would
        train on a mix of both: a `CollectiveMismatchError` instead). `batch`: `(step,
        digest)` of the step's global batch, which the next collective carries in its
        state (a difference: a `CollectiveMismatchError` before any value is combined).
        """


#: Gives the count of steps every worker agreed on, or None.
Agreed = Callable[[], int | None]


def exact_length(dataset: Any) -> int | None:
    """`len(dataset)` where it is exactly what iterating yields, else None.

    A `Sequence` (list, tuple, range) yields its length by definition; a torch
    `DataLoader` over a map-style dataset yields `len(batch_sampler)` batches. Anything
    else (a generator, an `IterableDataset`, an object with a `__len__` of its own) may
    yield another count, so it is agreed step by step.
    """
    if isinstance(dataset, Sequence) and not isinstance(dataset, str | bytes):
        return len(dataset)
    data = sys.modules.get("torch.utils.data")
    if (
        data is not None
        and type(dataset) is data.DataLoader
        and not isinstance(dataset.dataset, data.IterableDataset)
    ):
        return len(dataset)
    return None


class PassAgreement:
    """Decides, step by step, whether one pass over the data goes on (see the module doc).

    Args:
        sync: the workers' has-data agreement (None: one worker, decide alone).
        steps: this worker's exact count of steps in the pass, or None.
    """

    def __init__(self, sync: StepSync | None, steps: int | None) -> None:
        self._sync = sync
        self._steps = steps
        self._taken = 0
        self._agreed: Agreed | None = None
        self._count: int | None = None

    def goes_on(self, has_data: bool, size: int | None = None) -> bool:
        """Whether this step runs (on some worker there is data), given this worker's flag.

        `size`: this worker's global batch size (None: no data). At a pass's first step
        the workers compare it in the same collective: each worker slices its own global
        batch, so batches of different sizes would train on others' slices. Each step
        they also compare a digest of the batch just split (`batching.last_split`).

        Raises:
            RuntimeError: the workers agreed on the dataset's length and this worker's
                pipeline yielded another number of batches.
            CollectiveMismatchError: the workers' first global batches differ in size,
                or a step's global batches differ (here, or where the agreement left in
                flight completes, or in the step's next collective when the agreement
                was skipped), or what the pass's last step left differs between workers
                (`StepSync.ended`).
        """
        going = self._goes_on(has_data, size)
        if not going and self._sync is not None:
            self._sync.ended()  # every worker ends the pass here, alike
        return going

    def _goes_on(self, has_data: bool, size: int | None) -> bool:
        taken, self._taken = self._taken, self._taken + 1
        if self._sync is None:
            return has_data
        # The workers compare what they hold each step, in the collective the step makes
        # anyway (`StepSync`): each keeps its replicas' slices of its own global batch.
        leaves = None if size is None else last_split(size)
        batch = None if leaves is None else (taken + 1, batch_digest(leaves))
        if self._agreed is not None:  # the first step's answer, complete by now
            agreed, self._agreed = self._agreed, None
            self._count = agreed()
            if self._count is None:  # (this worker's length is exact: `_steps`)
                _warn_lengths(self._steps)
        if self._count is not None:
            if has_data != (taken < self._count):
                raise RuntimeError(
                    f"this worker's dataset yielded {'more' if has_data else 'fewer'} than "
                    f"its len() of {self._count} batches (every worker agreed on that length "
                    "at the first step, so no step agrees on has-data); expected len() to "
                    "count what iterating yields: fix the dataset's __len__ (or its "
                    "batch_sampler's), or pass an iterable without len()"
                )
            if self._sync.skip(size) if batch is None else self._sync.skip(size, batch):
                return has_data
            return self._agree(has_data, None, None, batch)[0]
        if taken:
            return self._agree(has_data, None, None, batch)[0]
        any_data, self._agreed = self._agree(has_data, self._steps, size, batch)
        return any_data

    def _agree(
        self, has_data: bool, steps: int | None, size: int | None, batch: tuple[int, int] | None
    ) -> tuple[bool, Agreed | None]:
        """`StepSync.agree`, given `batch` only where there is one."""
        assert self._sync is not None
        if batch is None:
            return self._sync.agree(has_data, steps, size)
        return self._sync.agree(has_data, steps, size, batch)


def _warn_lengths(steps: int | None) -> None:
    """The workers' global batch lists differ in length (the hunt of session 56: silent)."""
    warnings.warn(
        f"the workers passed experimental_distribute_dataset datasets of different lengths "
        f"(this worker's: {steps} global batches), or some worker's has no exact length: "
        "each worker takes its slice of the same global batches, so every worker must pass "
        "the same ones. A worker whose dataset ran out gets empty slices until the longest "
        "ends (TF's rule for uneven input), which trains on a mix that no single dataset "
        "gives. Pass every worker the same global batches, or give each worker its own "
        "pipeline with distribute_datasets_from_function",
        UserWarning,
        stacklevel=user_stacklevel(),  # the loop over the distributed dataset
    )
