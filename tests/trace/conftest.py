"""Each tracing test may write flight-recorder reports, whatever the tests before it wrote."""

from __future__ import annotations

import itertools

import pytest

from crossdevice._trace import flight


@pytest.fixture(autouse=True)
def _fresh_report_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process writes at most `flight.MAX_REPORTS`: the suite's other errors count too."""
    monkeypatch.setattr(flight, "_written", itertools.count(1))
