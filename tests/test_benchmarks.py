"""The benchmark scripts import, parse their options, and fail with a usable message.

Their numbers are measured by hand (machines here are shared and noisy, see README); this
only keeps the scripts from rotting between measurement sessions.
"""

from __future__ import annotations

import itertools
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from benchmarks import _common, _launch, _workloads

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("[a-z]*.py"))


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
    )


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s != "tf_reference"])
def test_every_benchmark_shows_its_help(script: str) -> None:
    done = _run("-m", f"benchmarks.{script}", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_the_tf_scripts_share_the_workloads_without_importing_crossdevice() -> None:
    assert {"tf_reference", "tf_side_by_side"} <= set(SCRIPTS)
    assert _common.batch_sizes is _workloads.batch_sizes
    sizes = _workloads.batch_sizes()
    assert len(sizes) == 160
    assert min(sizes) == 64
    assert max(sizes) == 600_000
    for name in ("_workloads.py", "tf_reference.py"):
        text = (ROOT / "benchmarks" / name).read_text()
        assert "import crossdevice" not in text
        assert "benchmarks._common" not in text.replace("`benchmarks._common", "")


@pytest.mark.slow
def test_side_by_side_says_what_to_do_when_tensorflow_is_missing(tmp_path: Path) -> None:
    # A `tensorflow` that fails to import, whatever this machine has installed.
    (tmp_path / "tensorflow.py").write_text("raise ImportError('no TensorFlow here')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    command = ["-m", "benchmarks.tf_side_by_side", "--tf-python", sys.executable]
    done = _run(*command, "--sizes", "1", "--rounds", "5", env=env)
    assert done.returncode != 0
    assert "no TensorFlow here" in done.stderr
    assert "check that --tf-python can `import tensorflow`" in done.stderr
    done = _run("-m", "benchmarks.tf_side_by_side")
    assert done.returncode == 2
    assert "--tf-python is required" in done.stderr


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_take_turns_puts_each_right_after_each_other_equally_often(n: int) -> None:
    # The call just before a timed one moves its time: a rotation (A B C, B C A, ...)
    # puts B right after A in 2 rounds of 3 and never A right after B.
    order: list[str] = []
    names = [chr(ord("A") + k) for k in range(n)]
    calls = {name: (lambda name=name: order.append(name)) for name in names}
    orders = _launch.balanced_orders(n)
    rounds = 3 * len(orders)
    times = _launch.take_turns(calls, rounds, 0, lambda: None)
    assert all(len(times[name]) == rounds for name in names)
    assert len(order) == n * rounds
    follows: dict[tuple[str, str], int] = {}
    for r in range(rounds):
        one = order[r * n : (r + 1) * n]
        assert sorted(one) == names  # every implementation once a round
        for a, b in itertools.pairwise(one):
            follows[a, b] = follows.get((a, b), 0) + 1
    expected = {(a, b) for a in names for b in names if a != b}
    assert set(follows) == expected
    assert len(set(follows.values())) <= 1  # the same count for every ordered pair


@pytest.mark.slow
def test_user_path_times_a_tuning_against_the_launchs_own_in_the_same_processes() -> None:
    # Two workers on this host; `tuned` runs the gloo strategy under other thresholds (the
    # exchange in pieces), its results checked like the others', before and after timing.
    command = ["-m", "benchmarks.user_path_allreduce", "--sizes", "64K", "1M"]
    done = _run(*command, "--rounds", "2", "--warmup", "0", "--against", "ring_piece_bytes=256K")
    assert done.returncode == 0, done.stderr[-3000:]
    tuned = [line for line in done.stdout.splitlines() if " tuned " in line]
    assert len(tuned) == 2, done.stdout
    assert all("x gloo (ring_piece_bytes=256K)" in line for line in tuned)
    assert "# target gloo 1 MiB <= raw + 0.3 ms" in done.stdout


def _tuning_check(log: Path, against: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "TUNING_CHECK_SIZES": "64K",
        "TUNING_CHECK_ROUNDS": "2",
        "TUNING_CHECK_AGAINST": against,
        "TUNING_CHECK_EPOCH": "0",
        "TUNING_CHECK_MLP": "0",
    }
    script = str(ROOT / "scripts" / "tuning_check.sh")
    return subprocess.run(
        ["bash", script, str(log)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )


@pytest.mark.slow
def test_the_tuning_check_times_each_candidate_against_the_defaults(tmp_path: Path) -> None:
    done = _tuning_check(tmp_path / "t.log", "ring_piece_bytes=256K direct_max_bytes=32K")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith(f"crossdevice tuning check: log {tmp_path / 't.log'}\n")
    for candidate in ("ring_piece_bytes=256K", "direct_max_bytes=32K"):
        assert f"x gloo ({candidate})" in done.stdout, done.stdout
    assert done.stdout.endswith("crossdevice tuning check: done\n")
    assert "x gloo (direct_max_bytes=32K)" in (tmp_path / "t.log").read_text()


@pytest.mark.slow
def test_the_tuning_check_fails_when_a_run_fails(tmp_path: Path) -> None:
    done = _tuning_check(tmp_path / "t.log", "no_such_threshold=1")
    assert done.returncode == 1, done.stdout
    assert "FAILED: user path with no_such_threshold=1" in done.stdout
    assert "no such tuning threshold" in (tmp_path / "t.log").read_text()


@pytest.mark.slow
def test_the_epoch_with_several_buckets_trains_ddps_model() -> None:
    # Two workers on this host, a few steps of 256 examples each: the model whose gradients
    # go in several buckets (`split`) ends where DDP's does, as the one-bucket model does.
    command = ["-m", "benchmarks.multi_worker_epoch", "--per-worker", "256", "--rounds", "1"]
    done = _run(*command, "--warmup", "0", "--variants", "gloo", "ddp", "--bucket-cap", "64K")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "split/ddp " in done.stdout, done.stdout
    assert "split/gloo " in done.stdout, done.stdout
    assert "split/ddp_split " in done.stdout, done.stdout
    # Each variant's CPU per epoch on rank 0, by thread: the caller's and Gloo's at least.
    assert "  CPU per epoch (rank 0's process, median ms, by thread):\n" in done.stdout
    for name in ("gloo", "ddp", "split", "ddp_split"):
        cpu, switches = [x for x in done.stdout.splitlines() if x.startswith(f"    {name} ")]
        threads = cpu.split(" = ", 1)[1]
        assert "main " in threads, cpu
        assert "gloo_tcp_loop " in threads, cpu
        # ...and how often a step's caller blocked. How often is the machine's business (a
        # loaded host finishes DDP's buckets before the wait): the counts are only read.
        assert switches.endswith(" preemptions"), switches
        assert " waits + " in switches, switches
        waits, preemptions = float(switches.split()[1]), float(switches.split()[4])
        assert waits >= 0, switches
        assert preemptions >= 0, switches
    assert "  the caller's thread left its CPU, per step (rank 0, median):\n" in done.stdout
    for name in ("gloo", "split"):
        assert (
            f"# parameters, {name} vs ddp (the same batches throughout): max |difference| 0\n"
            in (done.stdout)
        ), done.stdout


@pytest.mark.slow
def test_the_mlp_with_large_gradients_trains_ddps_model_at_every_bucket_cap() -> None:
    command = ["-m", "benchmarks.multi_worker_mlp", "--width", "256", "--layers", "2"]
    done = _run(*command, "--steps", "2", "--rounds", "1", "--bucket-cap", "64K", "1G")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("bucket cap ")]
    assert [line.split(" B:")[0] for line in lines] == ["bucket cap 65536", "bucket cap 1073741824"]
    assert all(line.endswith("parameters max |difference| 0") for line in lines), done.stdout
    cpu = [x for x in done.stdout.splitlines() if x.startswith(("    gloo ", "    ddp "))]
    assert len(cpu) == 4, done.stdout
    assert all("main " in x.split(" = ", 1)[1] for x in cpu), done.stdout
    assert all(x.endswith(" preemptions a step") for x in cpu), done.stdout


def test_thread_cpu_names_each_thread_and_counts_its_own_time() -> None:
    # A thread that burns CPU shows under its name (a rank suffix dropped, so that ranks
    # compare), the caller as `main`; a sleeping thread costs next to nothing.
    from benchmarks import _usage

    stop, burnt = threading.Event(), threading.Event()

    def burn() -> None:
        end = time.thread_time() + 0.15
        while time.thread_time() < end:
            pass
        burnt.set()
        stop.wait()

    busy = threading.Thread(target=burn, name="bench-busy-r3")
    idle = threading.Thread(target=stop.wait, name="bench-idle-r3")
    usage: list[_usage.Usage] = []
    try:
        _usage.measured(lambda: (busy.start(), idle.start(), burnt.wait(10)), usage)()
    finally:
        stop.set()
        busy.join()
        idle.join()
    (one,) = usage
    assert one.threads, "no per-thread times: /proc/self/task/*/schedstat is missing"
    assert one.threads["bench-busy"] >= 0.12e9, one.threads
    assert one.threads.get("bench-idle", 0) < 0.02e9, one.threads
    assert "main" in one.threads
    assert "bench-busy-r3" not in one.threads
    assert one.cpu_ns >= one.threads["bench-busy"]
    medians = _usage.median_threads(usage)
    assert next(iter(medians)) == "bench-busy"  # largest first
    line = _usage.threads_line(usage)
    assert line.startswith(f"{one.cpu_ns / 1e6:.1f} = bench-busy "), line


def test_measured_counts_the_times_the_caller_blocked() -> None:
    # Each sleep gives the CPU up (a voluntary switch: a wait); spinning blocks nowhere.
    from benchmarks import _usage

    usage: list[_usage.Usage] = []
    _usage.measured(lambda: [time.sleep(0.002) for _ in range(20)], usage)()

    def spin() -> None:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass

    _usage.measured(spin, usage)()
    slept, spun = usage
    assert slept.waits >= 20, slept
    assert spun.waits < 5, spun
    assert min(slept.preempted, spun.preempted) >= 0, usage
    line = _usage.switches_line([slept], per=4)
    assert line == f"{slept.waits / 4:.2f} waits + {slept.preempted / 4:.2f} preemptions", line


def test_measured_counts_the_page_faults_of_fresh_memory() -> None:
    from benchmarks import _usage

    usage: list[_usage.Usage] = []
    pages = 2048

    def touch() -> None:
        buffer = mmap.mmap(-1, pages * mmap.PAGESIZE)
        for k in range(pages):
            buffer[k * mmap.PAGESIZE] = 1
        buffer.close()

    _usage.measured(touch, usage)()
    assert usage[0].faults >= pages // 2, usage
