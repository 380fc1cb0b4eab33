"""An epoch of the TF tutorial CNN across 2 workers: crossdevice against torch DDP on Gloo.

Issue #26's training target, on the path a user calls: the model and Adam mirrored with
`crossdevice.torch.prepare` on a `MultiWorkerMirroredStrategy` with one replica per
worker, the step run with `strategy.run` on batches from `experimental_distribute_dataset`,
the loss scaled TF's way (`compute_average_loss` over the global batch). Against it, in
the same processes, `torch.nn.parallel.DistributedDataParallel` on the default (Gloo)
group, each worker its slice of the same global batches (checked to be the very slices
the strategy hands its replica). Variants, each one epoch per turn, in an order that
changes from round to round, each right after each other equally often
(`_launch.take_turns`), after a barrier on a group of their own:

* `gloo`: the strategy built with `CROSSDEVICE_SHARED_MEMORY=0` (workers on different
  machines: every byte through Gloo). The target: at most 1.0x `ddp`.
* `shm`: the default strategy (on one host, sums through `/dev/shm`).
* `ddp`: DDP, one torch thread per process (torchrun's default), as every variant.
* `ddp2`: a second DDP model, trained alike: `ddp2/ddp` is the same code timed twice, so
  its spread is how far apart this machine puts two identical programs (the resolution
  of every other ratio).
* `local`: the same steps with no communication at all (each worker trains alone on its
  slice): the compute floor.
* `split` (with `--bucket-cap BYTES`): `gloo` again, a second model prepared with
  `bucket_cap_bytes=BYTES`, so its gradients go in several buckets (this CNN's fit one
  bucket by default), one all-reduce a backward pass, each bucket leaving as backward
  completes it (`crossdevice/_frameworks/torch/pass_reduce.py`); its parameters are
  checked against DDP's as `gloo`'s are. Against it, `ddp_split`: DDP
  with `bucket_cap_mb` of the same bytes (every bucket, the first too, that small).
* `comm`: only the epoch's gradient all-reduces, through the `gloo` strategy (one
  bucket per step, shaped as the gradients, issued and waited on as `crossdevice.torch`
  does it: one flat buffer reduced where it lies): the communication alone.

The overlap: how much of the communication an epoch hides behind compute is
`(local + comm - gloo) / comm` (0: none, as when the gradients are reduced after the
backward pass; negative: the strategy's steps cost more than compute plus the
all-reduces, e.g. the per-step agreement of the distributed input on whether there is
data, and the step's own Python). Reported per batch size: every variant's median epoch
time, the median per-round ratio of `gloo` and `shm` to `ddp`, the overlap, and each
variant's page faults per epoch on rank 0 (fresh pages of memory, zero-filled one 4 KiB
fault at a time: what `crossdevice._arrays.heap` saves; run with `CROSSDEVICE_KEEP_HEAP=0`
for glibc's defaults, every variant alike since they share the processes), and the CPU
rank 0's process spent per epoch in each, by thread (`_usage.py`: the caller's thread,
crossdevice's queue, health and arrivals threads, Gloo's and the store's; on the 2-core
host the wall time follows this CPU, which moves far less from run to run), and how
often a step's caller's thread left its CPU (`waits`: it blocked; `preemptions`: the
scheduler gave the CPU to another thread; DDP waits once a step). At the end,
the largest difference between the crossdevice and DDP parameters (both started alike
and saw the same batches).

    python -m benchmarks.multi_worker_epoch --per-worker 8 32 128 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any
from unittest import mock

from benchmarks._launch import launch_or_work, set_tunings, take_turns, tuning_option
from benchmarks._launch import size as parse_size
from benchmarks._usage import Usage, measured, switches_line, threads_line
from benchmarks.train_step import (
    EXAMPLES,
    IMAGE_SIZE,
    _data,
    _global_batches,
    _model,
    tutorial_step,
)

__all__ = ["main"]

_VARIANTS = ("gloo", "shm", "ddp", "ddp2", "local", "comm", "split", "ddp_split")


def _strategy_epoch(
    strategy: Any, bucket_cap: int | None = None
) -> tuple[Callable[[list[Any], int], None], Any]:
    """(one epoch over global batches of a size on `strategy`, the mirrored model)."""
    import torch

    import crossdevice.torch as cdt

    with strategy.scope():
        model = _model(torch)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
        model, optimizer = cdt.prepare(
            model, optimizer, threads_per_replica=0, bucket_cap_bytes=bucket_cap
        )

    def epoch(batches: list[Any], size: int) -> None:
        step = tutorial_step(model, optimizer, size)
        for inputs in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=(inputs,))

    return epoch, model


class _Turns:
    """Every variant's state in this worker, and one epoch of each (see the module doc)."""

    def __init__(self, variants: list[str], bucket_cap: int | None = None) -> None:
        import torch
        import torch.distributed as dist

        import crossdevice

        torch.set_num_threads(1)
        with mock.patch.dict(os.environ, {"CROSSDEVICE_SHARED_MEMORY": "0"}):
            self.gloo = crossdevice.MultiWorkerMirroredStrategy(devices=["CPU:0"])
        self.shm = None
        if "shm" in variants:
            self.shm = crossdevice.MultiWorkerMirroredStrategy(devices=["CPU:0"])
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.gloo_epoch, self.gloo_model = _strategy_epoch(self.gloo)
        self.shm_epoch = None if self.shm is None else _strategy_epoch(self.shm)[0]
        self.split_epoch, self.split_model = None, None
        if {"split", "ddp_split"} & set(variants):
            if bucket_cap is None:
                raise SystemExit("the split and ddp_split variants need --bucket-cap BYTES")
            self.split_epoch, self.split_model = _strategy_epoch(self.gloo, bucket_cap)
            self.ddp_split = torch.nn.parallel.DistributedDataParallel(
                _model(torch), bucket_cap_mb=bucket_cap / 2**20
            )
            self.ddp_split_optimizer = torch.optim.Adam(
                self.ddp_split.parameters(), lr=1e-3, eps=1e-7
            )
        self.ddp = torch.nn.parallel.DistributedDataParallel(_model(torch))
        self.ddp_optimizer = torch.optim.Adam(self.ddp.parameters(), lr=1e-3, eps=1e-7)
        self.ddp2: Any = None
        if "ddp2" in variants:
            self.ddp2 = torch.nn.parallel.DistributedDataParallel(_model(torch))
            self.ddp2_optimizer = torch.optim.Adam(self.ddp2.parameters(), lr=1e-3, eps=1e-7)
        self.local = _model(torch)
        self.local_optimizer = torch.optim.Adam(self.local.parameters(), lr=1e-3, eps=1e-7)
        self.params = list(self.local.parameters())
        self.grads = [torch.zeros_like(p) for p in self.params]
        self.x, self.y = _data()

    def epochs(self, per_worker: int) -> tuple[int, dict[str, Callable[[], None]]]:
        """(steps per epoch, one epoch of each variant) at `per_worker` examples a step."""
        size = per_worker * self.world
        batches = _global_batches(self.x, self.y, size)
        mine = slice(self.rank * per_worker, (self.rank + 1) * per_worker)
        slices = [(bx[mine], by[mine]) for bx, by in batches]
        _check_slices(self.gloo, batches, slices)
        epochs: dict[str, Callable[[], None]] = {
            "gloo": lambda: self.gloo_epoch(batches, size),
            "ddp": lambda: _alone(self.ddp, self.ddp_optimizer, slices),
            "local": lambda: _alone(self.local, self.local_optimizer, slices),
            "comm": lambda: self._communicate(len(slices)),
        }
        if self.ddp2 is not None:
            epochs["ddp2"] = lambda: _alone(self.ddp2, self.ddp2_optimizer, slices)
        shm_epoch = self.shm_epoch
        if shm_epoch is not None:
            epochs["shm"] = lambda: shm_epoch(batches, size)
        split_epoch = self.split_epoch
        if split_epoch is not None:
            epochs["split"] = lambda: split_epoch(batches, size)
            epochs["ddp_split"] = lambda: _alone(self.ddp_split, self.ddp_split_optimizer, slices)
        return len(batches), epochs

    def _communicate(self, steps: int) -> None:
        import crossdevice
        from crossdevice._frameworks.torch import buckets

        plan = buckets.FlatPlan(self.params)  # kept from step to step, as the buckets do

        def reduce_grads() -> Any:
            ctx = crossdevice.get_replica_context()
            pending = buckets.issue_flat(
                ctx, crossdevice.ReduceOp.SUM, self.grads, self.params, None, plan
            )
            assert pending is not None  # one replica per worker: the flat path
            return pending.wait()

        for _ in range(steps):
            self.gloo.run(reduce_grads)

    def difference(self, model: Any) -> float:
        """The largest difference between `model`'s and the `ddp` model's parameters."""
        pairs = zip(model.parameters(), self.ddp.module.parameters(), strict=True)
        return max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)

    def close(self) -> None:
        """Close the strategies' communicators."""
        self.gloo.extended._close()
        if self.shm is not None:
            self.shm.extended._close()


