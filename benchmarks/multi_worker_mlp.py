"""Training steps of an MLP with large gradients across 2 workers: crossdevice against DDP.

The tutorial CNN of `multi_worker_epoch` has 476 KiB of gradients, one bucket. This
benchmark trains a model whose gradients fill several of the default 25 MiB buckets:
`--layers` linear layers of `--width` x `--width` (4 x 2048: 64 MiB of gradients), ReLU
between them, SGD, cross-entropy over 10 classes, `--per-worker` examples per worker
per step. Two variants take turns in the same processes, each `--steps` steps per turn
on the same global batches, after a barrier on a group of their own
(`_launch.take_turns`, the slower worker's time):

* `gloo`: `crossdevice.torch.prepare` on a `MultiWorkerMirroredStrategy` built with
  `CROSSDEVICE_SHARED_MEMORY=0` (every byte through Gloo, as across machines), one
  replica per worker, `experimental_distribute_dataset` and `strategy.run`, the loss
  scaled TF's way (`compute_average_loss` over the global batch);
* `ddp`: `torch.nn.parallel.DistributedDataParallel` on the default (Gloo) group, each
  worker its slice of the same global batches.

`--bucket-cap` sets both the strategy's `bucket_cap_bytes` and DDP's `bucket_cap_mb`
(default 25 MiB: both libraries' default). Reported: each variant's median time per step
and the median per-round ratio `gloo/ddp`, the largest difference between the two
models' parameters (both start alike and see the same batches: 0 expected), and the CPU
time rank 0's process spent per step in each, all its threads and by thread (`_usage.py`:
on a host whose cores the workers share, the wall time follows it), with how often a
step's caller's thread blocked (`waits`) or lost its CPU to another thread
(`preemptions`).

    python -m benchmarks.multi_worker_mlp --width 2048 --layers 4 --bucket-cap 25M 1G
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any
from unittest import mock

from benchmarks._launch import launch_or_work, set_tunings, take_turns, tuning_option
from benchmarks._launch import size as parse_size
from benchmarks._usage import Usage, measured, switches_line, threads_line
from benchmarks.train_step import tutorial_step

__all__ = ["main"]


def _model(torch: Any, width: int, layers: int) -> Any:
    torch.manual_seed(0)
    modules: list[Any] = []
    for _ in range(layers):
        modules += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules, torch.nn.Linear(width, 10))


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import crossdevice
    import crossdevice.torch as cdt

    torch.set_num_threads(1)
    set_tunings(args.tuning)
    with mock.patch.dict(os.environ, {"CROSSDEVICE_SHARED_MEMORY": "0"}):
        strategy = crossdevice.MultiWorkerMirroredStrategy(devices=["CPU:0"])
    rank, world = dist.get_rank(), dist.get_world_size()
    per, size = args.per_worker, args.per_worker * world
    generator = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(size, args.width, generator=generator),
            torch.randint(0, 10, (size,), generator=generator),
        )
        for _ in range(args.steps)
    ]
    slices = [
        (x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]) for x, y in batches
    ]
    barrier_group = dist.new_group(backend="gloo")
    if rank == 0:
        nbytes = sum(p.numel() * 4 for p in _model(torch, args.width, args.layers).parameters())
        print(
            f"# multi_worker_mlp: {args.layers} x {args.width}^2 ({nbytes / 2**20:.0f} MiB of "
            f"gradients), SGD, {per} examples per worker, {world} workers x 1 replica, Gloo; "
            f"torch {torch.__version__}, 1 thread each; medians of {args.rounds} rounds",
            flush=True,
        )
    for cap in args.bucket_cap:
        with strategy.scope():
            model = _model(torch, args.width, args.layers)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            model, optimizer = cdt.prepare(
                model, optimizer, threads_per_replica=0, bucket_cap_bytes=cap
            )
        ddp = torch.nn.parallel.DistributedDataParallel(
            _model(torch, args.width, args.layers), bucket_cap_mb=cap / 2**20
        )
        ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)

        step = tutorial_step(model, optimizer, size)  # the loss over the global batch

        def strategy_steps(step: Any = step) -> None:
            for inputs in strategy.experimental_distribute_dataset(batches):
                strategy.run(step, args=(inputs,))

        def ddp_steps(ddp: Any = ddp, ddp_optimizer: Any = ddp_optimizer) -> None:
            for x, y in slices:
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
                ddp_optimizer.zero_grad()
                loss.backward()
                ddp_optimizer.step()

        usage: dict[str, list[Usage]] = {"gloo": [], "ddp": []}
        times = take_turns(
            {
                "gloo": measured(strategy_steps, usage["gloo"]),
                "ddp": measured(ddp_steps, usage["ddp"]),
            },
            args.rounds,
            args.warmup,
            lambda: dist.barrier(group=barrier_group),
            until_all=True,
        )
        if rank == 0:
            ratios = [a / b for a, b in zip(times["gloo"], times["ddp"], strict=True)]
            pairs = zip(model.parameters(), ddp.module.parameters(), strict=True)
            differs = max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)
            ms = {name: statistics.median(t) * 1e3 / args.steps for name, t in times.items()}
            print(
                f"bucket cap {cap} B: gloo {ms['gloo']:.1f} ms/step, ddp {ms['ddp']:.1f} ms/step,"
                f" gloo/ddp {statistics.median(ratios):.3f} (min-max {min(ratios):.3f}-"
                f"{max(ratios):.3f}); parameters max |difference| {differs:.3g}",
                flush=True,
            )
            timed = {name: runs[args.warmup :] for name, runs in usage.items()}
            flt = {n: statistics.median(u.faults for u in r) / args.steps for n, r in timed.items()}
            print(
                "  rank 0's process per step (median ms of CPU, all threads, by thread; page "
                f"faults gloo {flt['gloo']:.0f}, ddp {flt['ddp']:.0f}):",
                flush=True,
            )
            for name, runs in timed.items():
                print(
                    f"    {name} {threads_line(runs, per=args.steps)}; the caller's thread "
                    f"left its CPU {switches_line(runs, per=args.steps)} a step",
                    flush=True,
                )
    strategy.extended._close()


def main(argv: list[str] | None = None) -> int:
    """Parse the command line; launch the workers, or be one."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048, help="layer width (2048)")
    parser.add_argument("--layers", type=int, default=4, help="width x width layers (4)")
    parser.add_argument("--per-worker", type=int, default=32, help="examples a step (32)")
    parser.add_argument("--steps", type=int, default=10, help="steps per turn (10)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (1)")
    parser.add_argument(
        "--bucket-cap",
        type=parse_size,
        nargs="+",
        default=[25 << 20],
        metavar="BYTES",
        help="bucket caps, each timed in turn (default 25M: both libraries' default)",
    )
    tuning_option(parser, "queue_min_bytes=0 to issue every bucket on the queue's thread")
    return launch_or_work("benchmarks.multi_worker_mlp", parser, argv, _worker, 3600.0)


if __name__ == "__main__":
    sys.exit(main())
