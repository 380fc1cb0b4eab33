"""`BoundedStore`: c10d store calls that give up when the store stops answering.

A c10d `TCPStore` client waits for its server's reply without a bound when the server's
process is frozen rather than gone (stopped by a signal, a paused VM, a machine cut off
with its connection left open): the kernel keeps the connection, so `add`, `check`,
`get` and `wait` block for as long as the freeze lasts. The store's own timeout bounds
only how long the server waits for a key; measured with torch 2.13 against a stopped
server, every read was still blocked after 40 s with a 2 s timeout (`set` returns: it
waits for no reply). A worker whose health check reads the store would then never
return, and its collective's timeout, checked in the same loop, would never fire.

Each call here runs on a thread of its own (`serial.SerialThread`), in the order the
calls were made, and the caller waits for it at most `bound()` seconds; then it raises
`StoreSilentError`. While a call its caller gave up on (or one older than the bound) is
still on that thread, later calls raise at once: they would queue behind it on the same
connection.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from crossdevice._comm.workers.serial import SerialThread

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
        self._thread = SerialThread(f"crossdevice-store-{name}")
        #: The done lock of the last call whose caller stopped waiting for it.
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
        self._thread.close()

    def _call(self, name: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        bound = self._bound()
        current = self._thread.current
        if current is not None:
            stuck, since = current
            if stuck is self._given_up or time.monotonic() - since >= bound:
                raise StoreSilentError(
                    f"the c10d store has not answered a call for "
                    f"{time.monotonic() - since:.1f} s (expected a reply within {bound:g} s)"
                )
        done, box = self._thread.submit(functools.partial(method, *args, **kwargs))
        if not done.acquire(timeout=bound):
            self._given_up = done
            raise StoreSilentError(f"the c10d store did not answer {name}() within {bound:g} s")
        ok, value = box[0]
        if ok:
            return value
        raise value