def _alone(model: Any, optimizer: Any, slices: list[Any]) -> None:
    """One epoch of plain torch steps on this worker's slices (DDP reduces in backward)."""
    import torch

    for bx, by in slices:
        loss = torch.nn.functional.cross_entropy(model(bx), by)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    set_tunings(args.tuning)
    if args.bucket_cap is not None:
        args.variants += [v for v in ("split", "ddp_split") if v not in args.variants]
    turns = _Turns(args.variants, args.bucket_cap)
    barrier_group = dist.new_group(backend="gloo")  # nobody else's threads kept awake
    if turns.rank == 0:
        print(
            f"# multi_worker_epoch: TF tutorial CNN on {IMAGE_SIZE}x{IMAGE_SIZE}, Adam, "
            f"{EXAMPLES} examples; {turns.world} workers x 1 replica; torch "
            f"{torch.__version__}, 1 thread each; medians of {args.rounds} interleaved rounds",
            flush=True,
        )
    for per_worker in args.per_worker:
        steps, epochs = turns.epochs(per_worker)
        usage: dict[str, list[Usage]] = {}
        times = take_turns(
            {
                name: measured(epochs[name], usage.setdefault(name, []))
                for name in args.variants
                if name in epochs
            },
            args.rounds,
            args.warmup,
            lambda: dist.barrier(group=barrier_group),
            until_all=True,  # the slower worker's epoch
        )
        if turns.rank == 0:
            _report(per_worker, steps, times)
            timed = {name: runs[args.warmup :] for name, runs in usage.items()}
            line = ", ".join(
                f"{name} {statistics.median(u.faults for u in runs):.0f}"
                for name, runs in timed.items()
            )
            print(f"  page faults per epoch (rank 0, median): {line}", flush=True)
            print("  CPU per epoch (rank 0's process, median ms, by thread):", flush=True)
            for name, runs in timed.items():
                print(f"    {name} {threads_line(runs)}", flush=True)
            print("  the caller's thread left its CPU, per step (rank 0, median):", flush=True)
            for name, runs in timed.items():
                print(f"    {name} {switches_line(runs, per=steps)}", flush=True)
    for name, model in (("gloo", turns.gloo_model), ("split", turns.split_model)):
        if turns.rank == 0 and {name, "ddp"} <= set(args.variants):
            print(
                f"# parameters, {name} vs ddp (the same batches throughout): max |difference| "
                f"{turns.difference(model):.3g}",
                flush=True,
            )
    turns.close()


