"""`crossdevice bench --cuda` on a machine without CUDA: the message, and the pure helpers."""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import pytest

from crossdevice._cli import bench
from crossdevice._cli.bench import cuda as bench_cuda
from crossdevice._cli.bench.common import RAW_IN_PLACE, RAW_OUT_OF_PLACE, TORCH_DIST, Measurement
from crossdevice._cli.bench.cuda import (
    bus_bandwidth,
    format_table,
    interleaved_medians,
    table_rows,
)
from crossdevice._cli.main import main

MiB = 1 << 20


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="crossdevice")
    bench.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_without_cuda_it_exits_2_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--cuda", "--cuda-sizes", "1K"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "crossdevice bench --cuda: no CUDA device to benchmark" in captured.err
    assert "torch.cuda.is_available() is False" in captured.err
    assert "run `crossdevice bench`" in captured.err


def test_cuda_options_and_defaults() -> None:
    args = parse([])
    assert args.cuda is False
    assert args.cuda_sizes == [MiB, 16 * MiB, 64 * MiB, 256 * MiB]
    assert (args.gpus, args.repeats) == ("all", 5)
    args = parse(["--cuda", "--cuda-sizes", "4K,2M", "--gpus", "0,1", "--repeats", "3"])
    assert args.cuda is True
    assert args.cuda_sizes == [4096, 2 * MiB]
    assert (args.gpus, args.repeats) == ("0,1", 3)


def test_bus_bandwidth_is_nccl_tests_all_reduce_factor() -> None:
    assert bus_bandwidth(100.0, 1) == 0.0
    assert bus_bandwidth(100.0, 2) == 100.0
    assert bus_bandwidth(100.0, 4) == 150.0
    assert bus_bandwidth(80.0, 8) == 140.0


def fake_measurements() -> list[Measurement]:
    size = 64 * MiB
    return [
        Measurement(RAW_IN_PLACE, "sum", size, 400e-6),
        Measurement(RAW_OUT_OF_PLACE, "sum", size, 420e-6),
        Measurement("crossdevice NcclAllReduce", "sum", size, 440e-6),
        Measurement(TORCH_DIST, "sum", size, None, "torch.distributed runs one process per GPU"),
        Measurement("crossdevice ReductionToOneDevice", "mean", size, 2e-3),  # no baseline
    ]


def test_rows_have_nccl_tests_columns_and_the_ratio() -> None:
    rows = table_rows(fake_measurements(), n=4)
    first, _, ours, dist, mean = rows
    assert first["count"] == 16 * MiB
    assert (first["type"], first["redop"], first["gpus"]) == ("float", "sum", 4)
    assert first["time_us"] == pytest.approx(400.0)
    assert first["algbw"] == pytest.approx(64 * MiB / 400e-6 / 1e9)
    assert first["busbw"] == pytest.approx(first["algbw"] * 1.5)
    assert first["vs_nccl"] == pytest.approx(1.0)
    assert ours["vs_nccl"] == pytest.approx(1.1)
    assert dist["time_us"] is None
    assert dist["vs_nccl"] is None
    assert dist["note"] == "torch.distributed runs one process per GPU"
    assert mean["time_us"] == pytest.approx(2000.0)
    assert mean["vs_nccl"] is None  # no raw NCCL MEAN measured at that size


def test_table_text() -> None:
    lines = format_table(table_rows(fake_measurements(), n=4))
    header = lines[0].split()
    for column in ["size", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)"]:
        assert column in header
    assert len(lines) == 6
    ours = lines[3]
    assert ours.split()[:4] == [str(64 * MiB), str(16 * MiB), "float", "sum"]
    assert "crossdevice NcclAllReduce" in ours
    assert ours.rstrip().endswith("1.10")
    assert "440.0" in ours
    assert "n/a" in lines[4]
    assert lines[4].endswith("# torch.distributed runs one process per GPU")


def test_interleaved_medians_rotate_and_take_medians() -> None:
    calls: list[str] = []
    syncs: list[int] = []
    ticks = itertools.count()

    def clock() -> float:
        return float(next(ticks))

    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = interleaved_medians(
        fns, lambda: syncs.append(1), warmup=1, iters=2, repeats=3, clock=clock
    )
    warm, timed = calls[:3], calls[3:]
    assert warm == ["a", "b", "c"]
    rounds = [timed[k : k + 6 : 2] for k in range(0, 18, 6)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    # The fake clock advances by one per reading: every timing reads 1 tick over 2 calls.
    assert times == {"a": 0.5, "b": 0.5, "c": 0.5}
    assert len(syncs) == 1 + 2 * 9


def test_run_cuda_never_imports_the_cuda_cases_without_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert bench_cuda.run_cuda(parse(["--cuda"])) == bench_cuda.NO_CUDA_EXIT
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(("cards", "logical"), [(2, None), (1, 3)], ids=["2-gpus", "3-on-1"])
def test_bench_cuda_end_to_end_on_fake_cuda(
    cards: int, logical: int | None, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    pytest.importorskip("torch")
    from crossdevice._core import devices
    from tests.fake_cuda import fake_cuda

    out = tmp_path / "bench.json"
    argv = ["bench", "--cuda", "--cuda-sizes", "4K", "-n", "1", "-w", "1", "--repeats", "2"]
    with fake_cuda(cards) as state:
        devices.set_logical_gpu_devices(logical)
        try:
            assert main([*argv, "--json", str(out)]) == 0  # 1 would mean a wrong result
        finally:
            devices.set_logical_gpu_devices(None)
    text = capsys.readouterr().out
    assert "WRONG" not in text
    rows = json.loads(out.read_text())["rows"]
    measured = {(r["impl"], r["redop"]) for r in rows if r["time_us"] is not None}
    for impl in ("NcclAllReduce", "HierarchicalCopyAllReduce", "ReductionToOneDevice"):
        for op in ("sum", "mean"):
            assert (f"crossdevice {impl}", op) in measured
    if logical is None:
        assert (RAW_IN_PLACE, "mean") in measured
        assert (RAW_OUT_OF_PLACE, "sum") in measured
        assert state.counts["nccl_all_reduce"] > 0
        assert (
            "not compared: torch.distributed nccl (world 1) (torch.distributed NCCL runs one"
            in text
        )
    else:
        assert "# not compared: torch.cuda.nccl (logical GPUs share a card" in text
        assert all(r["vs_nccl"] is None for r in rows)
