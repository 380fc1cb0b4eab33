"""What the multi-process tests of the communicators share: the Gloo-only environment, a
failing call's timed outcome, and the check that a worker whose step raised is named by
the peer waiting for it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: Shared memory off: every byte through Gloo, as between machines.
GLOO = {"CROSSDEVICE_SHARED_MEMORY": "0"}


def assert_failing_peer_named(outs: list[dict[str, Any]]) -> None:
    """Rank 1's step raised ValueError('bad batch'); rank 0, waiting, names it quickly."""
    assert outs[1]["outcome"] == ("ValueError", "bad batch")
    kind, message = outs[0]["outcome"]
    assert kind == "WorkerFailedError", outs[0]
    assert "rank 1" in message
    assert "raised ValueError" in message
    assert outs[0]["elapsed"] < 10.0


def timed_outcome(run: Callable[[], Any]) -> dict[str, Any]:
    """`run()`'s outcome, ("returned", "") or (error type, message), and its duration."""
    start = time.monotonic()
    try:
        run()
        outcome = ("returned", "")
    except Exception as err:
        outcome = (type(err).__name__, str(err))
    return {"outcome": outcome, "elapsed": time.monotonic() - start}
