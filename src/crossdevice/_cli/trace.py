"""`crossdevice trace merge|render`: one timeline from the workers' traces; a PNG of a trace."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["add_trace_argument", "register", "run", "tracing"]


def add_trace_argument(parser: argparse.ArgumentParser) -> None:
    """`--trace FILE` for a command that runs steps (`demo`, `bench`)."""
    parser.add_argument(
        "--trace",
        metavar="FILE.json",
        default=None,
        help=(
            "record a timeline (Chrome/Perfetto trace JSON; one file per worker, "
            "FILE.worker<rank>.json) and log stragglers; see `crossdevice trace`"
        ),
    )


@contextlib.contextmanager
def tracing(path: str | None, quiet: bool = False) -> Iterator[None]:
    """Inside: `crossdevice.experimental.trace(path)` when `path` is given; says where it went."""
    if not path:
        yield
        return
    from crossdevice._trace.session import trace

    with trace(path) as session:
        yield
    if not quiet:
        for written in session.written:
            print(f"trace written to {written} (open it in https://ui.perfetto.dev)")


def register(subparsers: Any) -> None:
    """Add the `trace` subcommand (`merge`, `render`)."""
    parser = subparsers.add_parser(
        "trace",
        help="merge the workers' trace files; render a trace as a PNG",
        description=(
            "Work with the traces crossdevice.experimental.trace (or CROSSDEVICE_TRACE) "
            "writes: `merge` puts the workers' files on one timeline, aligned at their "
            "first common collective; `render` draws the last steps as a PNG."
        ),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    merge = actions.add_parser("merge", help="merge one trace file per worker into one")
    merge.add_argument("out", help="the merged trace to write")
    merge.add_argument("inputs", nargs="+", help="the workers' trace files")
    render = actions.add_parser("render", help="draw a trace's last steps as a PNG timeline")
    render.add_argument("trace", help="a trace file (one worker's or merged)")
    render.add_argument("png", help="the image to write")
    render.add_argument("--steps", type=int, default=4, help="how many last steps (default 4)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Merge or render; 0 on success, 1 (with the reason on stderr) on a bad input."""
    try:
        if args.action == "merge":
            from crossdevice._trace.merge import merge

            done = merge(args.inputs, args.out)
            where = (
                f"aligned at collective #{done['aligned_at']}"
                if done["aligned_at"] is not None
                else "no collective in common: clocks left unaligned"
            )
            print(
                f"wrote {args.out}: {done['events']} events from {len(args.inputs)} files, {where}"
            )
        else:
            from crossdevice._trace.render import render

            spans = render(args.trace, args.png, steps=args.steps)
            print(f"wrote {args.png}: {spans} spans")
    except (ValueError, OSError) as err:
        print(f"crossdevice trace {args.action}: {err}", file=sys.stderr)
        return 1
    return 0
