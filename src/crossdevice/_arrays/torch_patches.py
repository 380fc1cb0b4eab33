"""The one owner of every process-wide change crossdevice makes to torch.

torch keeps some state per process where replicas need it per replica: one random
generator, one `Module.__call__`, one `torch.autograd.backward`, schedulers and averaged
models that each replica would step. crossdevice replaces a few of torch's functions for
that, and this module is the only place that does it:

* `torch_guard`: `torch.nn.Module.__call__` and a global optimizer step pre-hook refuse a
  module or optimizer that several replicas would share and mutate;
* `torch_random`: the drawing functions, dropout and `torch.get_rng_state` /
  `set_rng_state` use the running replica's own generator;
* the torch training layer (`crossdevice._frameworks.torch`): `torch.autograd.backward`
  (gradient buckets are reduced when the outermost backward pass ends), LR schedulers'
  `step`, `AveragedModel.update_parameters` and the gradient clipping functions, which
  run once per step, the `max_norm` rescaling of embeddings (the rows of every
  replica's batch, on every replica: `embedding.py`), and torch's intra-op thread
  count (lowered while replicas compute in parallel, put back on removal unless the
  user changed it since), and `torch.nn.Module.__setattr__` / `__delattr__`, which
  note an attribute set on a prepared model's replica-0 submodule so that every
  replica follows it (`attributes.py`; torch's own code runs unchanged).

Each replacement calls torch's function unchanged outside `strategy.run`, inside a
strategy with one replica per process, and while `torch.compile` traces (the
replacements never reach a compiled graph). They are installed when a strategy with
several replicas in sync first runs with torch imported (or a module is prepared on it),
and removed when the last such strategy is closed or collected, so torch is untouched
while no such strategy is in use. A replacement is made once per torch function and
reused, so code compiled while it is installed keeps matching its guards.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final

__all__ = ["Patch", "check_dynamo", "installed", "on_dynamo", "register", "release", "require"]

_MISSING: Final = object()


class Patch:
    """One replacement: `owner.name = make(previous)` while the patches are installed.

    Args:
        owner: returns the object to patch (a module or class), resolved at install time
            (None: nothing to patch in this torch, e.g. an optional submodule).
        name: the attribute.
        make: builds the replacement from the attribute's current value.
        hook: instead of an attribute, a function that installs something and returns a
            handle with `remove()` (torch's global hook registries).
    """

    __slots__ = ("_cache", "hook", "make", "name", "owner")

    def __init__(
        self,
        owner: Callable[[], Any] | None = None,
        name: str = "",
        make: Callable[[Any], Any] | None = None,
        hook: Callable[[], Any] | None = None,
    ) -> None:
        self.owner = owner
        self.name = name
        self.make = make
        self.hook = hook
        self._cache: tuple[Any, Any] | None = None  # (previous, replacement)

    def replacement(self, previous: Any) -> Any:
        """The replacement for `previous`, the same object every time `previous` is."""
        cached = self._cache
        if cached is not None and cached[0] is previous:
            return cached[1]
        assert self.make is not None
        made = self.make(previous)
        self._cache = (previous, made)
        return made


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.patches: list[Patch] = []
        self.holders: set[int] = set()
        # (patch, owner, previous __dict__ entry or _MISSING, installed value or handle)
        self.undo: list[tuple[Patch, Any, Any, Any]] = []


_STATE = _State()


#: Callbacks waiting for torch's compiler (`torch._dynamo`) to be loaded; see `on_dynamo`.
dynamo_pending: list[Callable[[], None]] = []


def on_dynamo(callback: Callable[[], None]) -> None:
    """Call `callback` once `torch._dynamo` is loaded: now if it is, else at `check_dynamo`.

    Importing torch's compiler costs a second, so code that must mark functions for it
    waits until the user's own `torch.compile` has loaded it.
    """
    if "torch._dynamo" in sys.modules:
        callback()
    else:
        dynamo_pending.append(callback)


def check_dynamo() -> None:
    """Run the `on_dynamo` callbacks if torch's compiler has been loaded since."""
    if dynamo_pending and "torch._dynamo" in sys.modules:
        while dynamo_pending:
            dynamo_pending.pop(0)()


def register(*patches: Patch) -> None:
    """Add patches to the set; installed at once if the set is in force now."""
    with _STATE.lock:
        for patch in patches:
            _STATE.patches.append(patch)
            if _STATE.holders:
                _install(patch)


def require(holder: Any) -> None:
    """Keep the patches installed while `holder` (a strategy) lives or until `release`."""
    key = id(holder)
    with _STATE.lock:
        if key in _STATE.holders:
            return
        if not _STATE.holders:
            try:
                for patch in _STATE.patches:
                    _install(patch)
            except BaseException:
                _undo_all()
                raise
        _STATE.holders.add(key)
        weakref.finalize(holder, _drop, key)


def release(holder: Any) -> None:
    """`holder` no longer needs the patches (a closed strategy)."""
    _drop(id(holder))


def installed() -> bool:
    """Whether the patches are in force now."""
    return bool(_STATE.holders)


def _drop(key: int) -> None:
    with _STATE.lock:
        if key not in _STATE.holders:
            return
        _STATE.holders.discard(key)
        if not _STATE.holders:
            _undo_all()


def _undo_all() -> None:
    with _STATE.lock:
        while _STATE.undo:
            patch, owner, previous, value = _STATE.undo.pop()
            if patch.hook is not None:
                value.remove()
            elif owner.__dict__.get(patch.name, _MISSING) is value:
                # Put back what was there, unless someone patched over us since.
                if previous is _MISSING:
                    delattr(owner, patch.name)
                else:
                    setattr(owner, patch.name, previous)


def _install(patch: Patch) -> None:
    if patch.hook is not None:
        _STATE.undo.append((patch, None, None, patch.hook()))
        return
    assert patch.owner is not None
    owner = patch.owner()
    if owner is None:
        return
    previous = owner.__dict__.get(patch.name, _MISSING)
    current = getattr(owner, patch.name)  # inherited where the owner does not define it
    value = patch.replacement(current)
    setattr(owner, patch.name, value)
    _STATE.undo.append((patch, owner, previous, value))
