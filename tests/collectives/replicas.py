"""Run a function on N threads, one per replica, with every join bounded."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: Seconds a test waits for its replica threads before declaring a hang.
JOIN_TIMEOUT = 30.0


def run_replicas(
    n: int, fn: Callable[[int], Any], join_timeout: float = JOIN_TIMEOUT
) -> tuple[list[Any], list[BaseException | None]]:
    """`fn(replica_id)` on n threads; (results, exceptions) per replica.

    Fails the test (AssertionError) if a thread is still running after `join_timeout`.
    """
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def body(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as exc:  # ReplicaAbortedError is a BaseException
            errors[r] = exc

    threads = [
        threading.Thread(target=body, args=(r,), daemon=True, name=f"test-replica-{r}")
        for r in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"replica threads hung: {alive}"
    return results, errors


def raise_first(errors: list[BaseException | None]) -> None:
    """Re-raise the first replica error, if any."""
    for exc in errors:
        if exc is not None:
            raise exc
