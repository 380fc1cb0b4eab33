"""What a collective is for, in the user's words, for the errors about it.

A cross-worker collective the library makes on the user's behalf has a name that means
nothing to the user: reading a `SyncOnReadVariable` in cross-replica context is an
`all_reduce #108`, and `next(iterator)` of a distributed dataset a `has_data #108`. When
one worker makes such a call and another does not, the mismatch or timeout must say
what each worker was doing. Code that makes one wraps it in `purpose(...)`; the worker
communicator takes the text for the collective started inside (its label, which every
error about it shows, and the detail a mismatch shows for each worker). Local replicas
compare it (`_comm/local/arrivals.py`): collectives made for different things never
combine (a replica's backward pass through a differentiable all-reduce, `_arrays/
torch_autograd.py`, meeting another's plain all-reduce of the same shapes).

`purpose(text, tag=n)` also adds `n` to the call site the workers compare
(`site_tag`): calls from the same line that stand for different things (the gradients
after another number of optimizer steps) then differ between workers.

`agreeing(value, describe)` adds a state every worker must share to the collectives
started inside (`state`): an int compared with the call (the worker fingerprint's
`state` field, never part of a call's cached route), and `describe()`, what it stands
for in words, read only when the workers' values differ. `crossdevice.torch` gives its
gradients the optimizer's hyperparameters and `zero_grad()` calls there
(`_frameworks/torch/step_state.py`): a worker whose learning rate or gradient
accumulation went its own way fails at its next backward, before any update.

All are per thread, and per cooperative replica (context variables: each greenlet has
its own), since the collective runs on the thread that asked for it (a queued call runs
in a copy of the caller's context variables).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar, Token
from typing import Final

__all__ = [
    "GRADIENTS_SITE",
    "NO_STATE",
    "agreeing",
    "current",
    "fixed_site",
    "purpose",
    "site_tag",
    "state",
]

_TEXT: ContextVar[str] = ContextVar("crossdevice_purpose", default="")
_TAG: ContextVar[int] = ContextVar("crossdevice_site_tag", default=0)
_SITE: ContextVar[tuple[str, str, int] | None] = ContextVar("crossdevice_site", default=None)

#: A state and what it stands for in words: (0, None) outside any `agreeing` block.
State = tuple[int, Callable[[], str] | None]
NO_STATE: Final[State] = (0, None)
_STATE: ContextVar[State] = ContextVar("crossdevice_state", default=NO_STATE)

#: The call site of `crossdevice.torch`'s gradient buckets on every worker: issued from a
#: backward hook or at the end of the pass (a parameter with no gradient), where walking
#: the stack finds torch's own frames, other ones in each case.
GRADIENTS_SITE: Final = ("crossdevice.torch", "gradients", 0)


@contextlib.contextmanager
def purpose(
    text: str, tag: int | None = None, site: tuple[str, str, int] | None = None
) -> Iterator[None]:
    """Collectives started in this block on this thread are described by `text`.

    `tag`: also compared across workers with their call sites (None: the outer block's).
    `site`: the call site they have, instead of the user's line found by walking the
    stack (`_cross_device/call_site.py`; None: the outer block's, or the walk).
    """
    token = _TEXT.set(text)
    tagged = None if tag is None else _TAG.set(tag)
    sited = None if site is None else _SITE.set(site)
    try:
        yield
    finally:
        if sited is not None:
            _SITE.reset(sited)
        if tagged is not None:
            _TAG.reset(tagged)
        _TEXT.reset(token)


def current() -> str:
    """The innermost `purpose` text of this thread ("" outside any)."""
    return _TEXT.get()


def fixed_site() -> tuple[str, str, int] | None:
    """The innermost `purpose` site of this thread (None: walk the stack)."""
    return _SITE.get()


def site_tag() -> int:
    """The innermost `purpose` tag of this thread (0 outside any)."""
    return _TAG.get()


class agreeing:  # noqa: N801 - used as a function, like `purpose`
    """Collectives started in this block carry `value`: every worker's must be the same.

    `value`: a digest (at most 63 bits) of what the workers must agree on; `describe()`:
    it in words, for the mismatch message (called only then). A class rather than a
    generator: it wraps every backward pass across workers.
    """

    __slots__ = ("_state", "_token")

    def __init__(self, value: int, describe: Callable[[], str]) -> None:
        self._state: State = (value, describe)
        self._token: Token[State] | None = None

    def __enter__(self) -> None:
        self._token = _STATE.set(self._state)

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _STATE.reset(self._token)


def state() -> State:
    """The innermost `agreeing` block's (value, describe) of this thread (`NO_STATE`)."""
    return _STATE.get()
