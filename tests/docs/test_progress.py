"""Progress bars only on a terminal: redirected output gets no bar redraws."""

from __future__ import annotations

import builtins
import io

from tqdm import tqdm

from crossdevice._cli.progress import progress_reporting


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bars_when_redirected() -> None:
    progress, report = progress_reporting(stream=io.StringIO())
    assert progress is None
    assert report is builtins.print


def test_bars_on_a_terminal() -> None:
    progress, report = progress_reporting(stream=_Terminal())
    assert progress is tqdm
    assert report == tqdm.write


def test_disabled_even_on_a_terminal() -> None:
    assert progress_reporting(enabled=False, stream=_Terminal())[0] is None
