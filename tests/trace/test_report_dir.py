"""The flight recorder's directory stays bounded across processes, and only its files go."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from crossdevice._trace import flight


def _old_report(directory: Path, stem: str, age: float) -> None:
    """A report pair written `age` seconds ago (as another process would have left it)."""
    for suffix in (".json", ".txt"):
        path = directory / (stem + suffix)
        path.write_text("{}")
        when = path.stat().st_mtime - age
        os.utime(path, (when, when))


def _written(note: str) -> str:
    """The stem of the report a `flight.report` note names."""
    found = re.search(r"report: (\S+)\.txt", note)
    assert found, note
    return Path(found.group(1)).name


def test_writing_a_report_deletes_the_oldest_beyond_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(flight.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(flight, "KEPT_REPORTS", 3)
    for i in range(5):  # other processes' reports, flight-old-0 the oldest
        _old_report(tmp_path, f"flight-old-{i}", age=100.0 - i)
    (tmp_path / "notes.txt").write_text("the user's")  # not ours: never touched
    (tmp_path / "flight-plan.md").write_text("the user's too")

    stem = _written(flight.report("RuntimeError", "boom"))

    names = sorted(p.name for p in tmp_path.iterdir())
    kept = sorted({n.rpartition(".")[0] for n in names if n.endswith((".json", ".txt"))})
    assert kept == sorted(["flight-old-3", "flight-old-4", stem, "notes"])
    assert (tmp_path / f"{stem}.json").exists()
    assert (tmp_path / f"{stem}.txt").exists()
    assert "flight-plan.md" in names


def test_the_new_report_stays_even_when_the_clock_says_it_is_oldest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(flight.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(flight, "KEPT_REPORTS", 2)
    for i in range(3):  # stamped in the future (another host's clock, a shared folder)
        _old_report(tmp_path, f"flight-ahead-{i}", age=-1000.0 - i)

    stem = _written(flight.report("RuntimeError", "boom"))

    stems = {p.name.rpartition(".")[0] for p in tmp_path.iterdir()}
    assert stems == {stem, "flight-ahead-2"}


def test_below_the_bound_nothing_is_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(flight.ENV_DIR, str(tmp_path))
    for i in range(5):
        _old_report(tmp_path, f"flight-old-{i}", age=100.0)

    flight.report("RuntimeError", "boom")

    assert len(list(tmp_path.iterdir())) == 12
