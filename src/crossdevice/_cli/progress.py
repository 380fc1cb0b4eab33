"""Progress bars for the command line, drawn only when a person is watching.

tqdm redraws its bar on every update; on a terminal that is one line, but redirected to a
file or a CI log every redraw is another line (the demo wrote hundreds). So commands ask
`progress_reporting()` for a bar factory and a line printer: tqdm's when stderr is a
terminal, else no bars and plain `print`.
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable
from typing import IO, Any

__all__ = ["progress_reporting"]


def progress_reporting(
    enabled: bool = True, stream: IO[str] | None = None
) -> tuple[Callable[..., Any] | None, Callable[[str], None]]:
    """A progress-bar factory (or None) and a function that prints a line above the bars.

    Args:
        enabled: False to turn bars off whatever the stream (`--no-progress`).
        stream: where bars would be drawn; `sys.stderr` (tqdm's default) when None.

    Returns:
        `(progress, report)`: `progress` is `tqdm.tqdm` when `enabled` and `stream` is a
        terminal, else None; `report` is `tqdm.write` with bars (it prints above them
        instead of through them), else `print`.
    """
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if not enabled or isatty is None or not isatty():
        return None, builtins.print
    from tqdm import tqdm

    return tqdm, tqdm.write
