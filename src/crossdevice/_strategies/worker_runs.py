"""Across workers, `strategy.run` from a second thread while another's is in flight is refused.

Workers pair their collectives in the order each one issues them, and the fingerprint
they compare (kind, op, dtype, shape, structure, call site) cannot say which thread made
a call: two threads that run steps of the same function concurrently are ordered by
timing, differently on each worker, and their collectives pair across threads with
every check passing (the bug hunt: X*1 on one thread and X*10 on another, both reduced
across two workers, gave 11 where 2 and 20 were due). Within one process the replicas
meet in one rendezvous per run, so runs from several threads simply take turns there.
"""

from __future__ import annotations

from typing import Any, Final

from crossdevice._replica.runner import ReplicaRunner

__all__ = ["one_thread_runs"]

#: Why a concurrent run across workers is refused (the runner's error says what to do).
_WHY: Final = (
    "Across workers, collectives pair in the order each worker issues them, and nothing in "
    "them says which thread issued them: two threads' runs would be paired by timing, "
    "differently on each worker, with silently wrong results. This worker's peers are "
    "told (the group is ended)."
)


def one_thread_runs(runner: ReplicaRunner, worker_communicator: Any) -> ReplicaRunner:
    """`runner`, refusing a run while another thread's is in flight if there are workers.

    Args:
        runner: the strategy's local replica runner.
        worker_communicator: the strategy's communicator to the other workers, or None
            (one worker: runs from several threads take turns, as in `MirroredStrategy`).

    Returns:
        `runner` itself.
    """
    runner.refuse_concurrent_runs = None if worker_communicator is None else _WHY
    return runner
