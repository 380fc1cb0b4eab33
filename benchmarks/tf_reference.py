"""TensorFlow's numbers for the workloads of `benchmarks/`, for side-by-side tables.

Run it with an interpreter that has TensorFlow (a scratch virtualenv with
`pip install tensorflow-cpu`; TensorFlow is never a crossdevice dependency), right after
or before our own scripts:

    ~/tfvenv/bin/python benchmarks/tf_reference.py --json tf.json

4 logical CPU devices, `MirroredStrategy` with `ReductionToOneDevice`, eager; medians of
`--runs` (9) runs: all-reduce 4 x 64 and 4 x 16 MiB, the 160-tensor `batch_reduce` and
one buffer of the same total, `run` of a trivial function, steps with a scalar and a
1 KiB `all_reduce`. For the large all-reduces, `tf_side_by_side.py` is the fairer
comparison (the two libraries take turns instead of following each other).
"""

from __future__ import annotations

# TensorFlow's interpreter has no crossdevice: only the standard library, NumPy,
# TensorFlow and `benchmarks._workloads` (NumPy only), found from the repository root.
import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # type: ignore[import-not-found]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._workloads import batch_sizes, median_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=9, help="timed runs; medians are reported (9)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    args = p.parse_args()
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    ops = tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)], cross_device_ops=ops)
    sum_op = tf.distribute.ReduceOp.SUM
    results: dict[str, float] = {}

    def per_replica(n: int, seed: int) -> Any:
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.random.stateless_uniform([n], seed=[seed, ctx.replica_id_in_sync_group])
        )

    def report(key: str, label: str, seconds: float, unit: str = "ms") -> None:
        scale = 1e3 if unit == "ms" else 1e6
        results[f"{key}_{unit}"] = seconds * scale
        print(f"{label}: median {seconds * scale:.2f} {unit}", flush=True)

    for mib in (64, 16):
        v = per_replica(mib * 2**20 // 4, mib)
        seconds, _ = median_seconds(lambda v=v: ops.reduce(sum_op, v, destinations=v), args.runs)
        report(f"allreduce_4x{mib}MiB", f"all-reduce 4 x {mib} MiB float32", seconds)

    sizes = batch_sizes()
    pairs = [(v, v) for v in (per_replica(s, 1000 + i) for i, s in enumerate(sizes))]
    seconds, _ = median_seconds(lambda: ops.batch_reduce(sum_op, pairs), args.runs)
    report(
        "batch_reduce_160", f"batch_reduce of 160 tensors ({sum(sizes) * 4 / 1e6:.0f} MB)", seconds
    )
    flat = per_replica(sum(sizes), 7)
    seconds, _ = median_seconds(lambda: ops.reduce(sum_op, flat, destinations=flat), args.runs)
    report("allreduce_single_buffer_same_total", "all-reduce of one buffer, same total", seconds)

    # Named functions, not lambdas: `run` hands its function to AutoGraph, which converts
    # a lambda anew on every call (measured: 4.1 ms per trivial run instead of 1.8).
    def trivial() -> Any:
        return tf.constant(1.0)

    def scalar_step() -> Any:
        return tf.distribute.get_replica_context().all_reduce("sum", tf.constant(1.0))

    def kib_step() -> Any:
        return tf.distribute.get_replica_context().all_reduce("sum", tf.ones([256]))

    steps = {
        "run_trivial": trivial,
        "run_scalar_allreduce": scalar_step,
        "run_1KiB_allreduce": kib_step,
    }
    for key, step in steps.items():
        seconds, _ = median_seconds(lambda step=step: strategy.run(step), args.runs, 20, 5)
        report(key, f"{key.replace('_', ' ')}, 4 replicas", seconds, "us")
    meta = {
        "tensorflow": tf.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(meta))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "runs": args.runs, "results": results}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
