"""What a `ReplicaRunner` says when it refuses a call: `close` inside a run, a concurrent run.

Kept apart from the runner so its messages can teach at length (what, why, what to do)
and so the strategy's `close` can say the same as the runner's.
"""

from __future__ import annotations

import threading

__all__ = ["close_inside_run", "concurrent_run"]


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
