"""Keep the c10d store's C++ warnings off stderr while crossdevice's own calls fail.

When the process serving the store dies (rank 0, unless torchrun's agent serves it),
every later store call of the survivors fails, and before it raises, torch's TCPStore
client logs a C++ warning carrying some thirty C++ stack frames ("recvValue failed ...
frame #0: c10::Error::Error ..."). crossdevice's health checks make such calls on
purpose: that is how a survivor learns that the store's host is gone, and it says so in
its `WorkerFailedError`. Those frames then bury the one clear message under pages of
noise on every survivor, once per failing call.

`quiet_store(store)` wraps a store so that each of its calls runs with torch's C++ log
level raised to ERROR (`FLAGS_caffe2_log_level` in libc10, which c10d reads at every
message; torch has no Python setter for it). The level is raised only for the length of
crossdevice's own store calls and restored after; torch's other messages, the user's,
and errors are untouched.

Debugging: with `CROSSDEVICE_DEBUG=1`, or with `TORCH_CPP_LOG_LEVEL` set in the
environment (`INFO` or `WARNING`: torch's own switch), nothing is changed and the C++
warnings and frames print as torch writes them.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Final

from crossdevice._core import environment

__all__ = ["DEBUG_ENV", "quiet_store"]

#: Set to 1 to see everything torch's C++ side logs (the store's frames included).
DEBUG_ENV: Final = "CROSSDEVICE_DEBUG"
#: c10's ERROR level (INFO 0, WARNING 1, ERROR 2, FATAL 3).
_ERROR: Final = 2

_LOCK = threading.Lock()
_state: dict[str, Any] = {}  # "flag": the c_int or None once looked up; "depth", "saved"


def _log_level_flag() -> Any:
    """libc10's `FLAGS_caffe2_log_level`, or None where it cannot or must not be changed."""
    if "flag" not in _state:
        # Read before anything is cached: a bad value raises on every call until fixed.
        wanted = environment.env_switch(DEBUG_ENV, default=False) or (
            "TORCH_CPP_LOG_LEVEL" in os.environ
        )
        _state["flag"] = None
        _state["depth"] = 0
        torch = sys.modules.get("torch")
        if torch is not None and torch.__file__ and not wanted:
            lib_dir = os.path.join(os.path.dirname(str(torch.__file__)), "lib")
            for name in ("libc10.so", "libc10.dylib"):
                try:
                    lib = ctypes.CDLL(os.path.join(lib_dir, name))
                    _state["flag"] = ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
                    break
                except (OSError, ValueError):  # another platform or build: leave it be
                    continue
    return _state["flag"]


def _quietly(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    flag = _log_level_flag()
    if flag is None:
        return call(*args, **kwargs)
    with _LOCK:  # several threads call the store: the first raises, the last restores
        if _state["depth"] == 0:
            _state["saved"] = flag.value
            flag.value = max(flag.value, _ERROR)
        _state["depth"] += 1
    try:
        return call(*args, **kwargs)
    finally:
        with _LOCK:
            _state["depth"] -= 1
            if _state["depth"] == 0:
                flag.value = _state["saved"]


class _QuietStore:
    """A c10d store whose calls log no C++ warnings (see the module doc)."""

    __slots__ = ("_store",)

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if not callable(method):
            return method
        return lambda *args, **kwargs: _quietly(method, *args, **kwargs)


def quiet_store(store: Any) -> Any:
    """`store`, with each call made under torch's ERROR log level (see the module doc).

    Raises:
        ValueError: `CROSSDEVICE_DEBUG` is not a switch; here, on the thread that wraps
            the store (a communicator's start), not in a thread that calls it later.
    """
    _log_level_flag()
    return _QuietStore(store)
