"""Overhead of `ProcessGroupCommunicator.all_reduce` over `torch.distributed.all_reduce`.

Run: `python -m tests.multi_worker.bench_all_reduce [--workers 2] [--repeats 21]`.

Variants, interleaved call by call (a barrier before each) so that a noisy neighbour
slows them alike:

* `direct`: `torch.distributed.all_reduce` on the communicator's own Gloo group, in place.
* `donate`: our all_reduce reducing the buffer in place (the strategy's path: it packs
  into fresh flat buffers it gives away).
* `copy`: our default, which first copies the input so that it stays unchanged.
* `t/direct`, `t/donate`: the same on a communicator with `timeout_seconds` set (its own
  group, timed waits).

Reported: the median time of each variant, and the overhead as the median over calls
of `variant / direct` on the same group (paired, which cancels slow drifts of a shared
machine). Workers run with OMP_NUM_THREADS=1, as under torchrun.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tests.multi_worker.harness import run_workers

#: Message sizes in bytes: a small one shows the fixed per-call cost.
SIZES = (4 << 10, 1 << 20, 16 << 20, 64 << 20)


def bench(rank: int, world_size: int, repeats: int) -> dict[int, dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from crossdevice._comm.workers.communicator import ProcessGroupCommunicator
    from crossdevice._core.options import CommunicationOptions

    comm = ProcessGroupCommunicator()
    timed = ProcessGroupCommunicator(options=CommunicationOptions(timeout_seconds=60))
    group, timed_group = comm.host_group, timed.host_group
    results: dict[int, dict[str, Any]] = {}
    for size in SIZES:
        flat = torch.ones(size // 4, dtype=torch.float32)
        variants = {
            "direct": lambda f=flat: dist.all_reduce(f, group=group),
            "donate": lambda f=flat: comm.all_reduce([f], donate=True),
            "copy": lambda f=flat: comm.all_reduce([f]),
            "t/direct": lambda f=flat: dist.all_reduce(f, group=timed_group),
            "t/donate": lambda f=flat: timed.all_reduce([f], donate=True),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        # Small messages are quick and noisy: time more of them.
        count = repeats * 10 if size < (1 << 20) else repeats
        for i in range(count + 2):
            for name, run in variants.items():
                dist.barrier(group=group)
                start = time.perf_counter()
                run()
                if i >= 2:  # warm-up
                    times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t) for name, t in times.items()}
        paired = {
            name: statistics.median(v / d for v, d in zip(times[name], times[base], strict=True))
            for name, base in (("donate", "direct"), ("copy", "direct"), ("t/donate", "t/direct"))
        }
        results[size] = {"median": medians, "paired": paired}
    comm.close()
    timed.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=21)
    ns = parser.parse_args()
    outcome = run_workers(bench, ns.workers, args=(ns.repeats,), timeout=600)
    table = outcome[0].unwrap()
    print(f"all_reduce float32 across {ns.workers} processes (Gloo, 127.0.0.1), median ms")
    names = ("direct", "donate", "copy", "t/direct", "t/donate")
    print(f"{'size':>7} " + " ".join(f"{n:>9}" for n in names) + "   overhead (paired median)")
    for size, row in table.items():
        t, paired = row["median"], row["paired"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        busbw = size / t["direct"] / 1e9 * 2 * (ns.workers - 1) / ns.workers
        overhead = "  ".join(f"{n} {100 * (r - 1):+.1f}%" for n, r in paired.items())
        print(
            f"{label:>7} "
            + " ".join(f"{t[n] * 1e3:9.3f}" for n in names)
            + f"   {overhead}  (busbw {busbw:.2f} GB/s)"
        )


if __name__ == "__main__":
    main()
