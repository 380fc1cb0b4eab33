"""`keep_heap`: a training process keeps the memory one step frees for the next one.

A training step allocates the same tensors every time (activations, their gradients,
optimizer temporaries) and frees them before the next step. glibc's malloc decides by
itself where they come from and whether freed memory goes back to the system:

* a block of at least the mmap threshold is mapped on its own and unmapped when freed;
  the threshold starts at 128 KiB and rises to the size of each such block freed (up to
  32 MiB on 64-bit);
* free memory at the top of the heap beyond the trim threshold (twice the mmap
  threshold, once that moved) is handed back to the system at the `free` that made it.

Either way the next step gets fresh pages, which the kernel zero-fills one fault at a
time (4 KiB each). Whether the trim fires depends on what else happens to lie above the
freed blocks, so it comes and goes with the allocation order of a whole program. The TF
tutorial CNN, 2 workers on the 2-core dev VM, every variant in the same processes
(`python -m benchmarks.multi_worker_epoch`, 2 runs each way): at 32 and 128 examples per
worker an epoch took 13-65k page faults under glibc's defaults, in crossdevice's steps,
DDP's and plain torch's alike, and none with the thresholds kept; crossdevice's epoch
went from 658-694 ms to 559-577 ms at 32 examples and from 521-556 ms to 464-471 ms at
128 (3 more runs each way: 696-781 to 528-608 ms, 537-660 to 463-524 ms). At 8 examples
(too little freed at a time to trim) nothing changed.

`keep_heap` fixes both thresholds once per process (`mallopt`, which also stops glibc
moving them): blocks below `TUNING.heap_mmap_threshold_bytes` come from the heap, and up
to `TUNING.heap_trim_threshold_bytes` of free memory stays there for the next step.
Larger blocks are still mapped and unmapped one by one (glibc's ceiling), and a process
that frees more than the trim threshold at once still returns it.
`crossdevice.torch.prepare` calls it. It leaves malloc alone with
`CROSSDEVICE_KEEP_HEAP=0` in the environment, where the process chose these thresholds
itself (glibc's `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`,
`MALLOC_MMAP_MAX_` or their `GLIBC_TUNABLES`), and on a C library other than glibc
(musl, macOS and Windows have no such thresholds, or other allocators).
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from typing import Final

from crossdevice._core import environment, tuning

__all__ = ["ENV", "keep_heap", "kept", "wanted"]

#: Set to 0 to leave glibc's malloc thresholds alone.
ENV: Final = "CROSSDEVICE_KEEP_HEAP"

#: glibc's own settings of what `keep_heap` sets: a process that sets any keeps its choice.
_GLIBC_PARAMETERS: Final = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")

# glibc's <malloc.h> parameter numbers.
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3

_lock = threading.Lock()
_kept: bool | None = None  # None: not asked yet; then whether the thresholds were set


def keep_heap() -> bool:
    """Fix glibc's mmap and trim thresholds for this process, once; whether they are set.

    False where the C library is not glibc, where `CROSSDEVICE_KEEP_HEAP=0`, where the
    environment sets these thresholds itself (`MALLOC_TRIM_THRESHOLD_`, ...), or where
    glibc refused a value (each `mallopt` returns whether it took it).
    """
    global _kept
    with _lock:
        if _kept is None:
            _kept = _set_thresholds()
        return _kept


def wanted() -> bool:
    """Whether `CROSSDEVICE_KEEP_HEAP` leaves keeping the heap on (the default).

    Raises:
        ValueError: the variable is not a switch (`_core.environment.env_switch`): raised
            by `prepare` before it wraps anything.
    """
    return environment.env_switch(ENV, default=True)


def kept() -> bool:
    """Whether `keep_heap` set the thresholds in this process (False before it was called)."""
    return bool(_kept)


def _set_thresholds() -> bool:
    if not wanted() or platform.libc_ver()[0] != "glibc":
        return False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    for name in _GLIBC_PARAMETERS:
        if f"MALLOC_{name.upper()}_" in os.environ or f"glibc.malloc.{name}=" in tunables:
            return False  # the process chose malloc's thresholds itself: they stay
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    cut = tuning.TUNING
    # The mmap threshold first: setting either one stops glibc moving both.
    mapped = mallopt(_M_MMAP_THRESHOLD, cut.heap_mmap_threshold_bytes)
    trimmed = mallopt(_M_TRIM_THRESHOLD, cut.heap_trim_threshold_bytes)
    return bool(mapped and trimmed)
