"""What a benchmark's call cost its process: CPU time, per thread, and page faults.

On the 2-core host both workers share the cores: the wall times follow the CPU the two
processes spend and move by several percent from run to run (DDP against itself took
0.95-1.06x its own epoch). CPU time moves far less, and counted per thread it says where
a difference goes: the caller's thread, crossdevice's threads (the queue that issues
gradient buckets, the health board, the arrivals helper), or torch's (Gloo's I/O loop
`gloo_tcp_loop`, a process group's worker `pt_gloo_runloop`, the store `pt_tcpstore_uv`).

`measured(call, usage)` wraps a call; each run appends a `Usage`. Threads are read from
`/proc/self/task` (each thread's time on a CPU, in ns, from `schedstat`); a Python thread
goes by its `threading` name with a rank suffix (`-r0`) dropped, so that ranks compare,
the caller's as `main`; any other by the name the OS has for it (a Python thread that
`threading` no longer lists, or a native one nobody named, goes by the process's own
name, `python`). A thread that ends during the call is missed there, but not in
`Usage.cpu_ns` (the process's own clock).
Where `/proc` has no per-thread times, `threads` is empty.

It also counts how often the caller's thread left its CPU during the run
(`Usage.waits`: it blocked, on a lock, a condition, a socket; `Usage.preempted`: the
scheduler took the CPU from it, for another thread or process): `getrusage(RUSAGE_THREAD)`
(Linux; 0 where missing). Each one costs more than the switch itself: the thread comes
back to caches others have used. DDP's caller waits once a step (for its buckets, inside
backward); a count above that says where a step's CPU goes that no profile of the
caller's code shows.
"""

from __future__ import annotations

import os
import re
import resource
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Usage",
    "measured",
    "median_threads",
    "switches_line",
    "thread_cpu",
    "threads_line",
]

_RANK_SUFFIX = re.compile(r"-r\d+$")


@dataclass
class Usage:
    """One run of a call: the process's CPU (ns, all threads), its page faults, per thread."""

    cpu_ns: int
    faults: int
    threads: dict[str, int] = field(default_factory=dict)
    #: The caller's thread's voluntary context switches (it blocked) during the run.
    waits: int = 0
    #: Its involuntary ones (the scheduler gave its CPU to another thread or process).
    preempted: int = 0


def thread_cpu() -> dict[str, int]:
    """CPU time each live thread of this process has used so far, in ns, summed by name.

    See the module doc for the names; {} where `/proc/self/task/*/schedstat` is missing.
    """
    python = {str(t.native_id): t for t in threading.enumerate() if t.native_id is not None}
    main = threading.main_thread()
    out: dict[str, int] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
                ns = int(f.read().split()[0])
            thread = python.get(tid)
            if thread is None:
                with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                    name = f.read().strip()
            else:
                name = "main" if thread is main else _RANK_SUFFIX.sub("", thread.name)
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile, or no schedstat in this kernel
        out[name] = out.get(name, 0) + ns
    return out


def measured(call: Callable[[], object], usage: list[Usage]) -> Callable[[], None]:
    """`call`, appending to `usage` what each run of it cost this process."""

    def run() -> None:
        before = _snapshot()
        switched = _switches()
        call()
        waits, preempted = (a - b for a, b in zip(_switches(), switched, strict=True))
        after = _snapshot()
        threads = {name: ns - before[2].get(name, 0) for name, ns in after[2].items()}
        usage.append(Usage(after[0] - before[0], after[1] - before[1], threads, waits, preempted))

    return run


def median_threads(usage: Sequence[Usage]) -> dict[str, float]:
    """Each thread name's median CPU per run, in ms, largest first (0 where a run lacked it)."""
    names = {name for one in usage for name in one.threads}
    medians = {
        name: statistics.median(one.threads.get(name, 0) for one in usage) / 1e6 for name in names
    }
    return dict(sorted(medians.items(), key=lambda item: -item[1]))


def threads_line(usage: Sequence[Usage], per: int = 1, least_ms: float = 0.05) -> str:
    """`total = main a + gloo_tcp_loop b + ...`: median ms per run (divided by `per`).

    The total is the median of the process's CPU; threads under `least_ms` are left out.
    """
    total = statistics.median(one.cpu_ns for one in usage) / 1e6 / per
    parts = [
        f"{name} {ms / per:.2f}"
        for name, ms in median_threads(usage).items()
        if ms / per >= least_ms
    ]
    return f"{total:.1f} = " + " + ".join(parts) if parts else f"{total:.1f}"


def switches_line(usage: Sequence[Usage], per: int = 1) -> str:
    """`a waits + b preemptions`: the caller's median switches per run (divided by `per`)."""
    waits = statistics.median(one.waits for one in usage) / per
    preempted = statistics.median(one.preempted for one in usage) / per
    return f"{waits:.2f} waits + {preempted:.2f} preemptions"


def _switches() -> tuple[int, int]:
    """The calling thread's (voluntary, involuntary) context switches so far; 0s if unknown."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return 0, 0
    used = resource.getrusage(who)
    return used.ru_nvcsw, used.ru_nivcsw


def _snapshot() -> tuple[int, int, dict[str, int]]:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    return time.process_time_ns(), faults, thread_cpu()
