"""`merge`: the workers' trace files on one timeline (`crossdevice trace merge`).

Each worker's file has its own clock (time 0 is when that worker started tracing;
hosts' clocks differ anyway). Every numbered collective ends on every worker at about
the same moment (the last arrival releases everyone), so the merge aligns the files at
the end of the first collective that they all hold: the same sequence number on every
worker is the same collective. Each worker becomes one process lane (its rank).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from crossdevice._trace.recorder import WORKER_LANE

__all__ = ["collective_ends", "load", "merge"]


def load(path: str) -> dict[str, Any]:
    """A trace file written by crossdevice, checked enough to merge it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{path}: expected a crossdevice trace (JSON), could not read it: {err}"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(
            f"{path}: expected a trace-event JSON object with a 'traceEvents' list, received "
            f"{type(data).__name__}; give the files crossdevice.experimental.trace wrote"
        )
    return data


def collective_ends(data: dict[str, Any]) -> dict[int, float]:
    """The end time (us) of each numbered worker collective in one worker's trace."""
    ends = {}
    for event in data["traceEvents"]:
        if event.get("ph") == "X" and event.get("tid") == WORKER_LANE:
            seq = event.get("args", {}).get("seq")
            if isinstance(seq, int):
                ends[seq] = float(event["ts"]) + float(event.get("dur", 0.0))
    return ends


def merge(paths: Sequence[str], out: str) -> dict[str, Any]:
    """Merge the trace files `paths` (one per worker) into `out`; return what it did.

    Returns:
        {"aligned_at": the sequence number aligned on (None: no collective in common,
        the clocks are left as they are), "offsets_us": each file's shift, "events": n}.

    Raises:
        ValueError: fewer than one file, a file that is not a trace, or two files of the
            same rank.
    """
    if not paths:
        raise ValueError("expected at least one trace file to merge, received none")
    datas = [load(p) for p in paths]
    ranks = [int(d.get("otherData", {}).get("rank", i)) for i, d in enumerate(datas)]
    if len(set(ranks)) != len(ranks):
        raise ValueError(
            f"expected one file per worker, received ranks {ranks} for {list(paths)}: "
            "give each worker's file once"
        )
    ends = [collective_ends(d) for d in datas]
    common = set(ends[0]).intersection(*ends[1:])
    aligned = min(common) if common else None
    offsets = [0.0 if aligned is None else e[aligned] - ends[0][aligned] for e in ends]
    events: list[dict[str, Any]] = []
    for data, rank, offset in zip(datas, ranks, offsets, strict=True):
        for original in data["traceEvents"]:
            event = dict(original)
            event["pid"] = rank
            if "ts" in event:
                event["ts"] = round(float(event["ts"]) - offset, 3)
            events.append(event)
    merged = {
        "displayTimeUnit": "ms",
        "otherData": {
            "crossdevice_trace": 1,
            "merged_from": [os.path.basename(p) for p in paths],
            "ranks": ranks,
            "aligned_at_collective": aligned,
            "offsets_us": dict(zip(map(str, ranks), offsets, strict=True)),
        },
        "traceEvents": events,
    }
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(merged, f, separators=(",", ":"))
    os.replace(tmp, out)
    return {"aligned_at": aligned, "offsets_us": offsets, "events": len(events)}
