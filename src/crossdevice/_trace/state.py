"""Whether tracing is on, and the hooks the rendezvous, the runner and the sequencer call.

The places that matter (a replica's arrival at a rendezvous round and its release, the
reduction, a step, a worker collective's issue and end) read one module attribute,
`crossdevice._trace.state.on`, and call a hook here only when it is True: with tracing
off the cost is that attribute read (`benchmarks/run_overhead.py` measures it).

`on` and `session` change together, under `_LOCK`, in `start` and `stop`
(`crossdevice._trace.session`); a hook that runs while tracing stops finds `session`
None and records nothing.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Final

__all__ = [
    "left",
    "on",
    "replica_step",
    "session",
    "shared",
    "step",
    "user_site",
    "worker_ended",
    "worker_issued",
]

#: Tracing is on (read by the hooks' callers; a plain bool, no call when off).
on: bool = False
#: The trace being recorded, when `on` (a `crossdevice._trace.session.Session`; not
#: imported here: the session imports this module).
session: Any = None
_LOCK: Final = threading.Lock()
_monotonic: Final = time.monotonic

#: Files under this directory are crossdevice's own: a call site is the first frame outside.
_PACKAGE: Final = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


#: `user_site`'s text by (code, line): a training step calls from the same lines.
_SITES: dict[tuple[Any, int], str] = {}
#: `_nbytes` by leaves' signature (a step repeats its signatures).
_NBYTES: dict[Any, int] = {}


def user_site(depth: int = 2) -> str:
    """`file.py:42 (fn)`: the first frame above `depth` outside crossdevice (the user's line)."""
    frame: Any = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return ""
    key = (frame.f_code, frame.f_lineno)
    text = _SITES.get(key)
    if text is None:
        code = frame.f_code
        text = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} ({code.co_name})"
        if len(_SITES) >= 4096:
            _SITES.clear()
        _SITES[key] = text
    return text


# ---------------------------------------------------------------------- replicas


def step() -> None:
    """`strategy.run` begins: one step."""
    s = session
    if s is not None:
        s.step(_monotonic())


def replica_step(replica_id: int, start: float) -> None:
    """Replica `replica_id`'s function ran from `start` until now."""
    s = session
    if s is not None:
        s.recorder.add(replica_id, "step", start, _monotonic())


def left(
    rendezvous: Any, rnd: Any, replica_id: int, start: float, last: bool, cooperative: bool
) -> None:
    """Replica `replica_id`, which arrived at `rnd` at `start`, leaves it now.

    Not the `last` to arrive: it waited. The last: it completed the round (validated,
    reduced), and its lateness goes to the straggler report, unless the replicas are
    `cooperative` (they take turns, so the last one is always late by its peers' work).
    """
    s = session
    if s is None:
        return
    if not last:
        s.recorder.events.append(
            ("X", replica_id, "wait", start, _monotonic(), (rnd.kind, rnd.seq, None))
        )
        return
    end = _monotonic()
    n = rendezvous.num_replicas
    details: dict[str, Any] = {"site": user_site(3), "replicas": n}
    leaves = getattr(rnd.arrivals[0], "sig", None)
    if leaves:
        details["bytes"] = _cached_nbytes(leaves)
    s.recorder.events.append(("X", replica_id, "reduce", start, end, (rnd.kind, rnd.seq, details)))
    if n > 1 and not cooperative:
        times = sorted(rnd.times)
        s.stragglers.last(rendezvous.name, replica_id, times[-1] - times[-2])


def shared(rnd: Any, replica_id: int, start: float) -> None:
    """Replica `replica_id` took its share of `rnd`'s reduction from `start` until now."""
    s = session
    if s is not None:
        s.recorder.add(replica_id, "share", start, _monotonic(), (rnd.kind, rnd.seq, None))


def _cached_nbytes(leaves: Any) -> int:
    try:
        nbytes = _NBYTES.get(leaves)
    except TypeError:  # an unhashable part: count afresh
        return _nbytes(leaves)
    if nbytes is None:
        if len(_NBYTES) >= 4096:
            _NBYTES.clear()
        nbytes = _NBYTES[leaves] = _nbytes(leaves)
    return nbytes


def _nbytes(leaves: Any) -> int:
    total = 0
    try:
        for shape, dtype in leaves:
            count = 1
            for d in shape:
                count *= int(d)
            total += count * int(getattr(dtype, "itemsize", 0))
    except (TypeError, ValueError):
        return 0
    return total


# ---------------------------------------------------------------------- workers


def worker_issued(sequencer: Any, call: Any) -> None:
    """A worker communicator (`sequencer`) issues numbered collective `call`."""
    s = session
    if s is not None:
        s.worker_issued(sequencer, call, user_site(3))


def worker_ended(sequencer: Any, call: Any) -> None:
    """`call`'s work (or a part of it) ended at `call.ended`."""
    s = session
    if s is not None:
        s.worker_ended(sequencer, call)
