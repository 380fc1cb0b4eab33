"""All-reduce of 4 replicas x 64 MiB and x 16 MiB float32 against the memory limit.

The limit is (N+1)·S bytes at the memory bandwidth measured in this run (the better of a
one-thread and an all-cores `np.copyto`). Measured paths:

* `sharded`: `ThreadCommunicator.all_reduce` called by 4 replica threads (each reduces
  pieces of the work; the default host all-reduce);
* `reduce_to_one`: `crossdevice.ReductionToOneDevice().reduce(SUM, v, destinations=v)`
  from the main thread, the call the TensorFlow side-by-side times;
* `replica_all_reduce`: `strategy.run(step)` where the step all-reduces its replica's
  array with `get_replica_context().all_reduce` (includes the `run`);
* `naive`: the pairwise `np.add` chain on one thread (what the blocked kernel replaces).

    python -m benchmarks.allreduce_limit --json allreduce.json
"""

from __future__ import annotations

from typing import Any

import numpy as np

import crossdevice
from benchmarks import _common
from crossdevice._arrays.host_kernels import plain_sum
from crossdevice._cli.bench.bandwidth import all_reduce_limit_seconds, measure_memory_bandwidth
from crossdevice._cli.bench.impls import ReplicaThreads
from crossdevice._comm.local.thread import ThreadCommunicator
from crossdevice._values.values import PerReplica


def main() -> None:
    args = _common.parser(__doc__.split("\n\n")[0]).parse_args()
    n = _common.REPLICAS
    devices = _common.setup_devices(n)
    bw = measure_memory_bandwidth()
    print(
        f"memory bandwidth (np.copyto 256 MiB, read+written): 1 thread "
        f"{bw.single_thread / 1e9:.1f} GB/s, {bw.threads} threads {bw.all_cores / 1e9:.1f} "
        f"GB/s -> {bw.best / 1e9:.1f} GB/s"
    )
    results: dict[str, Any] = {"bandwidth": bw.as_dict()}
    threads = ReplicaThreads(n)
    comm = ThreadCommunicator(n, name="allreduce-bench")
    strategy = crossdevice.MirroredStrategy(devices)
    try:
        for mib in (64, 16):
            nbytes = mib * 2**20
            rng = np.random.default_rng(mib)
            data = [rng.standard_normal(nbytes // 4).astype(np.float32) for _ in range(n)]
            expected = plain_sum(data)
            limit = all_reduce_limit_seconds(n, nbytes, bw.best)
            out: dict[str, Any] = {"limit_ms": limit * 1e3}

            def sharded(r: int, data: list[np.ndarray] = data) -> Any:
                return comm.all_reduce(r, [data[r]], "sum", timeout=300)

            check = threads.run(sharded)
            assert all(np.array_equal(c[0], expected) for c in check), "sharded result differs"
            del check  # a held result keeps its pooled output buffer busy
            out["sharded_ms"] = _common.replica_median_seconds(threads, sharded, args.runs)[0]
            value = PerReplica(data, devices)
            ops = crossdevice.ReductionToOneDevice()
            reduced = ops.reduce("sum", value, destinations=value)
            assert np.array_equal(np.asarray(reduced.values[0]), expected)
            del reduced
            out["reduce_to_one_ms"] = _common.median_seconds(
                lambda ops=ops, value=value: ops.reduce("sum", value, destinations=value),
                args.runs,
            )[0]

            def step(data: list[np.ndarray] = data) -> Any:
                ctx = crossdevice.get_replica_context()
                return ctx.all_reduce("sum", data[ctx.replica_id_in_sync_group])

            out["replica_all_reduce_ms"] = _common.median_seconds(
                lambda step=step: strategy.run(step), args.runs
            )[0]
            scratch = np.empty_like(data[0])
            out["naive_ms"] = _common.median_seconds(
                lambda data=data, scratch=scratch: plain_sum(data, scratch), args.runs
            )[0]
            print(f"all-reduce {n} x {mib} MiB float32 (limit {limit * 1e3:.2f} ms):")
            for key in ("sharded_ms", "reduce_to_one_ms", "replica_all_reduce_ms", "naive_ms"):
                seconds = out[key]
                out[key] = seconds * 1e3
                out[key.replace("_ms", "_fraction_of_limit")] = limit / seconds
                print(
                    f"  {key[:-3]:>20}: median {seconds * 1e3:7.2f} ms = "
                    f"{100 * limit / seconds:5.1f}% of the limit"
                )
            results[f"{n}x{mib}MiB"] = out
    finally:
        threads.close()
    _common.report(args, results)


if __name__ == "__main__":
    main()
