"""The has-data agreement's header, and the error for workers holding other global batches.

A has-data collective has no values: what it carries rides in its fingerprint header.
The flag and the count of steps left are in `arg` (`fingerprint.has_data_arg`); its
`shape` fields, never compared for this kind, carry what the workers that have data
must share: the global batch size at a pass's first step, and each step the digest of
the global batch (`_input/batch_digest.py`) with the step's number in the pass. A step
whose agreement every worker skips (`has_data_known`) carries the digest in the state of
the next collective instead (`Sequencer.ended`); `carried_state` describes it there, and
`different_batches` turns the mismatch it causes into this module's error.

`experimental_distribute_dataset` splits each global batch among every worker's
replicas, and each worker keeps its own replicas' slices of the batch it read: workers
that read different batches (a `DistributedSampler`, per-worker shards, a shuffle seeded
by rank) train some examples and never the rest, silently, unless the batches are
compared.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Final

from crossdevice._comm.workers import fingerprint as fp
from crossdevice._core.errors import CollectiveMismatchError

__all__ = ["SAME_BATCHES", "answer", "carried_state", "different_batches", "header_shape"]

#: What to do, in every error about workers that read other global batches.
SAME_BATCHES: Final = (
    "experimental_distribute_dataset splits each global batch among all workers' replicas "
    "(each worker keeps its own replicas' slices of the batch it read), so every worker "
    "must iterate the same global batches: the same dataset, unsharded, shuffled with the "
    "same seed. A DistributedSampler or per-worker shards give each worker other data "
    "(some examples train, the rest never do): drop the sampler or the shard, or use "
    "strategy.distribute_datasets_from_function for per-worker input pipelines"
)

#: How a step's carried digest reads in a worker's mismatch detail (`carried_state`);
#: `different_batches` reads it back.
_CARRIED: Final = "the global batch of step {step} (experimental_distribute_dataset): {digest:016x}"
_CARRIED_RE: Final = re.compile(
    r"the global batch of step (\d+) \(experimental_distribute_dataset\): ([0-9a-f]{16})"
)


def header_shape(size: int | None, batch: tuple[int, int] | None) -> tuple[int, ...]:
    """A has-data header's `shape`: `(size + 1,)`, or with `batch` `(size + 1 or 0, digest, step)`.

    `size`: the global batch size (a pass's first step), else None; `batch`: `(step,
    digest)` of this worker's global batch, None without data.
    """
    if batch is None:
        return fp.has_data_size(size)
    step, digest = batch
    return (0 if size is None else size + 1, digest, step)


def answer(with_steps: bool, label: str = "has_data") -> Callable[[list[fp.Fingerprint]], Any]:
    """What the workers' has-data headers say (where the sizes and digests are compared).

    Raises (from the returned function, on every worker alike):
        CollectiveMismatchError: the workers that have data gave global batches of
            different sizes at a pass's first step, or of different digests.
    """

    def answered(prints: list[fp.Fingerprint]) -> Any:
        sizes = [p.shape[0] - 1 if p.shape and p.shape[0] else None for p in prints]
        if len({s for s in sizes if s is not None}) > 1:
            each = ", ".join(
                f"worker {w}: {'no data' if s is None else s}" for w, s in enumerate(sizes)
            )
            raise CollectiveMismatchError(
                f"{label}: the workers' first global batches of this pass differ in size "
                f"({each}); every worker must read the same global batches (each keeps "
                "its replicas' slices of them): use one global batch size on every worker"
            )
        held = [(p.shape[2], p.shape[1]) if len(p.shape) == 3 else None for p in prints]
        if len({b[1] for b in held if b is not None}) > 1:
            raise CollectiveMismatchError(_message(label, held))
        any_data = any(p.arg & 1 for p in prints)
        if not with_steps:
            return any_data
        counts = {(p.arg >> 1) - 1 for p in prints}
        count = counts.pop() if len(counts) == 1 else -1
        return any_data, (count if count >= 0 else None)

    return answered


def carried_state(batch: tuple[int, int]) -> tuple[int, Callable[[], str]]:
    """`(value, describe)` of a step's `(step, digest)` for the next collective's state."""
    step, digest = batch
    return digest, lambda: _CARRIED.format(step=step, digest=digest)


def different_batches(error: BaseException) -> CollectiveMismatchError | None:
    """This module's error for a state mismatch that carried digests that differ, else None.

    A collective that carried each worker's step digest (`carried_state`) and found the
    states different shows each worker's in its detail: when they differ, the workers
    held different global batches, whatever else differs.
    """
    if not isinstance(error, CollectiveMismatchError):
        return None
    found = _CARRIED_RE.findall(str(error))
    if len({digest for _, digest in found}) < 2:
        return None
    held = [(int(step), int(digest, 16)) for step, digest in found]
    label = str(error).partition(":")[0]
    # The collective's own report follows: what else differs (a global batch size, the
    # step's state), each worker's fingerprint.
    return CollectiveMismatchError(f"{_message(label, held)}\nThe collective's report: {error}")


def _message(label: str, held: Sequence[tuple[int, int] | None]) -> str:
    """The error: at which step, each worker's digest, and what to do."""
    step = next(b[0] for b in held if b is not None)
    each = ", ".join(
        f"worker {w}: {'no data' if b is None else f'{b[1]:016x}'}" for w, b in enumerate(held)
    )
    return (
        f"{label}: the workers hold different global batches at step {step} of this pass "
        f"over the dataset (each worker's digest of its global batch: {each}); expected "
        f"every worker's global batch to be the same. {SAME_BATCHES}"
    )
