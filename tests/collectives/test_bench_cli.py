"""`crossdevice bench` and the memory-bandwidth probe, on tiny sizes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from crossdevice._cli import bench
from crossdevice._cli.bench.bandwidth import all_reduce_limit_seconds, measure_memory_bandwidth

#: A 1 MiB bandwidth probe keeps these tests fast (the default copies 256 MiB).
FAST = ["--bw-bytes", "1M", "--replicas", "2"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="crossdevice")
    bench.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_parse_size_and_size_ladder() -> None:
    assert bench.parse_size("8") == 8
    assert bench.parse_size("1K") == 1024
    assert bench.parse_size("64M") == 64 * 2**20
    assert bench.parse_size("1g") == 2**30
    with pytest.raises(argparse.ArgumentTypeError, match="byte count"):
        bench.parse_size("lots")
    assert bench.sizes_between(1024, 16384, 4, 0) == [1024, 4096, 16384]
    assert bench.sizes_between(100, 300, 1, 100) == [100, 200, 300]
    with pytest.raises(ValueError, match="minbytes"):
        bench.sizes_between(10, 5, 2, 1)


def test_defaults_follow_nccl_tests_meanings() -> None:
    args = parse([])
    assert args.func is bench.run
    assert (args.minbytes, args.maxbytes, args.stepfactor) == (1024, 64 * 2**20, 4)
    assert (args.iters, args.warmup_iters, args.op, args.datatype) == (20, 5, "sum", "float")
    assert args.replicas == 4


def test_bench_runs_every_implementation_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    ops = ",".join(bench.IMPLEMENTATIONS)
    args = parse(
        [
            *FAST,
            *["-b", "64", "-e", "4K", "-f", "8", "-n", "3", "-w", "1", "--replicas", "3"],
            "--ops",
            ops,
            "--json",
            str(out),
        ]
    )
    assert bench.run(args) == 0
    text = capsys.readouterr().out
    assert "# versions: python" in text
    assert "# host sum kernel: " in text
    assert "numpy" in text
    assert "memory bandwidth" in text
    assert "#wrong" in text
    assert "Avg bus bandwidth" in text
    report = json.loads(out.read_text())
    assert report["bandwidth"]["best_GBps"] > 0
    assert report["meta"]["replicas"] == 3  # the last --replicas wins
    rows = report["rows"]
    assert {r["impl"] for r in rows} == set(bench.IMPLEMENTATIONS)
    assert {r["size"] for r in rows} == {64, 512, 4096}
    assert all(r["wrong"] == 0 for r in rows)
    sharded = [r for r in rows if r["impl"] == "sharded"]
    assert all(r["inexact"] == 0 for r in sharded)  # in-order adds: bitwise reproducible
    assert all(r["time_us"] > 0 and r["fraction_of_limit"] > 0 for r in rows)
    assert set(report["summary"]["largest_fraction_of_limit"]) == set(bench.IMPLEMENTATIONS)


@pytest.mark.parametrize(("dtype", "op"), [("half", "avg"), ("int32", "sum"), ("bfloat16", "sum")])
def test_bench_dtypes_and_ops(
    dtype: str, op: str, torch_module: object, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse(
        [*FAST, *f"-b 256 -e 256 -n 2 -w 0 -d {dtype} -o {op} --ops sharded,sum_n".split()]
    )
    assert bench.run(args) == 0
    assert f"{dtype:>8} {op:>6}" in capsys.readouterr().out


def test_unknown_ops_exit_with_the_choices() -> None:
    with pytest.raises(SystemExit, match="sharded"):
        bench.run(parse(["--ops", "warp_speed", "--bw-bytes", "1M"]))


def test_memory_bandwidth_probe_and_limit() -> None:
    bw = measure_memory_bandwidth(2 * 2**20, repeats=2, threads=2)
    assert bw.single_thread > 0
    assert bw.all_cores > 0
    assert bw.best == max(bw.single_thread, bw.all_cores)
    assert bw.as_dict()["threads"] == 2
    assert all_reduce_limit_seconds(4, 1000, 5000.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        all_reduce_limit_seconds(4, 1000, 0.0)
