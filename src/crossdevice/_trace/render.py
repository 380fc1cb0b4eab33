"""`render`: a trace as a PNG timeline (`crossdevice trace render`), with matplotlib.

Perfetto and chrome://tracing are the viewers; this is for where there is no browser
(a report, a terminal session, the docs' picture): one row per replica (and per
worker's collective lane), a bar per span coloured by what it was, over the last few
steps of the trace.
"""

from __future__ import annotations

from typing import Any, Final

from crossdevice._trace.merge import load
from crossdevice._trace.recorder import WORKER_LANE

__all__ = ["COLOURS", "render"]

#: Colour of each span category.
COLOURS: Final = {
    "compute": "#4caf50",
    "wait": "#e53935",
    "reduce": "#1e88e5",
    "collective": "#8e24aa",
}


def render(path: str, png: str, steps: int = 4, title: str | None = None) -> int:
    """Draw the last `steps` steps of the trace at `path` into `png`; return the spans drawn.

    Raises:
        ImportError: matplotlib is missing (`pip install crossdevice[plot]`).
        ValueError: `path` is not a trace, or holds no spans.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError(
            "rendering a trace needs matplotlib, which is not installed; install it with "
            "`pip install crossdevice[plot]`"
        ) from None
    events = load(path)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") != "step"]
    if not spans:
        raise ValueError(f"{path}: expected a trace with spans, received none")
    first = min(e["pid"] for e in spans)
    starts = sorted(
        e["ts"] for e in events if e.get("cat") == "step" and (e["pid"], e["tid"]) == (first, 0)
    )
    begin = starts[-steps] if len(starts) >= steps else min(e["ts"] for e in spans)
    shown = [e for e in spans if e["ts"] + e.get("dur", 0) >= begin]
    lanes = sorted({(e["pid"], e["tid"]) for e in shown})
    row = {lane: i for i, lane in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.5 * len(lanes)), dpi=110)
    for e in shown:
        colour = COLOURS.get(e.get("cat", ""), "#9e9e9e")
        start = max(e["ts"], begin)
        width = (e["ts"] + e.get("dur", 0) - start) / 1e3
        ax.barh(
            row[(e["pid"], e["tid"])], width, left=(start - begin) / 1e3, color=colour, height=0.7
        )
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([_lane_name(p, t, len({p for p, _ in lanes}) > 1) for p, t in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    ax.set_title(title or f"crossdevice trace: the last {steps} steps of {path}", fontsize=10)
    ax.legend(
        handles=[Patch(color=c, label=name) for name, c in COLOURS.items()],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25 if len(lanes) > 3 else -0.4),
        ncol=len(COLOURS),
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return len(shown)


def _lane_name(pid: Any, tid: Any, workers: bool) -> str:
    lane = "collectives" if tid == WORKER_LANE else f"replica {tid}"
    return f"worker {pid} {lane}" if workers else lane
