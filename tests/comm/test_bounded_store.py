"""`BoundedStore`: a store call waits at most its bound, and a stuck store fails fast."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from crossdevice._comm.workers.bounded_store import BoundedStore, StoreSilentError


class _Store:
    """A store whose `get` blocks while `frozen` is set (as a stopped server's does)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.frozen = threading.Event()
        self.thaw = threading.Event()
        self.threads: set[str] = set()

    def set(self, key: str, value: str) -> None:
        self.threads.add(threading.current_thread().name)
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        self.threads.add(threading.current_thread().name)
        if self.frozen.is_set():
            self.thaw.wait(30)
        return self.values[key]


def test_calls_go_through_and_raise_as_themselves() -> None:
    store = _Store()
    bounded = BoundedStore(store, lambda: 5.0, "t")
    bounded.set("k", "v")
    assert bounded.get("k") == b"v"
    with pytest.raises(KeyError):
        bounded.get("missing")
    assert store.threads == {"crossdevice-store-t"}  # never on the caller's thread
    bounded.close()
    assert bounded.get("k") == b"v"  # after close, on a thread of its own
    bounded.close()


def test_a_frozen_store_raises_within_the_bound_then_at_once() -> None:
    store = _Store()
    store.set("k", "v")
    bounded = BoundedStore(store, lambda: 0.3, "t")
    store.frozen.set()
    start = time.monotonic()
    with pytest.raises(StoreSilentError, match=r"did not answer get\(\) within 0.3 s"):
        bounded.get("k")
    assert 0.25 < time.monotonic() - start < 5.0
    # The stuck call holds the connection: later calls do not queue behind it.
    start = time.monotonic()
    with pytest.raises(StoreSilentError, match="has not answered a call for"):
        bounded.set("k2", "v2")
    assert time.monotonic() - start < 0.25  # at once: not after the 0.3 s bound again
    # Once the server answers again, so do the calls.
    store.frozen.clear()
    store.thaw.set()
    deadline = time.monotonic() + 5.0
    got: Any = None
    while got is None and time.monotonic() < deadline:
        try:
            got = bounded.get("k")
        except StoreSilentError:
            time.sleep(0.01)
    assert got == b"v"
    bounded.close()
