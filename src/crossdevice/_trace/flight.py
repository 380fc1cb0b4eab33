"""The flight recorder: what every replica and worker did last, written when a collective fails.

Always on. Each rendezvous (the replicas of a strategy) and each worker communicator
keeps its last `COLLECTIVES` collectives in a bounded deque (`history`): one small tuple
per round, appended by its last arriver, with every replica's arrival time (or the worker's
`Call`): measured on the per-step benchmark to be within its noise
(docs/guides/finding-slow-steps.md). When a collective fails (replicas or
workers that disagree, a timeout, a failed worker) or a run is interrupted (Ctrl-C), the
failing side writes a report next to the error and the error's message ends with where:

    ... Flight recorder report: /tmp/crossdevice-flight/flight-20261126-120102-4711-1.txt

The report is a JSON file and the same as text, readable without crossdevice: the error,
the culprits when known, every registered rendezvous' and worker communicator's last
collectives (sequence number, kind, fingerprint, each replica's arrival time, who had
arrived and who had not) and the stack of every thread (replica threads included) and of
every parked cooperative replica (a greenlet: `register_stacks`).

Reports go to the directory named by `CROSSDEVICE_FLIGHT_DIR` (`off` writes none), by
default `crossdevice-flight` in the system's temporary directory. At most
`MAX_REPORTS` per process: a loop that fails the same way does not fill the disk. And
the directory keeps the newest `KEPT_REPORTS` reports of every process together: each
writer deletes the oldest beyond that (a job relaunched after every crash, or a test
suite run again and again, otherwise grows it without end).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final

__all__ = [
    "COLLECTIVES",
    "ENV_DIR",
    "KEPT_REPORTS",
    "MAX_REPORTS",
    "as_text",
    "attach",
    "register",
    "register_stacks",
    "rendezvous_group",
    "replica_rounds",
    "report",
    "report_dir",
]

#: Collectives each replica's (and worker's) history keeps (the issue's "last 1,000").
COLLECTIVES: Final = 1000
#: Reports one process writes at most.
MAX_REPORTS: Final = 20
#: Reports the directory keeps, of all processes together (each is a .json and a .txt
#: of some 10-50 KB): the oldest beyond it are deleted by whoever writes the next one.
KEPT_REPORTS: Final = 200
#: The environment variable that names the reports' directory (`off`: none).
ENV_DIR: Final = "CROSSDEVICE_FLIGHT_DIR"
#: Marks an exception whose message already says where its report is.
_MARK: Final = "_crossdevice_flight_report"

#: Stacks that are in no thread's (see `register_stacks`): each owner and its lister.
_FRAMES: weakref.WeakKeyDictionary[Any, Callable[[Any], list[tuple[str, Any]]]] = (
    weakref.WeakKeyDictionary()
)
#: What can be in a report: each source and the function that renders it as a dict.
_SOURCES: weakref.WeakKeyDictionary[Any, Callable[[Any, float], dict[str, Any]]] = (
    weakref.WeakKeyDictionary()
)
_LOCK: Final = threading.Lock()
_written = itertools.count(1)


def register(source: Any, render: Callable[[Any, float], dict[str, Any]]) -> None:
    """Put `source` (a rendezvous, a worker communicator's sequencer) in every report.

    Args:
        source: kept by a weak reference: a strategy that is gone leaves the reports.
        render: `render(source, now)` returns its part of the report (a JSON-able dict
            with "name", "kind" and "collectives"); `now` is `time.monotonic()`.
    """
    with _LOCK:
        _SOURCES[source] = render


def register_stacks(owner: Any, frames: Callable[[Any], list[tuple[str, Any]]]) -> None:
    """Put the stacks `frames(owner)` lists in every report, beside the threads' stacks.

    For replicas that are not threads (cooperative replicas are greenlets: a parked one's
    stack is in no thread's). `owner` is kept by a weak reference; `frames(owner)` returns
    (name, top frame) pairs.
    """
    with _LOCK:
        _FRAMES[owner] = frames


def report_dir() -> str | None:
    """Where reports go (None: `CROSSDEVICE_FLIGHT_DIR=off`)."""
    chosen = os.environ.get(ENV_DIR, "")
    if chosen.lower() in ("off", "0", "none"):
        return None
    return chosen or os.path.join(tempfile.gettempdir(), "crossdevice-flight")


def report(
    error_type: str,
    message: str,
    culprits: Sequence[str] = (),
    tag: str = "",
    source: Any = None,
) -> str:
    """Write a report of `error_type: message`; return the note to end its message with.

    Never raises (a report that cannot be written says so in the note: the error it
    explains must still reach the user).

    Args:
        error_type: the error's class name.
        message: the error's message.
        culprits: who is at fault, when known ("replica 2", "rank 1").
        tag: added to the file name (a worker's "rank1").
        source: the registered source where it failed: its group comes first, marked
            `"failed": true`.
    """
    directory = report_dir()
    if directory is None:
        return ""
    number = next(_written)
    if number > MAX_REPORTS:
        return (
            f" Flight recorder: {MAX_REPORTS} reports written by this process already "
            f"(in {directory}); no more."
        )
    try:
        now = time.monotonic()
        with _LOCK:
            sources = list(_SOURCES.items())
        groups = []
        for each, render in sorted(sources, key=lambda item: item[0] is not source):
            try:
                group = render(each, now)
            except Exception as err:  # a source half torn down: report the rest
                group = {"name": repr(each), "error": repr(err), "collectives": []}
            group["failed"] = each is source
            groups.append(group)
        data = {
            "format": "crossdevice flight recorder report 1",
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "error": {"type": error_type, "message": message},
            "culprits": list(culprits),
            "times": "seconds before the report was written (time.monotonic())",
            "groups": groups,
            "threads": _stacks(),
        }
        os.makedirs(directory, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = os.path.join(directory, f"flight-{stamp}-{os.getpid()}-{number}{tag}")
        with open(base + ".json", "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        with open(base + ".txt", "w", encoding="utf-8") as f:
            f.write(as_text(data))
    except Exception as err:  # a full disk must not hide the error being reported
        return f" Flight recorder: could not write a report in {directory}: {err!r}."
    with contextlib.suppress(OSError):  # the report is written; pruning is best effort
        _prune(directory, keep=os.path.basename(base))
    # On the message's last line: a log that shows only the last line (`Type: message`)
    # still shows where the report is.
    return f" Flight recorder report: {base}.txt (and .json)"


def _prune(directory: str, keep: str) -> None:
    """Delete the oldest reports in `directory` beyond `KEPT_REPORTS`, never `keep`.

    Only this module's files (`flight-*.json` and `.txt`, a report's two counted as one,
    aged by the newer) are touched. Processes that prune at once can only race to delete
    the same old files: a file already gone is skipped.
    """
    ages: dict[str, float] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            stem, dot, suffix = entry.name.rpartition(".")
            if not (dot and stem.startswith("flight-") and suffix in ("json", "txt")):
                continue
            try:
                mtime = entry.stat(follow_symlinks=False).st_mtime
            except OSError:  # deleted by another process meanwhile
                continue
            ages[stem] = max(ages.get(stem, mtime), mtime)
    ages.pop(keep, None)
    excess = len(ages) + 1 - KEPT_REPORTS
    for stem in sorted(ages, key=ages.__getitem__)[: max(excess, 0)]:
        for suffix in (".json", ".txt"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, stem + suffix))


def attach(
    exc: BaseException, culprits: Sequence[str] = (), tag: str = "", source: Any = None
) -> None:
    """Write a report of `exc` and end its message with where it is (once per exception).

    The type is kept; the message (its first argument) gets the note, or, for an
    exception whose message is not its first argument, a note (`add_note`).
    """
    if getattr(exc, _MARK, False):
        return
    try:
        setattr(exc, _MARK, True)
    except AttributeError:  # pragma: no cover - exceptions take attributes
        return
    note = report(type(exc).__name__, str(exc), culprits, tag, source)
    if not note:
        return
    if len(exc.args) >= 1 and isinstance(exc.args[0], str) and str(exc) == exc.args[0]:
        exc.args = (exc.args[0] + note, *exc.args[1:])
    else:
        exc.add_note(note.strip())


def _stacks() -> list[dict[str, Any]]:
    """Every thread's stack, then every registered owner's (parked cooperative replicas)."""
    names = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        thread = names.get(ident)
        out.append(
            {
                "name": thread.name if thread is not None else f"thread {ident}",
                "ident": ident,
                "daemon": bool(thread is not None and thread.daemon),
                "stack": _format(frame),
            }
        )
    with _LOCK:
        owners = list(_FRAMES.items())
    for owner, frames in owners:
        try:
            named = frames(owner)
        except Exception as exc:  # a report is written while things fail: never lose it
            named = []
            out.append({"name": f"{owner!r}", "ident": None, "daemon": False, "stack": [repr(exc)]})
        for name, frame in named:
            out.append({"name": name, "ident": None, "daemon": False, "stack": _format(frame)})
    return out


def _format(frame: Any) -> list[str]:
    return [line.rstrip("\n") for line in traceback.format_stack(frame)]


def as_text(data: dict[str, Any]) -> str:
    """The report as text (what the .txt file holds)."""
    lines = [
        f"crossdevice flight recorder report, {data['written']}, host {data['host']}, "
        f"pid {data['pid']}",
        "",
        f"{data['error']['type']}: {data['error']['message']}",
    ]
    if data["culprits"]:
        lines.append(f"Culprits: {', '.join(data['culprits'])}")
    lines.append(f"Times are {data['times']}.")
    for group in data["groups"]:
        failed = " (where it failed)" if group.get("failed") else ""
        lines += [
            "",
            f"== {group['name']}{failed} ({group.get('kind', '?')}): last collectives, newest last",
        ]
        for entry in group["collectives"]:
            lines.append("  " + entry["text"] if "text" in entry else "  " + json.dumps(entry))
    lines += ["", "== Threads"]
    for thread in data["threads"]:
        lines += ["", f"-- {thread['name']} (ident {thread['ident']})"]
        lines += ["  " + line for line in "\n".join(thread["stack"]).splitlines()]
    return "\n".join(lines) + "\n"


def rendezvous_group(rendezvous: Any, now: float) -> dict[str, Any]:
    """A rendezvous' part of a report (`register`'s `render` for the replicas of a strategy)."""
    n = rendezvous.num_replicas
    return {
        "name": rendezvous.name,
        "kind": f"{n} replicas in this process",
        "collectives": replica_rounds(rendezvous.flight_record(), now),
    }


def replica_rounds(records: Sequence[tuple[Any, ...]], now: float) -> list[dict[str, Any]]:
    """A rendezvous' flight record (`Rendezvous.flight_record`), one entry per collective.

    Each record is (seq, arrival times by replica, kind, leaves, calls): `calls` is None
    when every replica made the same call, else each replica's (kind, leaves) or None
    where it has not arrived.
    """
    out = []
    for seq, times, kind, leaves, each in records:
        calls = [(kind, leaves)] * len(times) if each is None else each
        came = [r for r, call in enumerate(calls) if call is not None]
        ranked = sorted(came, key=lambda r: times[r])
        arrivals = [
            {
                "replica": r,
                "kind": calls[r][0],
                "fingerprint": _leaves(*calls[r]),
                "order": ranked.index(r) + 1,
                "seconds_ago": round(now - times[r], 6),
            }
            for r in ranked
        ]
        missing = [r for r, call in enumerate(calls) if call is None]
        fingerprints = sorted({a["fingerprint"] for a in arrivals})
        when = ", ".join(f"r{a['replica']} {a['seconds_ago'] * 1e3:.3f} ms ago" for a in arrivals)
        out.append(
            {
                "seq": seq,
                "kind": kind or "/".join(sorted({a["kind"] for a in arrivals})),
                "arrivals": arrivals,
                "arrived": ranked,
                "missing": missing,
                "text": f"#{seq} {'/'.join(fingerprints)}: arrived {ranked}"
                + (f", missing {missing}" if missing else "")
                + f" ({when})",
            }
        )
    return out


def _leaves(kind: str, leaves: Any) -> str:
    """`all_reduce(float32[256], int64[])`: a call and its leaves' dtypes and shapes."""
    if not leaves:
        return kind
    try:
        text = ", ".join(f"{dtype}{list(shape)}" for shape, dtype in leaves)
    except (TypeError, ValueError):
        text = str(leaves)
    return f"{kind}({text[:200]})"
