"""The process's global random generators: capture them, restore them, replay them a while.

A training program that draws from the global generators is decided by NumPy's legacy
global `RandomState` (`np.random.rand`, `np.random.permutation`, ...), Python's `random`,
torch's default CPU generator and the generators of initialised CUDA devices. The
per-replica torch streams of `strategy.run` are seeded from torch's global generator at
each run (`torch_random`), so these also decide every replica's draws: restoring them is
what makes a resumed run draw what the uninterrupted one would have drawn.

A state is a dict of named `uint8` arrays (the generators' bytes), so that any array
format can store it and workers can gather it with an ordinary collective. torch's
generators are captured only when torch is already imported: a NumPy program never
imports it.

    >>> import numpy as np
    >>> state = capture()
    >>> a = np.random.rand()
    >>> restore(state)
    >>> bool(np.random.rand() == a)
    True
"""

from __future__ import annotations

import contextlib
import random
import struct
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Final

import numpy as np

__all__ = ["RandomState", "capture", "replayed", "restore"]

RandomState = dict[str, np.ndarray]

#: MT19937's state: 624 32-bit words.
_MT_WORDS: Final = 624
#: NumPy's tail after the words: position, has_gauss, cached_gaussian.
_NUMPY_TAIL: Final = struct.Struct("<qqd")
#: Python's tail after the 625 words (624 + index): has gauss_next, gauss_next.
_PYTHON_TAIL: Final = struct.Struct("<qd")


def _as_bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).copy()


def _numpy_state() -> np.ndarray:
    name, words, pos, has_gauss, cached = np.random.get_state(legacy=True)
    if name != "MT19937":  # pragma: no cover - the legacy global generator is always MT19937
        raise RuntimeError(f"NumPy's global generator is {name!r}, expected 'MT19937'")
    tail = _NUMPY_TAIL.pack(int(pos), int(has_gauss), float(cached))
    return _as_bytes(np.asarray(words, dtype="<u4").tobytes() + tail)


def _set_numpy_state(data: np.ndarray) -> None:
    raw = _checked(data, 4 * _MT_WORDS + _NUMPY_TAIL.size, "numpy")
    words = np.frombuffer(raw[: 4 * _MT_WORDS], dtype="<u4").astype(np.uint32)
    pos, has_gauss, cached = _NUMPY_TAIL.unpack(raw[4 * _MT_WORDS :])
    np.random.set_state(("MT19937", words, pos, has_gauss, cached))


def _python_state() -> np.ndarray:
    version, words, gauss = random.getstate()
    if version != 3 or len(words) != _MT_WORDS + 1:  # pragma: no cover - CPython's format
        raise RuntimeError(f"unexpected Python random state version {version}")
    tail = _PYTHON_TAIL.pack(gauss is not None, 0.0 if gauss is None else gauss)
    return _as_bytes(np.asarray(words, dtype="<u4").tobytes() + tail)


def _set_python_state(data: np.ndarray) -> None:
    raw = _checked(data, 4 * (_MT_WORDS + 1) + _PYTHON_TAIL.size, "python")
    words = tuple(int(w) for w in np.frombuffer(raw[: 4 * (_MT_WORDS + 1)], dtype="<u4"))
    has_gauss, gauss = _PYTHON_TAIL.unpack(raw[4 * (_MT_WORDS + 1) :])
    random.setstate((3, words, gauss if has_gauss else None))


def _checked(data: np.ndarray, size: int, name: str) -> bytes:
    raw = np.asarray(data, dtype=np.uint8).tobytes()
    if len(raw) != size:
        raise ValueError(
            f"the saved {name!r} random state has {len(raw)} bytes, expected {size}: the "
            "checkpoint is damaged or comes from another program"
        )
    return raw


def capture() -> RandomState:
    """The state of every global generator in use, as named `uint8` arrays.

    Keys: `"numpy"`, `"python"`, and, once torch is imported, `"torch"` and `"cuda:<i>"`
    for each initialised CUDA device.
    """
    state = {"numpy": _numpy_state(), "python": _python_state()}
    torch: Any = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state().numpy().copy()
        if torch.cuda.is_initialized():
            # The generators CUDA made (none where CUDA is only simulated, as in tests).
            for index, generator in enumerate(torch.cuda.default_generators):
                state[f"cuda:{index}"] = generator.get_state().numpy().copy()
    return state


def restore(state: Mapping[str, np.ndarray]) -> None:
    """Set every global generator named in `state` (what `capture` returned).

    A torch state is restored into torch (imported here if it is installed; skipped if
    it is not, since nothing could draw from it); CUDA states only into devices that exist.
    """
    unknown = set(state) - {"numpy", "python", "torch"} - {k for k in state if k[:5] == "cuda:"}
    if unknown:
        raise ValueError(
            f"unknown random generators {sorted(unknown)!r} in a saved random state; expected "
            "'numpy', 'python', 'torch' and 'cuda:<i>'"
        )
    if "numpy" in state:
        _set_numpy_state(state["numpy"])
    if "python" in state:
        _set_python_state(state["python"])
    torch_keys = [k for k in state if k == "torch" or k.startswith("cuda:")]
    if not torch_keys:
        return
    try:
        import torch
    except ImportError:  # pragma: no cover - a torch checkpoint restored without torch
        return
    if "torch" in state:
        torch.set_rng_state(torch.from_numpy(np.asarray(state["torch"], dtype=np.uint8).copy()))
    generators = torch.cuda.default_generators if torch.cuda.is_available() else ()
    for key in torch_keys:
        if key.startswith("cuda:") and int(key[5:]) < len(generators):
            data = np.asarray(state[key], dtype=np.uint8).copy()
            generators[int(key[5:])].set_state(torch.from_numpy(data))


@contextlib.contextmanager
def replayed(state: Mapping[str, np.ndarray] | None) -> Iterator[None]:
    """Run the enclosed code under `state`, then put the generators back as they were.

    `None` runs it under the current state (nothing is changed).
    """
    if state is None:
        yield
        return
    current = capture()
    restore(state)
    try:
        yield
    finally:
        restore(current)
