"""A worker frozen longer than its peers' patience, then resumed, learns at once why.

Its peers declared it dead (no heartbeat for `dead_after_seconds`) and gave up on the
collective it then arrives at; they publish why they gave up, so the resumed worker
raises `WorkerFailedError` saying that it was declared dead while unresponsive, within a
poll interval, instead of waiting out the collective's timeout (found by the bug hunt:
`pause9_bwd`, 600 s by default) and blaming a stuck peer, or the survivor's exit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.multi_worker.fault_workers import frozen_then_resumed
from tests.multi_worker.harness import run_workers

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(sys.platform != "linux", reason="SIGSTOP and SIGCONT of a worker"),
]

#: The culprit's freeze: twice the peers' patience (2.5 s in the workers).
_FREEZE = 5.0
#: The resumed worker must fail this fast: a few polls, far below the 25 s timeout.
_PROMPTLY = 6.0


@pytest.mark.parametrize("culprit", [1, 0], ids=["rank1", "rank0-store-host"])
def test_a_resumed_worker_learns_it_was_declared_dead(tmp_path: Path, culprit: int) -> None:
    results = run_workers(
        frozen_then_resumed, 2, args=(culprit, _FREEZE, str(tmp_path / "done")), timeout=80
    )
    survivor = results[1 - culprit].unwrap()
    assert survivor["type"] == "WorkerFailedError", survivor
    assert f"rank {culprit}" in survivor["message"], survivor
    resumed = results[culprit].unwrap()
    assert resumed["type"] == "WorkerFailedError", resumed
    assert resumed["elapsed"] < _PROMPTLY, resumed
    message = resumed["message"]
    assert "the other workers gave up on this worker" in message, message
    survivor_rank = f"rank {1 - culprit} (global replicas [{1 - culprit}])"
    assert f"{survivor_rank} gave up on rank(s) [{culprit}] in all_reduce #" in message, message
    assert "declared this worker dead" in message, message
    assert "dead_after_seconds" in message, message
    assert "exited" not in message, message  # not the survivor's exit: why it left
    assert "same collective calls" not in message, message
