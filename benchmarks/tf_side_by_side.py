"""Large all-reduces, crossdevice against TensorFlow, calls interleaved between processes.

On a shared machine the memory bandwidth moves by ±30% from one minute to the next, so
timing one library and then the other compares the minutes as much as the libraries.
Here one TensorFlow worker and two crossdevice workers (the strategy path and
`ReductionToOneDevice().reduce`) are alive at once and take turns: round after round, each
makes one call, in an order that changes every round so that each comes right after each
other equally often (`_launch.balanced_orders`: under a rotation the call just before a
timed one moves its time), with a pause before each call so that nobody's threads are
still spinning when the next one starts. Every round gives a
ratio (ours / TF's) taken within the same few tens of milliseconds; the medians of those
ratios are the comparison.

TensorFlow runs in its own interpreter (`--tf-python`, e.g. a scratch virtualenv with
`pip install tensorflow-cpu`): it is never a crossdevice dependency. Its side is the
issue's: 4 logical CPU devices, `MirroredStrategy` with `ReductionToOneDevice`, and
`ReductionToOneDevice().reduce(SUM, value, destinations=value)` of a per-replica float32
value.

    python -m benchmarks.tf_side_by_side --tf-python ~/tfvenv/bin/python --json tf.json
"""

from __future__ import annotations

# Only the standard library at module level: the TensorFlow worker runs this file with
# TensorFlow's interpreter, where crossdevice is not installed.
import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPLICAS = 4
_ROOT = Path(__file__).resolve().parent.parent
_WORKERS = ("crossdevice-run", "crossdevice-reduce", "tf")


def _tf_call(mib: int) -> Callable[[], Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf  # type: ignore[import-not-found]

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS
    )
    ops = tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy(
        [f"/cpu:{i}" for i in range(REPLICAS)], cross_device_ops=ops
    )
    n = mib * 2**20 // 4
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.random.stateless_uniform([n], seed=[mib, ctx.replica_id_in_sync_group])
    )
    return lambda: ops.reduce(tf.distribute.ReduceOp.SUM, value, destinations=value)


def _crossdevice_call(mib: int, path: str) -> Callable[[], Any]:
    import numpy as np

    import crossdevice
    from crossdevice._values.values import PerReplica

    crossdevice.config.set_logical_cpu_devices(REPLICAS)
    devices = [f"CPU:{i}" for i in range(REPLICAS)]
    rng = np.random.default_rng(mib)
    data = [rng.random(mib * 2**20 // 4, dtype=np.float32) for _ in range(REPLICAS)]
    if path == "reduce":
        ops = crossdevice.ReductionToOneDevice()
        value = PerReplica(data, devices)
        return lambda: ops.reduce("sum", value, destinations=value)
    strategy = crossdevice.MirroredStrategy(devices)

    def step() -> Any:
        ctx = crossdevice.get_replica_context()
        return ctx.all_reduce("sum", data[ctx.replica_id_in_sync_group])

    return lambda: strategy.run(step)


def _serve(worker: str, mib: int) -> None:
    """Worker side: set up, warm up, then time one call per line read from stdin."""
    if worker == "tf":
        call = _tf_call(mib)
    else:
        call = _crossdevice_call(mib, worker.removeprefix("crossdevice-"))
    for _ in range(3):
        call()
    print("ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - start
        del result  # a live result would keep its output buffer out of the pool
        print(seconds, flush=True)


class _Worker:
    """One worker process; every read of its output has a deadline."""

    #: Seconds allowed to start (TensorFlow's import is slow) and per timed call.
    START_SECONDS = 600.0
    CALL_SECONDS = 120.0

    def __init__(self, name: str, python: str, mib: int) -> None:
        self.name = name
        command = [python, str(Path(__file__).resolve()), "--worker", name, "--mib", str(mib)]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
        if name != "tf":
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p
            )
        # TensorFlow's log goes to a file, not a pipe nobody drains while it runs
        # (closed in close()).
        self._log = tempfile.TemporaryFile() if name == "tf" else None  # noqa: SIM115
        self._buffer = b""
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env
        )

    def ready(self) -> None:
        line = self._line(self.START_SECONDS)
        if line != "ready":
            raise RuntimeError(f"the {self.name} worker sent {line!r}, expected 'ready'")

    def _line(self, timeout: float) -> str:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            readable = select.select([fd], [], [], max(left, 0.0))[0] if left > 0 else []
            if not readable:
                self.process.kill()
                raise RuntimeError(
                    f"the {self.name} worker sent no line in {timeout:.0f} s; expected "
                    "'ready' or a timing. It was killed: rerun on a quieter machine, or "
                    "with a smaller --sizes."
                )
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(
                    f"the {self.name} worker exited (code {self.process.wait()}) instead of "
                    f"answering; expected a line. Its stderr ends with:\n{self._log_tail()}\n"
                    "For the TensorFlow worker, check that --tf-python can `import tensorflow`."
                )
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode().strip()

    def _log_tail(self) -> str:
        if self._log is None:
            return "(printed above)"
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-3000:]

    def call(self) -> float:
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")
        self.process.stdin.flush()
        return float(self._line(self.CALL_SECONDS))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        if self._log is not None:
            self._log.close()


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(xs, n=4)
    return q1, q2, q3


