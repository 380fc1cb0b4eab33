"""What a `ReplicaRunner` says when it refuses a call: `close` inside a run, a concurrent run.

And what a multi-worker strategy says when it refuses a cross-worker collective from a
thread beside the run in flight (`_strategies/worker_runs.py`).

Kept apart from the runner so its messages can teach at length (what, why, what to do)
and so the strategy's `close` can say the same as the runner's.
"""

from __future__ import annotations

import threading

__all__ = ["close_inside_run", "collective_beside_run", "concurrent_run"]


def close_inside_run(name: str) -> str:
    """`strategy.close()` inside a run of the strategy `name` (a replica function, a merge_fn)."""
    return (
        f"{name}: strategy.close() was called inside a run of this strategy (in a replica "
        "function or a merge_fn): closing would end the replica threads that the run is "
        "waiting for. Call close() after strategy.run has returned, from the thread that "
        "called it (or leave the strategy's `with` block)."
    )


def concurrent_run(name: str, owner: int | None, why: str) -> str:
    """A `run` from the calling thread while thread `owner` has one in flight, refused for `why`."""
    holder = next((t.name for t in threading.enumerate() if t.ident == owner), None)
    return (
        f"{name}: strategy.run was called from thread {threading.current_thread().name!r} "
        f"while a run from thread {holder or 'another thread'!r} is in flight. {why} Run "
        "every step from one thread, or hand the steps from thread to thread in an order "
        "the program fixes, the same on every worker (a lock alone does not: it orders "
        "the threads by timing)."
    )


def collective_beside_run(name: str, collective: str, owner: int | None) -> str:
    """Collective `collective` from the calling thread while thread `owner`'s run is in flight."""
    holder = next((t.name for t in threading.enumerate() if t.ident == owner), None)
    return (
        f"{name}: thread {threading.current_thread().name!r} issued a cross-worker "
        f"collective, {collective}, while a run of strategy.run from thread "
        f"{holder or 'another thread'!r} is in flight on this worker; expected the run's "
        "collectives only (its caller's and its replicas'), and others between runs. "
        "Across workers, collectives pair in the order each worker issues them, and nothing "
        "in them says which thread issued them: this one would take a place that the other "
        "workers fill with one of the run's (a wrong sum when the shapes match, else a "
        "mismatch or a hang). Issue it between runs, from the thread that runs the steps "
        "(after strategy.run returns), or inside the step through the replica context "
        "(ReplicaContext.all_reduce, merge_call). This worker's peers are told (the group "
        "is ended): build a new strategy on every worker."
    )