def _check_slices(strategy: Any, batches: list[Any], slices: list[Any]) -> None:
    """The strategy gives this worker's replica exactly DDP's slice of the first batch."""
    import torch

    first = next(iter(strategy.experimental_distribute_dataset(batches[:1])))
    ((bx, by),) = strategy.experimental_local_results(first)
    if not (torch.equal(bx, slices[0][0]) and torch.equal(by, slices[0][1])):
        raise SystemExit("the strategy's slice of a global batch is not DDP's slice")


def _report(per_worker: int, steps: int, times: dict[str, list[float]]) -> None:
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    line = ", ".join(f"{name} {ms:.1f} ms" for name, ms in med.items())
    print(f"batch {per_worker}/worker ({steps} steps/epoch): {line}", flush=True)
    for name in ("gloo", "shm", "split", "ddp2"):
        if name in times and "ddp" in times:
            ratios = [a / b for a, b in zip(times[name], times["ddp"], strict=True)]
            floor = " (the same code twice: the noise floor)" if name == "ddp2" else ""
            print(
                f"  {name}/ddp {statistics.median(ratios):.3f} (min-max {min(ratios):.3f}-"
                f"{max(ratios):.3f}){floor}",
                flush=True,
            )
    for a, b, what in (
        ("split", "gloo", "several buckets against one"),
        ("ddp_split", "ddp", "DDP: several buckets against one"),
        ("split", "ddp_split", "several buckets each"),
    ):
        if {a, b} <= set(times):
            ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
            print(f"  {a}/{b} {statistics.median(ratios):.3f} ({what})", flush=True)
    if {"gloo", "local", "comm"} <= set(times):
        hidden = (med["local"] + med["comm"] - med["gloo"]) / med["comm"]
        print(
            f"  overlap: {hidden:.0%} of the communication alone ({med['comm']:.1f} ms) hidden; "
            f"gloo - local = {med['gloo'] - med['local']:.1f} ms (negative overlap: the "
            f"steps cost more than compute plus communication)",
            flush=True,
        )
    if "gloo" in times and "ddp" in times:
        ok = statistics.median(a / b for a, b in zip(times["gloo"], times["ddp"], strict=True))
        print(f"# target gloo epoch <= 1.0x ddp: {'met' if ok <= 1.0 else 'NOT met'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line; launch the workers, or be one."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-worker", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per batch size (7)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (1)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[v for v in _VARIANTS if "split" not in v],
        choices=_VARIANTS,
        help="what takes turns (default: all but split and ddp_split)",
    )
    parser.add_argument(
        "--bucket-cap",
        type=parse_size,
        default=None,
        metavar="BYTES",
        help="the bucket cap of split and ddp_split (e.g. 64K), which it adds to the variants",
    )
    tuning_option(parser, "direct_max_workers=1 to send the gradients as before the exchange")
    return launch_or_work("benchmarks.multi_worker_epoch", parser, argv, _worker, 3600.0)


if __name__ == "__main__":
    sys.exit(main())
