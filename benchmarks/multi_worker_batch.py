"""Cross-worker batch of 160 float32 tensors (64 to 600k elements): packed vs one call each.

Run under torchrun (one process per worker, Gloo on the host)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m benchmarks.multi_worker_batch

Each round times each once, in balanced orders so drift on a shared host hits them
alike (`_launch.take_turns`):

* `per_tensor`: one `torch.distributed.all_reduce` per tensor (160 calls, in place);
* `one_call_floor`: one `torch.distributed.all_reduce` of a flat buffer already holding
  every tensor (no packing, no copy): no packed implementation can beat it, so it bounds
  the speed-up any packing can reach against `per_tensor`;
* `batch_all_reduce`: `ProcessGroupCommunicator.batch_all_reduce` (packed per dtype into
  packs of `bytes_per_pack`, one fingerprinted collective, inputs unmodified);
* `batch_reduce_to`: `MultiWorkerMirroredStrategy.extended.batch_reduce_to` of the 160
  per-replica values (local sum, cross-worker all-reduce, local broadcast).

Rank 0 prints the median of each and the speed-up of each against `per_tensor`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import crossdevice
from benchmarks._launch import take_turns
from benchmarks._workloads import batch_sizes
from crossdevice._values.values import PerReplica


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every size")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    strategy = crossdevice.MultiWorkerMirroredStrategy(devices=["CPU:0"])
    extended: Any = strategy.extended
    comm = extended._worker_communicator
    if comm is None:
        raise SystemExit("run under torchrun with at least 2 processes")
    sizes = [max(1, int(s * args.scale)) for s in batch_sizes()]
    rng = np.random.default_rng(comm.rank)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in sizes]
    # The in-place calls reduce zeros: any other values would double every call and
    # overflow to inf after ~128 rounds. An add takes the same time whatever it adds.
    tensors = [torch.zeros(s, dtype=torch.float32) for s in sizes]
    device = extended.worker_devices[0]
    values = [PerReplica([a], devices=[device]) for a in arrays]
    group = comm.host_group
    flat = torch.zeros(sum(sizes), dtype=torch.float32)
    calls: dict[str, Callable[[], Any]] = {
        "per_tensor": lambda: [dist.all_reduce(t, group=group) for t in tensors],
        "one_call_floor": lambda: dist.all_reduce(flat, group=group),
        "batch_all_reduce": lambda: comm.batch_all_reduce(arrays, "sum"),
        "batch_reduce_to": lambda: extended.batch_reduce_to("sum", [(v, v) for v in values]),
    }
    # One untimed round warms up; then each round runs every call once, in balanced orders.
    times = take_turns(calls, args.rounds, 1, lambda: dist.barrier(group=group))
    if comm.rank == 0:
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians["per_tensor"]
        print(
            f"# {len(sizes)} float32 tensors, {sum(sizes) * 4 / 1e6:.1f} MB per worker, "
            f"{comm.world_size} workers, {args.rounds} interleaved rounds (medians)"
        )
        for name, median in medians.items():
            print(f"{name:>18} {median * 1e3:10.1f} ms  {base / median:6.2f}x vs per_tensor")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"sizes": sizes, "times": times}, fh, indent=1)
    strategy.extended._close()


if __name__ == "__main__":
    main()
