"""What the multi-process tests of the communicators share: the Gloo-only environment
(with thresholds of a test's choosing), a failing call's timed outcome, and the check that
a worker whose step raised is named by the peer waiting for it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

#: Shared memory off: every byte through Gloo, as between machines.
GLOO = {"CROSSDEVICE_SHARED_MEMORY": "0"}

#: Thresholds a test's workers set (`tuned`, `apply_tuning`): `name=value,...`.
TUNING_ENV = "CROSSDEVICE_TEST_TUNING"


def tuned(**changes: int) -> dict[str, str]:
    """`GLOO`, plus tuning thresholds every worker sets first (`apply_tuning`)."""
    return {**GLOO, TUNING_ENV: ",".join(f"{k}={v}" for k, v in changes.items())}


def apply_tuning() -> None:
    """In a worker: set the thresholds its test passed (`tuned`), if any."""
    text = os.environ.get(TUNING_ENV)
    if text:
        from crossdevice._core import tuning

        pairs = (item.split("=") for item in text.split(","))
        tuning.set_tuning(**{name: int(value) for name, value in pairs})


def carrier(comm: Any, layout: Any) -> str:
    """What carries an all-reduce of host `layout` on worker communicator `comm`.

    A transport's name; for the ring's whole exchange (`ring.direct`) "direct", or
    "folded" where its inline header rides behind the first buffer (`ring.folded`).
    """
    from crossdevice._comm.workers import ring

    chosen = comm._integrity.transport_for(layout).name
    if chosen != "ring" or not ring.direct(layout, comm.size):
        return chosen
    return "folded" if ring.folded(layout, comm.size) else "direct"


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
