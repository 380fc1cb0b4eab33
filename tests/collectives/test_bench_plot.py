"""`crossdevice bench --plot`: a picture of bandwidth against size, matplotlib optional."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from crossdevice._cli import bench
from tests.collectives.test_bench_cli import FAST, parse


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.png"
    args = parse([*FAST, "-b", "1K", "-e", "16K", "-n", "2", "-w", "1", "--plot", str(out)])
    assert bench.run(args) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000
    assert f"# plot: {out}" in capsys.readouterr().out


def test_missing_matplotlib_says_what_to_install_before_benchmarking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    args = parse([*FAST, "-b", "1K", "-e", "1K", "--plot", str(tmp_path / "x.png")])
    with pytest.raises(ImportError, match=r"pip install 'crossdevice\[plot\]'"):
        bench.run(args)
    assert capsys.readouterr().out == ""  # nothing was measured first


def test_plot_is_for_single_process_runs(tmp_path: Path) -> None:
    args = parse(["--multi-worker", "--plot", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match="single-process"):
        bench.run(args)
