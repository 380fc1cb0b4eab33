"""Overhead of `ProcessGroupCommunicator.all_reduce` over `torch.distributed.all_reduce`.

Run: `python -m tests.multi_worker.bench_all_reduce [--workers 2] [--repeats 15]`.

Each size is timed as a median over `repeats` calls, the variants interleaved call by
call so that a noisy neighbour slows them alike; a barrier precedes each call. Variants:
`direct` is `torch.distributed.all_reduce` on the communicator's own Gloo group;
`donate` our all_reduce reducing the buffer in place (the strategy's path, which packs
into fresh buffers); `copy` our default, which first copies the input so that it stays
unchanged; `timeout` the donate path with `timeout_seconds` set (timed waits).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tests.multi_worker.harness import run_workers

#: Message sizes in bytes: a small one shows the fixed per-call cost.
SIZES = (4 << 10, 1 << 20, 16 << 20, 64 << 20)


def bench(rank: int, world_size: int, repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from crossdevice._collectives.torch_dist import ProcessGroupCommunicator
    from crossdevice._core.options import CommunicationOptions

    comm = ProcessGroupCommunicator()
    timed = ProcessGroupCommunicator(options=CommunicationOptions(timeout_seconds=60))
    group = comm._host_group
    results: dict[str, Any] = {}
    for size in SIZES:
        flat = torch.ones(size // 4, dtype=torch.float32)
        variants = {
            "direct": lambda f=flat: dist.all_reduce(f, group=group),
            "donate": lambda f=flat: comm.all_reduce([f], donate=True),
            "copy": lambda f=flat: comm.all_reduce([f]),
            "timeout": lambda f=flat: timed.all_reduce([f], donate=True),
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
        results[size] = {name: statistics.median(t) for name, t in times.items()}
    comm.close()
    timed.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    ns = parser.parse_args()
    outcome = run_workers(bench, ns.workers, args=(ns.repeats,), timeout=600)
    table = outcome[0].unwrap()
    print(f"all_reduce float32 across {ns.workers} processes (Gloo, 127.0.0.1), median ms")
    print(f"{'size':>7} {'direct':>9} {'donate':>9} {'copy':>9} {'timeout':>9}  overhead")
    for size, t in table.items():
        over = {k: 100 * (t[k] / t["direct"] - 1) for k in ("donate", "copy", "timeout")}
        busbw = size / t["direct"] / 1e9 * 2 * (ns.workers - 1) / ns.workers
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(
            f"{label:>7} {t['direct'] * 1e3:9.3f} {t['donate'] * 1e3:9.3f} {t['copy'] * 1e3:9.3f} "
            f"{t['timeout'] * 1e3:9.3f}  donate {over['donate']:+.1f}%  copy {over['copy']:+.1f}% "
            f"timeout {over['timeout']:+.1f}%  (direct busbw {busbw:.2f} GB/s)"
        )


if __name__ == "__main__":
    main()
