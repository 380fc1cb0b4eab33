"""A worker whose collective timed out tells its peers; one that comes late raises, naming it.

Two workers; rank 1 sleeps inside a step past rank 0's timeout. Rank 0 raises
`CollectiveTimeoutError`; rank 1, waking, must not combine its value with what rank 0
left behind (on shared memory: rank 0's slots of a round it arrived at and then gave
up; on Gloo: a connection rank 0 closed). It raises `WorkerFailedError` naming rank 0
and its timeout, read from rank 0's abort record in the store or, when rank 0 has
exited and taken the store with it, from its shared-memory poison mark. Found by a bug
hunt: on shared memory rank 1's step returned the sum with rank 0's stale slot, on Gloo
it raised Gloo's bare "Connection closed by peer".
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.multi_worker.harness import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

#: Rank 0's collective timeout (seconds), and how much longer rank 1 sleeps in the step.
_TIMEOUT = 2.0
_LATE_BY = 2.0

#: Workers of one host: the default shared memory, or Gloo as across hosts.
_TRANSPORTS: dict[str, dict[str, str]] = {
    "shm": {},
    "gloo": {"CROSSDEVICE_SHARED_MEMORY": "0"},
}


def late_peer(rank: int, world_size: int, done: str, linger: bool) -> dict[str, Any]:
    """Warm steps, then a step in which rank 1 sleeps past rank 0's timeout.

    Rank 0, given `linger`, stays (its store with it) until rank 1 wrote `done`.
    """
    import crossdevice as cd

    del world_size
    cd.config.set_logical_cpu_devices(1)
    options = cd.experimental.CommunicationOptions(timeout_seconds=_TIMEOUT)
    strategy = cd.MultiWorkerMirroredStrategy(communication_options=options, devices=["CPU:0"])
    x = np.ones(4, np.float32)

    def step() -> Any:
        return cd.get_replica_context().all_reduce("sum", x)

    # Warm: on shared memory the all-reduces after the first ones wait in shared rounds.
    for _ in range(3):
        strategy.run(step)
    shared = strategy.extended._worker_communicator.shared_memory
    rounds = None if shared is None else int(shared._round)

    def late_step() -> Any:
        if rank == 1:
            time.sleep(_TIMEOUT + _LATE_BY)
        return cd.get_replica_context().all_reduce("sum", x)

    start = time.monotonic()
    try:
        value = strategy.experimental_local_results(strategy.run(late_step))[0]
        out: dict[str, Any] = {"type": None, "value": np.asarray(value).tolist()}
    except Exception as err:
        out = {"type": type(err).__name__, "message": str(err)}
    out["elapsed"] = time.monotonic() - start
    out["shared_rounds"] = rounds is not None and shared is not None and shared._round != rounds
    if rank == 1:
        Path(done).write_text("done")
    elif linger:
        deadline = time.monotonic() + 30.0
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    return out


@pytest.mark.parametrize(
    ("transport", "linger"),
    [("shm", True), ("shm", False), ("gloo", True), ("gloo", False)],
    ids=["shm", "shm-timed-out-worker-exits", "gloo", "gloo-timed-out-worker-exits"],
)
def test_a_late_peer_raises_naming_the_worker_that_timed_out(
    transport: str, linger: bool, tmp_path: Path
) -> None:
    if transport == "shm" and not (sys.platform == "linux" and os.uname().machine == "x86_64"):
        pytest.skip("shared memory is used on x86-64 Linux only (other hosts keep to Gloo)")
    done = str(tmp_path / "rank1-done")
    results = run_workers(late_peer, 2, args=(done, linger), timeout=90, env=_TRANSPORTS[transport])
    timed_out, late = (r.unwrap() for r in results)
    assert timed_out["shared_rounds"] == (transport == "shm"), timed_out
    assert late["shared_rounds"] == (transport == "shm"), late

    # Rank 0: its own timeout, naming the collective and the rank that did not come.
    assert timed_out["type"] == "CollectiveTimeoutError", timed_out
    assert timed_out["message"].startswith("all_reduce #"), timed_out
    assert "rank(s) [1]" in timed_out["message"], timed_out
    assert timed_out["elapsed"] < _TIMEOUT + _LATE_BY, timed_out

    # Rank 1: never a result (that would be rank 0's stale or partial part summed in,
    # a step counted done here and failed there), but an error naming rank 0.
    assert late["type"] == "WorkerFailedError", late
    message = late["message"]
    assert "rank 0 (global replicas [0])" in message, message
    if transport == "gloo" and not linger:
        # Rank 0 served the store and took it along: only its absence can be named.
        assert "unreachable" in message, message
    else:  # from the store's abort record, or (rank 0 gone) shared memory's poison mark
        assert f"timed out after {_TIMEOUT:g} s in all_reduce #" in message, message
        assert "a peer gave up waiting in it" in message, message
    assert late["elapsed"] < _TIMEOUT + _LATE_BY + 8.0, late
