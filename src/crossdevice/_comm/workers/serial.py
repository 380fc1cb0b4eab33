"""`SerialThread`: blocking calls run in order on a helper thread; the caller waits its way.

A worker communicator hands two kinds of blocking call to a helper so that the calling
thread can bound or watch its wait: the first messages of a point-to-point exchange
(`HealthBoard.wait_arrival`, watched by the health loop) and the store's reads
(`BoundedStore`, bounded). Each `submit` returns a bare lock, released when the call
has ended, and the box its outcome lands in: the caller waits on the lock as it needs
(a C `acquire(timeout=)` took 18-63 us less a call than `threading.Event.wait`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Outcome", "SerialThread"]

#: Where a submitted call's outcome lands: `(True, result)` or `(False, exception)`.
Outcome = list[tuple[bool, Any]]


class SerialThread:
    """Calls run in submission order on a daemon thread of their own (started on first use).

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._requests: queue.SimpleQueue[Any] | None = None
        self._start_lock = threading.Lock()
        #: The call now on the thread (its done lock) and when it began; None: idle.
        self.current: tuple[threading.Lock, float] | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> tuple[threading.Lock, Outcome]:
        """Queue `fn(*args)`; (a lock released once it ended, the box its outcome lands in).

        The outcome is read after the lock is released: an exception is the caller's to
        raise, as itself.
        """
        done = threading.Lock()
        done.acquire()
        box: Outcome = []
        with self._start_lock:
            if self._requests is None:
                self._requests = queue.SimpleQueue()
                threading.Thread(
                    target=self._serve, args=(self._requests,), name=self._name, daemon=True
                ).start()
            self._requests.put((fn, args, done, box))
        return done, box

    def close(self) -> None:
        """End the thread once the calls queued so far ran (a stuck one: never; a daemon).

        A later `submit` starts a thread of its own.
        """
        with self._start_lock:
            if self._requests is not None:
                self._requests.put(None)
                self._requests = None

    def _serve(self, requests: queue.SimpleQueue[Any]) -> None:
        while (request := requests.get()) is not None:
            fn, args, done, box = request
            self.current = (done, time.monotonic())
            try:
                box.append((True, fn(*args)))
            except BaseException as err:  # the caller's to raise, as itself
                box.append((False, err))
            finally:
                self.current = None
                done.release()
            # Not kept while waiting for the next request: a receive's work holds the
            # buffer it filled, which the caller's pool reuses once nobody holds it.
            del request, fn, args, box
