"""What a collective is for, in the user's words, for the errors about it.

A cross-worker collective the library makes on the user's behalf has a name that means
nothing to the user: reading a `SyncOnReadVariable` in cross-replica context is an
`all_reduce #108`, and `next(iterator)` of a distributed dataset a `has_data #108`. When
one worker makes such a call and another does not, the mismatch or timeout must say
what each worker was doing. Code that makes one wraps it in `purpose(...)`; the worker
communicator takes the text for the collective started inside (its label, which every
error about it shows, and the detail a mismatch shows for each worker).

The text is per thread: the collective runs on the thread that asked for it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["current", "purpose"]


class _Local(threading.local):
    text = ""


_LOCAL = _Local()


@contextlib.contextmanager
def purpose(text: str) -> Iterator[None]:
    """Collectives started in this block on this thread are described by `text`."""
    outer = _LOCAL.text
    _LOCAL.text = text
    try:
        yield
    finally:
        _LOCAL.text = outer


def current() -> str:
    """The innermost `purpose` text of this thread ("" outside any)."""
    return _LOCAL.text
