"""`batch_reduce` of 160 float32 tensors (64 to 600k elements, ~200 MB per replica).

Compared, in the same run, with one all-reduce of a single buffer of the same total size
(the cost of the bytes alone), on 4 replicas:

* `sharded`: one `ThreadCommunicator.all_reduce` of the 160-array list from 4 replica
  threads (small arrays packed per dtype, large ones reduced in place, results views of
  one flat buffer);
* `reduce_to_one`: `crossdevice.ReductionToOneDevice().batch_reduce(SUM, pairs)` from the
  main thread, the call the TensorFlow side-by-side times;
* `batch_reduce_to`: `strategy.extended.batch_reduce_to(SUM, pairs)` from the main
  thread, with the strategy's default `CrossDeviceOps` (`HostAllReduce`);
* `replica_all_reduce`: `strategy.run(step)` where the step all-reduces its list of 160
  arrays with `get_replica_context().all_reduce` (includes the `run`).

    python -m benchmarks.batch_reduce --json batch.json
"""

from __future__ import annotations

from typing import Any

import numpy as np

import crossdevice
from benchmarks import _common
from crossdevice._cli.bench.impls import ReplicaThreads
from crossdevice._comm.local.thread import ThreadCommunicator
from crossdevice._values.values import PerReplica


def main() -> None:
    args = _common.parser(__doc__.split("\n\n")[0]).parse_args()
    n = _common.REPLICAS
    devices = _common.setup_devices(n)
    sizes = _common.batch_sizes()
    total = sum(sizes)
    rng = np.random.default_rng(0)
    batch = [[rng.standard_normal(s).astype(np.float32) for s in sizes] for _ in range(n)]
    single = [np.concatenate(b) for b in batch]
    print(
        f"{len(sizes)} float32 tensors, {min(sizes)}..{max(sizes)} elements, "
        f"{total * 4 / 1e6:.0f} MB per replica, {n} replicas"
    )
    results: dict[str, Any] = {"tensors": len(sizes), "bytes_per_replica": total * 4}
    threads = ReplicaThreads(n)
    comm = ThreadCommunicator(n, name="batch-bench")
    strategy = crossdevice.MirroredStrategy(devices)
    try:
        # sharded: the replica threads' own communicator
        check = threads.run(lambda r: comm.all_reduce(r, batch[r], "sum", timeout=300))
        flat = np.concatenate([np.asarray(x) for x in check[0]])
        expected = threads.run(lambda r: comm.all_reduce(r, [single[r]], "sum", timeout=300))
        assert np.array_equal(flat, expected[0][0]), "packed result differs from single buffer"
        # Held results keep their pooled output buffers busy: the timed calls would then
        # pay for freshly faulted ones, which a training loop dropping its results never does.
        del check, flat, expected
        results["sharded_batch_ms"] = _common.replica_median_seconds(
            threads, lambda r: comm.all_reduce(r, batch[r], "sum", timeout=300), args.runs
        )[0]
        results["sharded_single_ms"] = _common.replica_median_seconds(
            threads, lambda r: comm.all_reduce(r, [single[r]], "sum", timeout=300), args.runs
        )[0]

        # reduce_to_one: TF's CrossDeviceOps call, from the main thread
        ops = crossdevice.ReductionToOneDevice()
        values = [PerReplica([batch[r][i] for r in range(n)], devices) for i in range(len(sizes))]
        pairs = [(v, v) for v in values]
        whole = PerReplica(single, devices)
        results["reduce_to_one_batch_ms"] = _common.median_seconds(
            lambda: ops.batch_reduce("sum", pairs), args.runs
        )[0]
        results["reduce_to_one_single_ms"] = _common.median_seconds(
            lambda: ops.reduce("sum", whole, destinations=whole), args.runs
        )[0]

        # batch_reduce_to: the strategy's own batch reduce (default CrossDeviceOps)
        extended = strategy.extended
        results["batch_reduce_to_batch_ms"] = _common.median_seconds(
            lambda: extended.batch_reduce_to("sum", pairs), args.runs
        )[0]
        results["batch_reduce_to_single_ms"] = _common.median_seconds(
            lambda: extended.reduce_to("sum", whole, whole), args.runs
        )[0]

        # replica_all_reduce: a step all-reducing its gradients, through strategy.run
        def batch_step() -> Any:
            ctx = crossdevice.get_replica_context()
            return ctx.all_reduce("sum", batch[ctx.replica_id_in_sync_group])

        def single_step() -> Any:
            ctx = crossdevice.get_replica_context()
            return ctx.all_reduce("sum", single[ctx.replica_id_in_sync_group])

        results["replica_all_reduce_batch_ms"] = _common.median_seconds(
            lambda: strategy.run(batch_step), args.runs
        )[0]
        results["replica_all_reduce_single_ms"] = _common.median_seconds(
            lambda: strategy.run(single_step), args.runs
        )[0]
    finally:
        threads.close()
    for path in ("sharded", "reduce_to_one", "batch_reduce_to", "replica_all_reduce"):
        b = results[f"{path}_batch_ms"]
        s = results[f"{path}_single_ms"]
        results[f"{path}_batch_ms"], results[f"{path}_single_ms"] = b * 1e3, s * 1e3
        results[f"{path}_batch_over_single"] = b / s
        print(
            f"  {path:>18}: batch of {len(sizes)} median {b * 1e3:7.2f} ms, single buffer "
            f"{s * 1e3:7.2f} ms, ratio {b / s:.2f}"
        )
    _common.report(args, results)


if __name__ == "__main__":
    main()
