"""`watched`: a start-up step inside torch, ended when the c10d store stops answering.

Constructing a worker communicator talks to the c10d store inside torch, where no check of
ours runs: `init_process_group`'s rendezvous (the store client's handshake, then every
rank's address), each `new_group`'s Gloo handshake, and the health board's own clients.
A c10d `TCPStore` client waits for its server's reply without a bound when the server's
process is frozen rather than gone (`bounded_store.py`): the kernel accepts the
connection and keeps it, and the store's timeout bounds only how long the server waits
for a key. Measured with torch 2.13: a client constructed against a stopped server, with
a 2 s timeout, was still blocked after 20 s. A worker whose rank 0 froze during start-up
(stopped by a signal, a paused VM) so waited for ever, and so does torch's own
rendezvous.

`watched(step, ...)` runs `step` on a helper thread and the caller watches it: every
`TUNING.startup_probe_seconds` it asks the store a question through a client of its own
(`StoreProbe`), and once a question the store accepted has gone unanswered for
`TUNING.dead_after_seconds` (the patience a silent heartbeat gets after start-up), the
caller raises `WorkerFailedError` naming the store's host. A store that is not listening
yet is no failure: rank 0 may start late, torch's own timeout bounds that wait, and
`step` raises torch's error as itself. Whatever else happens, the wait ends at
`backstop` seconds (`CollectiveTimeoutError`).

The step's thread, stuck in torch on a frozen store, is left behind (a daemon): the
process can still exit, and cannot use torch.distributed any more (nor could it have).
The helper runs on the caller's CUDA device (`torch.cuda.set_device` is per thread), so
what the step creates is bound as it would have been on the caller's thread.
"""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch._C._distributed_c10d import TCPStore

from crossdevice._comm.workers.serial import SerialThread
from crossdevice._comm.workers.store_logging import quiet_store
from crossdevice._core import tuning
from crossdevice._core.errors import CollectiveTimeoutError, WorkerFailedError

__all__ = ["StoreProbe", "watched"]

T = TypeVar("T")

#: The key every probe asks about (never set: `check` answers False).
_PROBE_KEY = "crossdevice-store-probe"


class StoreProbe:
    """Questions to a c10d store server, one at a time, on a thread of their own.

    `silence()` says how long the question in flight has gone unanswered, and asks a new
    one when the last was answered. A question waits on the store's server only once its
    port accepted a connection: before that (the server not listening yet, or gone) it is
    answered at once, as no silence.

    Args:
        host: the store server's address.
        port: its port.
    """

    def __init__(self, host: str, port: int) -> None:
        self._host = host
        self._port = port
        self._client: Any = None
        self._runner = SerialThread("crossdevice-store-probe")
        #: The question in flight: its done lock and when it was asked; None: none.
        self._asked: tuple[Any, float] | None = None

    def silence(self) -> float:
        """Seconds the question in flight has gone unanswered; asks anew once answered."""
        now = time.monotonic()
        if self._asked is not None:
            done, since = self._asked
            if not done.acquire(blocking=False):
                return now - since
        done, _ = self._runner.submit(self._ask)  # its outcome: answered either way
        self._asked = (done, now)
        return 0.0

    def close(self) -> None:
        """End the probe's thread (one stuck on a frozen server: never; a daemon)."""
        self._runner.close()

    def _ask(self) -> None:
        if self._client is None:
            # A port that refuses is a server not up yet (or gone): torch's own wait says
            # which. TCPStore itself would retry the connection for its whole timeout.
            with socket.create_connection((self._host, self._port), timeout=1.0):
                pass
            self._client = quiet_store(
                TCPStore(
                    self._host,
                    self._port,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=tuning.TUNING.dead_after_seconds),
                    wait_for_workers=False,
                )
            )
        self._client.check([_PROBE_KEY])


def _on_device(step: Callable[[], T], device: int | None) -> Callable[[], T]:
    def run() -> T:
        if device is not None:
            torch.cuda.set_device(device)
        return step()

    return run


def watched(
    step: Callable[[], T],
    *,
    store: tuple[str, int] | None,
    store_host: int | None,
    backstop: float,
    what: str,
) -> T:
    """`step()`, run on a helper thread while the caller watches the store (module doc).

    Args:
        step: the start-up step (it talks to the store inside torch).
        store: the store server's (address, port), probed while `step` runs; None: not a
            TCP store (only `backstop` bounds the wait).
        store_host: the rank whose process serves the store (None: torchrun's agent).
        backstop: the longest the wait lasts whatever the probe says, in seconds.
        what: what `step` does, for the errors ("the rendezvous of 3 workers").

    Returns:
        What `step` returned; what it raised is raised as itself.

    Raises:
        WorkerFailedError: the store accepted a question and left it unanswered for
            `TUNING.dead_after_seconds`: its host has stopped or frozen.
        CollectiveTimeoutError: `step` did not end within `backstop` seconds.
    """
    device = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        device = torch.cuda.current_device()
    runner = SerialThread("crossdevice-start")
    done, box = runner.submit(_on_device(step, device))
    probe = None if store is None else StoreProbe(*store)
    deadline = time.monotonic() + backstop
    try:
        while not done.acquire(timeout=tuning.TUNING.startup_probe_seconds):
            silent = 0.0 if probe is None else probe.silence()
            if silent >= tuning.TUNING.dead_after_seconds:
                assert store is not None
                host = "torchrun's agent" if store_host is None else f"rank {store_host}"
                raise WorkerFailedError(
                    f"{what} cannot finish: {host} serves the c10d store at "
                    f"{store[0]}:{store[1]}, which accepted a connection but has not "
                    f"answered for {silent:.1f} s (expected a reply within "
                    f"{tuning.TUNING.dead_after_seconds:g} s), so its process has probably "
                    "stopped or frozen (a signal, a paused VM); torch would wait for it for "
                    f"ever. Restart the job once {host} runs again (or without it)."
                )
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    f"{what} did not finish within {backstop:g} s although the c10d store "
                    "answers: torch's own timeout should have ended it; restart the job, "
                    "and report this with the workers' logs"
                )
    finally:
        runner.close()  # the thread ends after the step (a stuck one: never; a daemon)
        if probe is not None:
            probe.close()
    ok, value = box[0]
    if ok:
        return value
    raise value
