"""`crossdevice bench --plot FILE.png`: bus bandwidth against message size, nccl-tests style.

One line per implementation, the message size on a log axis, and the memory-bandwidth
limit measured in the same run drawn as a dashed line: an all-reduce of N host arrays of S
bytes moves at least (N+1)·S bytes (docs/design.md §4), so at memory bandwidth B its bus
bandwidth cannot beat B/(N+1)·2(N-1)/N. Sizes whose inputs still sit in the last-level
cache can pass the line. matplotlib is an optional extra (`pip install 'crossdevice[plot]'`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

__all__ = ["plot_rows", "require_matplotlib"]

#: One marker per implementation, so the lines stay apart in grey-scale prints too.
_MARKERS: Final = ("o", "s", "^", "D", "v", "P", "X", "*")


def require_matplotlib() -> None:
    """Raise ImportError, with the command that fixes it, unless matplotlib is installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "crossdevice bench --plot needs matplotlib, which is an optional extra: "
            "pip install 'crossdevice[plot]' (or pip install matplotlib)"
        ) from None


def _size_label(nbytes: float) -> str:
    for suffix, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{int(nbytes // scale)}{suffix}"
    return f"{int(nbytes)}"


def plot_rows(
    rows: Sequence[dict[str, Any]],
    path: str,
    *,
    replicas: int,
    datatype: str,
    redop: str,
    bandwidth_gbps: float,
    note: str = "",
) -> None:
    """Draw the benchmark's rows (as `bench --json` writes them) to an image file.

    Args:
        rows: dicts with `size`, `impl`, `busbw_GBps` and `limit_us`.
        path: the image to write; the suffix picks the format (`.png`, `.svg`, `.pdf`).
        replicas: the number of replicas N.
        datatype: the element type, for the title.
        redop: the reduce op, for the title.
        bandwidth_gbps: the measured memory bandwidth B (GB/s), for the limit's label.
        note: a line under the title (the host sum kernel, say).
    """
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    fig = Figure(figsize=(8.0, 5.0), dpi=150, layout="constrained")
    ax = fig.add_subplot()
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    for i, impl in enumerate(impls):
        mine = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["size"])
        ax.plot(
            [r["size"] for r in mine],
            [r["busbw_GBps"] for r in mine],
            marker=_MARKERS[i % len(_MARKERS)],
            markersize=4,
            linewidth=1.5,
            label=impl,
        )
    sizes = sorted({r["size"] for r in rows})
    # The limit in busbw terms: S / ((N+1)·S/B) · 2(N-1)/N, the same for every size.
    factor = 2 * (replicas - 1) / replicas if replicas > 1 else 1.0
    limits = sorted({r["size"] / (r["limit_us"] * 1e3) * factor for r in rows})
    limit = limits[len(limits) // 2]
    ax.axhline(
        limit,
        color="black",
        linestyle="--",
        linewidth=1.2,
        label=f"memory-bandwidth limit: (N+1)·S bytes at B = {bandwidth_gbps:.1f} GB/s",
    )
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(sizes, [_size_label(s) for s in sizes], rotation=45 if len(sizes) > 10 else 0)
    ax.set_xlim(sizes[0] / 1.3, sizes[-1] * 1.3)
    top = max([limit, *(r["busbw_GBps"] for r in rows)])
    ax.set_ylim(0, top * 1.12)  # headroom, so the top points and the limit stay visible
    ax.set_xlabel("message size per replica (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)\nbusbw = size / time · 2(N-1)/N")
    ax.grid(True, which="major", alpha=0.3)
    # Below the axes: inside, any corner can hide a point or the limit line.
    fig.legend(loc="outside lower center", ncols=2, fontsize="small", frameon=False)
    title = f"crossdevice all-reduce: {datatype} {redop}, {replicas} replicas"
    ax.set_title(title if not note else f"{title}\n{note}", fontsize="medium")
    fig.savefig(path)
