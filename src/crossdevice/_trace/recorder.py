"""`Recorder`: a bounded ring of trace events, written as Chrome/Perfetto trace-event JSON.

Horovod's timeline grew without bound (gigabytes for a long run, horovod#603). Here the
ring keeps the events of the last `steps` steps and never more than `max_events` events,
and `max_events` is derived from `max_bytes` (64 MiB by default) and the largest JSON an
event can take (`EVENT_BYTES`: every text in an event is cut to fit), so the file written
is under `max_bytes` however long the run was. Appending is one `deque.append` of a tuple
(atomic under the GIL: replica threads append without a lock).

An event is `(kind, tid, label, start, end, args)`: `kind` "X" (a span on lane `tid`, from
`start` to `end` in `time.monotonic()` seconds: a replica's "step", "wait", "reduce" or
"share", a worker's "collective") or "S" (a step begins: the ring keeps whole steps);
`args` is None or (the call's kind, its sequence number, a dict of details or None).
The writer adds what is implied rather than recorded: a "compute" span for each gap
between a replica's collectives inside a step, and the lanes' names.

The JSON is the trace event format (`{"traceEvents": [...]}`, times in microseconds)
that https://ui.perfetto.dev and chrome://tracing open.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any, Final

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_STEPS",
    "EVENT_BYTES",
    "WORKER_LANE",
    "Recorder",
]

#: The file's bound (the issue's: a trace never grows past it, whatever the run length).
DEFAULT_MAX_BYTES: Final = 64 * 1024 * 1024
#: Steps the ring keeps by default: enough to see a pattern, few enough to open quickly.
DEFAULT_STEPS: Final = 1000
#: The most one event's JSON can take: names and call sites are cut so that it fits.
EVENT_BYTES: Final = 512
#: Longest text kept in a name or an argument (so an event stays under `EVENT_BYTES`).
_TEXT: Final = 120
#: The lane (thread id) of a worker's cross-worker collectives.
WORKER_LANE: Final = 1000
#: Each recorded event may add one implied "compute" span when written.
_WRITTEN_PER_EVENT: Final = 2

Event = tuple[str, int, str, float, float, Any]


class Recorder:
    """The ring of one trace: the last `steps` steps, at most `max_bytes` when written.

    Args:
        steps: how many of the latest steps to keep (>= 1).
        max_bytes: the written file's bound (>= 64 KiB).
    """

    def __init__(self, steps: int = DEFAULT_STEPS, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, received {steps!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 65536:
            raise ValueError(f"max_bytes must be an int >= 65536, received {max_bytes!r}")
        self.steps = steps
        self.max_bytes = max_bytes
        #: room for the lanes' names and the file's frame, out of the bound.
        self.max_events = (max_bytes - 32768) // (EVENT_BYTES * _WRITTEN_PER_EVENT)
        self.events: collections.deque[Event] = collections.deque(maxlen=self.max_events)
        self.step_count = 0

    def add(self, tid: int, label: str, start: float, end: float, args: Any = None) -> None:
        """Append one span (see the module doc)."""
        self.events.append(("X", tid, label, start, end, args))

    def step(self, now: float) -> None:
        """A step begins (`strategy.run`)."""
        self.step_count += 1
        self.events.append(("S", -1, "", now, now, self.step_count))

    def kept(self) -> list[Event]:
        """The events of the last `steps` steps still in the ring, oldest first."""
        events = list(self.events.copy())  # one C call: replica threads may be appending
        marks = [i for i, e in enumerate(events) if e[0] == "S"]
        if len(marks) > self.steps:
            events = events[marks[-self.steps] :]
        return events

    def trace_events(self, origin: float, pid: int, label: str) -> Iterator[dict[str, Any]]:
        """The kept events as trace-event dicts (times in us from `origin`), lanes named."""
        events = self.kept()
        lanes: set[int] = set()
        for event in _with_compute(events):
            kind, tid, label, start, end, args = event
            if kind == "S":
                continue
            lanes.add(tid)
            name = label
            if args is not None:  # (the call's kind, its number, what else to show)
                name = f"{label} {args[0]} #{args[1]}"
                args = {"kind": args[0], "seq": args[1], **(args[2] or {})}
            out: dict[str, Any] = {
                "name": name[:_TEXT],
                "cat": _CATEGORY.get(label, "crossdevice"),
                "ph": "X",
                "ts": round((start - origin) * 1e6, 3),
                "dur": round(max(0.0, end - start) * 1e6, 3),
                "pid": pid,
                "tid": tid,
            }
            if args:
                out["args"] = {k: _short(v) for k, v in args.items()}
            yield out
        yield {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}}
        for tid in sorted(lanes):
            name = "worker collectives" if tid == WORKER_LANE else f"replica {tid}"
            yield {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}

    def write(self, path: str, origin: float, pid: int, label: str, meta: dict[str, Any]) -> int:
        """Write the trace to `path` (atomically); return its size in bytes.

        Args:
            path: the file to write.
            origin: the time that becomes 0 (the trace's start).
            pid: the process lane (the worker's rank).
            label: the process lane's name.
            meta: what `crossdevice trace merge` needs (rank, world size, ...).
        """
        tmp = f"{path}.tmp{os.getpid()}"
        size = 0
        with open(tmp, "w", encoding="utf-8") as f:
            head = (
                '{"displayTimeUnit": "ms", "otherData": '
                + json.dumps(meta)
                + ', "traceEvents": [\n'
            )
            f.write(head)
            size += len(head)
            first = True
            for event in self.trace_events(origin, pid, label):
                text = json.dumps(event, separators=(",", ":"))
                if len(text) > EVENT_BYTES:  # the args were too long: keep the span
                    event.pop("args", None)
                    text = json.dumps(event, separators=(",", ":"))
                text = text if first else ",\n" + text
                first = False
                f.write(text)
                size += len(text)
            f.write("\n]}\n")
            size += 4
        os.replace(tmp, path)
        return size


#: Trace-event categories by the first word of a span's name.
_CATEGORY: Final = {
    "wait": "wait",
    "reduce": "reduce",
    "share": "reduce",
    "compute": "compute",
    "step": "step",
    "collective": "collective",
}


def _short(value: Any) -> Any:
    if isinstance(value, str):
        return value[:_TEXT]
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return str(value)[:_TEXT]


def _with_compute(events: list[Event]) -> Iterable[Event]:
    """`events`, plus a "compute" span for each gap between a replica's collectives.

    A replica's step ("step" span on its lane) holds its waits and reductions; what is
    left between them is its own work (the user's code between collectives).
    """
    by_lane: dict[int, list[Event]] = collections.defaultdict(list)
    for event in events:
        yield event
        if event[0] == "X" and event[1] != WORKER_LANE:
            by_lane[event[1]].append(event)
    for tid, spans in by_lane.items():
        spans.sort(key=lambda e: (e[3], -e[4]))
        step_end = None
        cursor = 0.0
        for _, _, name, start, end, _ in spans:
            if name == "step":
                if step_end is not None and step_end > cursor:
                    yield ("X", tid, "compute", cursor, step_end, None)
                step_end, cursor = end, start
                continue
            if step_end is None or start > step_end:
                continue
            if start > cursor:
                yield ("X", tid, "compute", cursor, start, None)
            cursor = max(cursor, end)
        if step_end is not None and step_end > cursor:
            yield ("X", tid, "compute", cursor, step_end, None)
