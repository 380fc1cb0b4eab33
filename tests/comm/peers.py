"""What the multi-process tests of the communicators share: the Gloo-only environment and
the check that a worker whose step raised is named by the peer waiting for it."""

from __future__ import annotations

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
