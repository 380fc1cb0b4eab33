"""Cooperative replica execution: a small step's replicas take turns on the caller's thread.

A replica thread pays for every hand-off. A 4-replica step with one all-reduce wakes a
thread at least 2N times, and on a multi-core machine each wake moves the GIL, the
interpreter's hot cache lines and often an idle vCPU to another core: on the 2-core dev
VM a 1 KiB all-reduce step took 170-240 µs on threads before the hand-offs were cut to
six per step (now 90-125 µs), 81-124 µs with the whole process pinned to one core, and
most of that is hand-offs (benchmarks/run_overhead.py).

Here each replica is a greenlet, a stack of its own on the caller's thread. A replica runs
until it must wait in a rendezvous (`merge_call`, a collective); instead of blocking the
thread, `block` switches back to the scheduler (the caller's greenlet), which resumes the
next replica that can go on. Every wait in the library goes through `block`, so the
rendezvous code is the same in both modes: the same gates are released by the same
peers, aborts and timeouts work the same way. Nothing runs in parallel, so this pays only
for steps whose replica work is small (`crossdevice.config.set_replica_execution`).

Thread-local state a replica sees is switched with it: the context stack (replica
context), the device scope, and torch's grad mode (each replica starts with the caller's).
torch's autocast and inference mode are the caller's thread's, as the runner carries them
into replica threads too. A user's own `threading.local` is shared by the replicas.

A state the threads would never leave (every replica waiting, none can go on) cannot come
from replicas that called different collectives: those meet in one rendezvous, which
fails them at once in both modes. Should it happen anyway, it fails the run with a clear
error rather than spinning.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Final

try:
    import greenlet as _greenlet
except ImportError:  # pragma: no cover - greenlet is a core dependency; threads still work
    _greenlet = None

__all__ = [
    "available",
    "block",
    "blocking",
    "grad_enabled",
    "greenlet_module",
    "in_cooperative_replica",
    "swap_hub",
    "torch_c",
]


class _Local(threading.local):
    # The scheduler greenlet of the cooperative run on this thread (None: threads).
    hub: Any = None


_LOCAL: Final = _Local()


def available() -> bool:
    """Whether cooperative execution can run here (the greenlet package is installed)."""
    return _greenlet is not None


def block(lock: Any, timeout: float | None) -> bool:
    """`lock.acquire(timeout=...)`, but a cooperative replica yields instead of blocking.

    On a replica thread (or any thread outside a cooperative run) this is exactly
    `lock.acquire(True, timeout)`. In a replica of a cooperative run it returns at once if
    the lock is free; otherwise the replica parks and the scheduler runs the others until
    somebody releases `lock` (True) or `timeout` seconds pass (False).

    Args:
        lock: a raw lock (`_thread.allocate_lock()` or `threading.Lock()`).
        timeout: seconds to wait, or None to wait until it is released.
    """
    hub = _LOCAL.hub
    if hub is None or _greenlet.getcurrent() is hub:
        return lock.acquire(True, -1 if timeout is None else timeout)
    if lock.acquire(False):
        return True
    deadline = None if timeout is None else time.monotonic() + timeout
    return hub.switch((lock, deadline))


@contextlib.contextmanager
def blocking() -> Iterator[None]:
    """Inside: `block` blocks the thread even in a cooperative replica.

    For a nested `strategy.run` inside a merge_fn: its replica 0 runs on this thread
    while every other replica of the outer cooperative run is parked in that merge_call,
    so there is nobody to switch to, and its waits must really wait (for the nested
    run's replica threads).
    """
    hub = _LOCAL.hub
    _LOCAL.hub = None
    try:
        yield
    finally:
        _LOCAL.hub = hub


def grad_enabled() -> bool | None:
    """The grad mode of torch on this thread, or None where torch is not imported."""
    c = torch_c()
    return None if c is None else bool(c.is_grad_enabled())


def swap_hub(hub: Any) -> Any:
    """Make `hub` (a greenlet, or None) this thread's scheduler; return the previous one.

    The cooperative scheduler (`crossdevice._replica.cooperative`) sets itself while it
    runs replicas, so that `block` in a replica switches to it.
    """
    previous = _LOCAL.hub
    _LOCAL.hub = hub
    return previous


def greenlet_module() -> Any:
    """The greenlet module (None where it is not installed)."""
    return _greenlet


def in_cooperative_replica() -> bool:
    """Whether the caller is a replica of a cooperative run (its waits do not block)."""
    hub = _LOCAL.hub
    return hub is not None and _greenlet.getcurrent() is not hub


def torch_c() -> Any:
    """`torch._C`, or None where torch is not imported."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch._C
