"""`BoundedStore`: c10d store calls that give up when the store stops answering.

A c10d `TCPStore` client waits for its server's reply without a bound when the server's
process is frozen rather than gone (stopped by a signal, a paused VM, a machine cut off
with its connection left open): the kernel keeps the connection, so `add`, `check`,
`get` and `wait` block for as long as the freeze lasts. The store's own timeout bounds
only how long the server waits for a key; measured with torch 2.13 against a stopped
server, every read was still blocked after 40 s with a 2 s timeout (`set` returns: it
waits for no reply). A worker whose health check reads the store would then never
return, and its collective's timeout, checked in the same loop, would never fire.

Each call here runs on a thread of its own, in the order the calls were made, and the
caller waits for it at most `bound()` seconds; then it raises `StoreSilentError`. While
a call its caller gave up on (or one older than the bound) is still on that thread,
later calls raise at once: they would queue behind it on the same connection.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["BoundedStore", "StoreSilentError"]


class StoreSilentError(RuntimeError):
    """The c10d store did not answer a call in time (see `BoundedStore`)."""


class BoundedStore:
    """A c10d store whose calls each wait at most `bound()` seconds for the reply.

    Args:
        store: the store client; only this object's thread calls it.
        bound: the longest a call may take, in seconds (read at each call).
        name: names the thread (`crossdevice-store-<name>`).
    """

    def __init__(self, store: Any, bound: Callable[[], float], name: str) -> None:
        self._store = store
        self._bound = bound
        self._name = name
        self._requests: queue.SimpleQueue[Any] | None = None
        self._start_lock = threading.Lock()
        #: The call now on the thread and when it began (None: the thread is idle).
        self._current: tuple[Any, float] | None = None
        #: The last call whose caller stopped waiting for it.
        self._given_up: Any = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not the store's API (and no recursion before __init__)
            raise AttributeError(name)
        method = getattr(self._store, name)
        if not callable(method):
            return method
        return functools.partial(self._call, name, method)

    def close(self) -> None:
        """End the thread once the calls made so far ran (a stuck call: never; a daemon).

        A later call starts a thread of its own.
        """
        with self._start_lock:
            if self._requests is not None:
                self._requests.put(None)
                self._requests = None

    def _call(self, name: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        bound = self._bound()
        current = self._current
        if current is not None:
            stuck, since = current
            if stuck is self._given_up or time.monotonic() - since >= bound:
                raise StoreSilentError(
                    f"the c10d store has not answered a call for "
                    f"{time.monotonic() - since:.1f} s (expected a reply within {bound:g} s)"
                )
        done = threading.Lock()
        done.acquire()
        box: list[tuple[bool, Any]] = []
        request = (method, args, kwargs, done, box)
        self._thread_requests().put(request)
        if not done.acquire(timeout=bound):
            self._given_up = request
            raise StoreSilentError(f"the c10d store did not answer {name}() within {bound:g} s")
        ok, value = box[0]
        if ok:
            return value
        raise value

    def _thread_requests(self) -> queue.SimpleQueue[Any]:
        with self._start_lock:
            if self._requests is None:
                self._requests = queue.SimpleQueue()
                threading.Thread(
                    target=self._serve,
                    args=(self._requests,),
                    name=f"crossdevice-store-{self._name}",
                    daemon=True,
                ).start()
            return self._requests

    def _serve(self, requests: queue.SimpleQueue[Any]) -> None:
        while (request := requests.get()) is not None:
            method, args, kwargs, done, box = request
            self._current = (request, time.monotonic())
            try:
                box.append((True, method(*args, **kwargs)))
            except BaseException as err:  # the caller's to raise, as itself
                box.append((False, err))
            finally:
                self._current = None
                done.release()
