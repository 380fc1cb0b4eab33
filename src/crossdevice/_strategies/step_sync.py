"""The workers' agreement whether a step of a distributed dataset goes on (`StepSync`).

`MultiWorkerMirroredStrategy` gives each distributed dataset one (`_input/agreement.py`
decides when to call it): a has-data collective per step, or none where the workers
agreed on the data's length and a step's own collective ran since the last agreement.
Either way the workers compare the digests of their global batches (`_comm/workers/
has_data.py`). `refuse_sharded` refuses a `DistributedSampler` at once: under
`experimental_distribute_dataset` it is never right.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final, Protocol

from crossdevice._comm.protocol import Pending
from crossdevice._comm.workers.has_data import SAME_BATCHES, carried_state, different_batches
from crossdevice._core.purpose import purpose
from crossdevice._input.agreement import Agreed

__all__ = ["StepSync", "clearer", "refuse_sharded"]

#: What a distributed dataset's per-step collective is, for the errors about it.
_NEXT_BATCH: Final = (
    "next(iterator) of a distributed dataset: its per-step check that some worker still has "
    "data, a collective every worker makes at every step"
)

#: What the end of a pass over a distributed dataset compares, for the errors about it.
_LAST_STEP: Final = "the end of a pass over a distributed dataset: what the last step left"


class _Steps(Protocol):
    """What `StepSync` reads and sets on the strategy (`_MultiWorkerExtended`)."""

    _has_data_pending: Pending | None
    _step_input: int | None
    _final_state: Callable[[], Any] | None

    def _tell_workers(self, err: BaseException, where: str = "") -> None: ...


class StepSync:
    """The workers' agreement whether a step goes on (`crossdevice._input.agreement`).

    Args:
        extended: the strategy's extended object (where a step's collectives look).
        communicator: its worker communicator.
    """

    def __init__(self, extended: _Steps, communicator: Any) -> None:
        self._extended = extended
        self._communicator = communicator
        #: the communicator's sequence number after the last agreement (made or skipped).
        self._mark = -1

    def agree(
        self,
        has_data: bool,
        steps: int | None,
        size: int | None = None,
        batch: tuple[int, int] | None = None,
    ) -> tuple[bool, Agreed | None]:
        """One has-data collective (`agreement.StepSync.agree`)."""
        communicator = self._communicator
        with purpose(_NEXT_BATCH), clearer():  # (a skipped step's digest may ride here)
            pending = communicator.any_has_data_async(has_data, steps=steps, size=size, batch=batch)
        self._mark = communicator.sequence_number
        self._extended._step_input = None  # (a first step's sizes are compared here)
        if not has_data:  # the answer is needed now
            with clearer():
                answer = pending.wait()
            if steps is None:
                return bool(answer), None
            return bool(answer[0]), lambda: answer[1]
        # This worker has data, so some worker has: the answer is known. The agreement
        # (peers that ran dry wait on it) is left in flight, to overlap with the step;
        # the step's first collective, or the end of `run`, completes it and raises
        # what it found.
        self._extended._has_data_pending = pending
        return True, None if steps is None else lambda: pending.wait()[1]

    def failed(self, error: BaseException) -> None:
        """This worker's step input raised `error`: tell the other workers."""
        self._extended._tell_workers(error)

    def ended(self) -> None:
        """The pass is over on every worker: compare what its last step left."""
        final = self._extended._final_state
        if final is None:
            return
        with purpose(_LAST_STEP), final():
            self._communicator.barrier()

    def skip(self, size: int | None, batch: tuple[int, int] | None = None) -> bool:
        """Count this step's agreement as made, without a collective, if that is safe.

        `batch` (the step's `(step, digest)`) rides in the next collective's state.
        """
        communicator = self._communicator
        if communicator.sequence_number == self._mark:
            return False  # no collective since the last agreement: agree for real
        with purpose(_NEXT_BATCH):
            communicator.has_data_known(None if batch is None else carried_state(batch))
        self._mark = communicator.sequence_number
        self._extended._step_input = size
        return True


class clearer:  # noqa: N801 - used as a function, like `purpose`
    """Inside, a mismatch of the workers' carried batch digests gets its own error.

    A skipped has-data agreement's digest rides in the state of the next collective
    (`StepSync.skip`); when the workers' digests differ, that collective's state
    mismatch says so in each worker's detail, and this raises `has_data`'s error (which
    says what to do) from it. A class rather than a generator: it wraps every step.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        better = None if error is None else different_batches(error)
        if better is not None:
            raise better from error


def refuse_sharded(dataset: Any) -> None:
    """Refuse a torch `DataLoader` sampled by a `DistributedSampler` (see the module doc).

    Raises:
        ValueError: its sampler, or its batch sampler's sampler, is one.
    """
    data = sys.modules.get("torch.utils.data")
    if data is None or not isinstance(dataset, data.DataLoader):
        return
    batch_sampler = getattr(dataset, "batch_sampler", None)
    for sampler in (getattr(dataset, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(sampler, data.DistributedSampler):
            raise ValueError(
                "MultiWorkerMirroredStrategy.experimental_distribute_dataset expects every "
                "worker's DataLoader to give the same global batches, got a DataLoader "
                "whose sampler is a DistributedSampler (num_replicas="
                f"{getattr(sampler, 'num_replicas', '?')}, rank={getattr(sampler, 'rank', '?')}), "
                f"which gives each worker a different shard. {SAME_BATCHES}"
            )
