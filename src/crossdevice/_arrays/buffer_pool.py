"""`BufferPool`: recycle large host output buffers once nobody holds them.

A fresh large NumPy allocation is zero-filled by the kernel page by page on first touch,
which for a copy-sized job costs about as much as the copy itself (measured: a 64 MiB
copy into fresh memory took about twice as long as into a reused buffer). Results handed
to users cannot simply be reused, so the pool checks the buffer's reference count: a
buffer referenced only by the pool (no result, view or tensor wrapping it is alive) is
free again.
"""

from __future__ import annotations

import sys
import threading
from typing import Final

import numpy as np

from crossdevice._core import tuning

__all__ = ["BufferPool"]

#: `sys.getrefcount` of a pooled buffer that only the pool holds: the pool's list, the
#: loop variable and getrefcount's own argument.
_UNUSED_REFCOUNT: Final = 3


class BufferPool:
    """Flat NumPy buffers by (dtype, length), reused once no one else references them.

    Args:
        per_key: buffers kept per (dtype, length).
        max_bytes: bytes kept in all; None: `TUNING.buffer_pool_max_bytes`.
    """

    def __init__(self, per_key: int = 2, max_bytes: int | None = None) -> None:
        self._per_key = per_key
        self._max_bytes = tuning.TUNING.buffer_pool_max_bytes if max_bytes is None else max_bytes
        self._bytes = 0
        self._buffers: dict[tuple[np.dtype, int], list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, dtype: np.dtype, length: int) -> np.ndarray:
        """A writable 1-D buffer of `length` elements (contents undefined)."""
        key = (np.dtype(dtype), int(length))
        with self._lock:
            bucket = self._buffers.setdefault(key, [])
            for buf in bucket:
                if sys.getrefcount(buf) == _UNUSED_REFCOUNT:
                    buf.flags.writeable = True  # results are handed out read-only
                    return buf
            buf = np.empty(length, dtype=key[0])
            nbytes = buf.nbytes
            if len(bucket) < self._per_key and self._bytes + nbytes <= self._max_bytes:
                bucket.append(buf)
                self._bytes += nbytes
            return buf