def compare(tf_python: str, mib: int, rounds: int, gap: float) -> dict[str, Any]:
    """Interleave the three workers for `rounds` rounds; per-round ratios to TF."""
    # Here, not at the top: the TensorFlow worker runs this file in its own interpreter.
    from benchmarks._launch import balanced_orders

    pythons = {"crossdevice-run": sys.executable, "crossdevice-reduce": sys.executable}
    workers = [_Worker(name, pythons.get(name, tf_python), mib) for name in _WORKERS]
    times: dict[str, list[float]] = {w.name: [] for w in workers}
    try:
        for w in workers:
            w.ready()
        orders = balanced_orders(len(workers))
        for r in range(rounds):
            for w in (workers[k] for k in orders[r % len(orders)]):
                time.sleep(gap)
                times[w.name].append(w.call())
    finally:
        for w in workers:
            w.close()
    out: dict[str, Any] = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    out = {f"{name}_ms": ms for name, ms in out.items()}
    for name in _WORKERS[:2]:
        ratios = [a / b for a, b in zip(times[name], times["tf"], strict=True)]
        q1, q2, q3 = _quartiles(ratios)
        out[f"{name}_over_tf"] = {
            "median": q2,
            "quartiles": [q1, q3],
            "faster_rounds": sum(x < 1 for x in ratios),
            "rounds": rounds,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tf-python", help="an interpreter that can `import tensorflow`")
    p.add_argument("--sizes", default="64,16", help="MiB per replica, comma-separated")
    p.add_argument("--rounds", type=int, default=60, help="rounds per size (60)")
    p.add_argument("--gap-ms", type=float, default=30.0, help="pause before each call (30)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--worker", choices=_WORKERS, help=argparse.SUPPRESS)
    p.add_argument("--mib", type=int, default=64, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _serve(args.worker, args.mib)
        return
    if not args.tf_python:
        p.error("--tf-python is required: an interpreter with tensorflow-cpu installed")
    if args.rounds < 5:
        p.error(f"--rounds must be at least 5 (medians of 5 or more), received {args.rounds}")
    results: dict[str, Any] = {"rounds": args.rounds, "gap_ms": args.gap_ms}
    for mib in (int(s) for s in args.sizes.split(",")):
        res = compare(args.tf_python, mib, args.rounds, args.gap_ms / 1e3)
        results[f"{REPLICAS}x{mib}MiB"] = res
        print(f"all-reduce {REPLICAS} x {mib} MiB float32, {args.rounds} interleaved rounds:")
        print(f"  {'TF ReductionToOneDevice.reduce':>40}: median {res['tf_ms']:7.2f} ms")
        for name, label in (
            ("crossdevice-run", "crossdevice strategy.run all_reduce"),
            ("crossdevice-reduce", "crossdevice ReductionToOneDevice.reduce"),
        ):
            r = res[f"{name}_over_tf"]
            print(
                f"  {label:>40}: median {res[f'{name}_ms']:7.2f} ms; per-round ratio to TF "
                f"median {r['median']:.3f} (quartiles {r['quartiles'][0]:.3f}-"
                f"{r['quartiles'][1]:.3f}), faster in {r['faster_rounds']}/{r['rounds']}"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
