"""Across workers, a second thread's run or collective while a run is in flight is refused.

Workers pair their collectives in the order each one issues them, and the fingerprint
they compare (kind, op, dtype, shape, structure, call site) cannot say which thread made
a call: two threads that run steps of the same function concurrently are ordered by
timing, differently on each worker, and their collectives pair across threads with
every check passing (the bug hunt: X*1 on one thread and X*10 on another, both reduced
across two workers, gave 11 where 2 and 20 were due). Within one process the replicas
meet in one rendezvous per run, so runs from several threads simply take turns there.

So are the collectives of any other thread while a run is in flight on this worker (a
monitoring thread's `strategy.reduce`, a SyncOnRead variable's value, a checkpoint): a
metrics helper used both in the step's merge_fn and by such a thread gave 101 where 200
and 2 were due, on both workers. The communicator asks before each collective
(`Sequencer.runs`): the run's caller, its replica threads (a nested run's too) and the
communicator's own queue thread belong to it; any other thread is refused at once, and
the group ended so that no peer waits for its collective or pairs with it.
"""

from __future__ import annotations

from typing import Any, Final

from crossdevice._core import purpose
from crossdevice._replica import refusals
from crossdevice._replica.runner import ReplicaRunner

__all__ = ["one_thread_runs"]

#: The strategy these refusals name (runs are refused only across workers).
_NAME: Final = "MultiWorkerMirroredStrategy"

#: Why a concurrent run across workers is refused (the runner's error says what to do).
_WHY: Final = (
    "Across workers, collectives pair in the order each worker issues them, and nothing in "
    "them says which thread issued them: two threads' runs would be paired by timing, "
    "differently on each worker, with silently wrong results. This worker's peers are "
    "told (the group is ended)."
)


def one_thread_runs(runner: ReplicaRunner, worker_communicator: Any) -> ReplicaRunner:
    """`runner`, refusing other threads' runs and collectives during its runs, across workers.

    Args:
        runner: the strategy's local replica runner.
        worker_communicator: the strategy's communicator to the other workers, or None
            (one worker: runs from several threads take turns, as in `MirroredStrategy`).

    Returns:
        `runner` itself.
    """
    runner.refuse_concurrent_runs = None if worker_communicator is None else _WHY
    # The one place every cross-worker collective of the strategy passes (its numbering).
    sequencer = getattr(worker_communicator, "_sequencer", None)
    if sequencer is not None:
        sequencer.runs = _RunMembership(runner)
    return runner


class _RunMembership:
    """Whether the calling thread's collective belongs to `runner`'s run in flight.

    Called by the communicator before each collective (`Sequencer.runs`): True, it does;
    False, no run is in flight; else the refusal's message.
    """

    __slots__ = ("_runner",)

    def __init__(self, runner: ReplicaRunner) -> None:
        self._runner = runner

    def __call__(self, collective: str) -> bool | str:
        runner = self._runner
        owner = runner._run_thread  # set for the whole run, nested runs included
        if owner is None:
            return False
        if runner.inside_run():  # its caller, its replica threads, a nested run's
            return True
        what = purpose.current()  # what it is for, in the user's words, if known
        described = f"{collective} ({what})" if what else collective
        return refusals.collective_beside_run(_NAME, described, owner)
