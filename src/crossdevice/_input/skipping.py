"""Fast-forwarding the pipelines of `distribute_datasets_from_function` to a saved position.

Their elements are per-replica batches, and a step reads one per local replica: from the
one pipeline of a worker (`PER_WORKER`), or one from each replica's own (`PER_REPLICA`).
A `PER_WORKER` position counts the examples its pipeline had handed out (an element's
leading dimension; one for an element without one), so a worker that resumes with
another number of local replicas drops exactly those, whether its `dataset_fn` batches
by a fixed size or by `get_per_replica_batch_size` (then the elements change size with
the replicas): the number of pipelines, not of replicas, is what must match (TF's
promise). With `PER_REPLICA` the pipelines are the replicas, and a step reads one element
from each: the position is the steps. Positions written before counted steps alone; they
are replayed in steps, each as many elements as this worker has replicas.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

from crossdevice._input.batching import batch_size_of

__all__ = ["drop_examples", "examples_in", "skip_steps"]

_LOG: Final = logging.getLogger("crossdevice")


def examples_in(element: Any) -> int:
    """The examples in a per-replica batch: its leading dimension, or 1 without one."""
    try:
        return batch_size_of(element)
    except (TypeError, ValueError):  # not a batch of arrays: one example
        return 1


def drop_examples(
    count: int, pull: Callable[[], Any], end: Any, keep: Callable[[Any], None]
) -> int:
    """Read and drop elements with `pull()` while they fit in `count` examples.

    An element that straddles `count` (the elements changed size since the position was
    saved, and do not divide it) goes back with `keep(element)`: its first examples are
    seen twice rather than never, and a log line says how many.

    Returns:
        The examples dropped (`count`, unless the pipeline ended first).
    """
    read = 0
    while read < count:
        element = pull()
        if element is end:
            break
        size = examples_in(element)
        if read + size > count:
            keep(element)
            _LOG.warning(
                "the restored data position is %d examples into this worker's input pipeline, "
                "and its elements (per-replica batches of %d) do not end there: the first %d "
                "examples of the next one are seen again (the per-replica batch size changed "
                "with the number of replicas?)",
                count,
                size,
                count - read,
            )
            break
        read += size
    return read


def skip_steps(
    steps: int, num_local: int, per_worker: bool, pull: Callable[[int], Any], end: Any
) -> tuple[int, int]:
    """Replay `steps` steps: `(steps, examples)` dropped (examples per worker only, else 0).

    Each step reads one element per local replica: from pipeline 0 in turn (per worker),
    or one from each replica's pipeline. Per worker, that is the saved run's reading only
    if it had `num_local` replicas on this worker too, which the position does not say:
    a log line says so.
    """
    if per_worker:  # a position written before the examples were counted
        _LOG.warning(
            "the restored data position of a distribute_datasets_from_function dataset counts "
            "%d steps and not the elements its input pipeline read (it was written by an older "
            "crossdevice): each step is replayed as %d elements, one per local replica, which "
            "repeats or skips examples unless the checkpoint was written with %d replicas on "
            "this worker",
            steps,
            num_local,
            num_local,
        )
    taken = examples = 0
    while taken < steps:
        pulled = [
            e for e in (pull(0 if per_worker else i) for i in range(num_local)) if e is not end
        ]
        if not pulled:
            break
        taken += 1
        if per_worker:  # counted from now on, as a new position counts them
            examples += sum(examples_in(e) for e in pulled)
    return taken, examples
