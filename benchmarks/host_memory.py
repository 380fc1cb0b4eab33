"""Step time and peak memory of a 25M-parameter MLP on host replicas, four ways.

The model of #27: six 2048-wide linear layers (25.2M parameters) with ReLU, trained with
Adam on global batches of 256, on 2 cores. Each configuration runs in its own process;
the configurations take turns, in an order that changes from round to round so that each
comes right after each other equally often (`_launch.balanced_orders`); each run reports
its median step time over the timed steps and its peak resident memory (`getrusage`):

* torch: one process, the whole global batch per step, torch's own thread count;
* shared: `crossdevice.torch.prepare` on 4 CPU replicas, parameters and optimizer state
  stored once (the default on the CPU);
* copies: the same with `share_storage=False` (one copy per replica, as before #27);
* ddp: torch DDP, 4 Gloo processes, one torch thread each (peak memory: their sum).

    python -m benchmarks.host_memory --rounds 3 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks._launch import balanced_orders

WIDTH = 2048
LAYERS = 6
GLOBAL_BATCH = 256
REPLICAS = 4
KINDS = ("torch", "shared", "copies", "ddp")


def _model(torch: Any) -> Any:
    layers: list[Any] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _batches(torch: Any, steps: int) -> list[Any]:
    generator = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(GLOBAL_BATCH, WIDTH, generator=generator),
            torch.randn(GLOBAL_BATCH, WIDTH, generator=generator),
        )
        for _ in range(steps)
    ]


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _run_torch(steps: int, warmup: int) -> dict[str, float]:
    import torch

    torch.manual_seed(0)
    model = _model(torch)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    times = []
    for i, (x, y) in enumerate(_batches(torch, steps + warmup)):
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return {"step": statistics.median(times), "peak_mb": _peak_mb()}


def _run_crossdevice(steps: int, warmup: int, shared: bool) -> dict[str, float]:
    import torch

    import crossdevice
    import crossdevice.torch as cdt

    crossdevice.config.set_logical_cpu_devices(REPLICAS)
    strategy = crossdevice.MirroredStrategy([f"CPU:{i}" for i in range(REPLICAS)])
    torch.manual_seed(0)
    with strategy.scope():
        net = _model(torch)
        model, optimizer = cdt.prepare(
            net,
            torch.optim.Adam(net.parameters(), lr=1e-4),
            share_storage=shared,
        )

    def step(x: Any, y: Any) -> None:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum")
        (loss / (GLOBAL_BATCH * WIDTH)).backward()
        optimizer.step()

    times = []
    batches = _batches(torch, steps + warmup)
    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(batches)):
        start = time.perf_counter()
        strategy.run(step, args=(x, y))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return {"step": statistics.median(times), "peak_mb": _peak_mb()}


def _ddp_worker(rank: int, port: int, steps: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=REPLICAS
    )
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_model(torch))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    share = GLOBAL_BATCH // REPLICAS
    times = []
    for i, (inputs, targets) in enumerate(_batches(torch, steps + warmup)):
        x = inputs[rank * share : (rank + 1) * share]
        y = targets[rank * share : (rank + 1) * share]
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"step": statistics.median(times), "peak_mb": _peak_mb()}, f)


def _run_ddp(steps: int, warmup: int) -> dict[str, float]:
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp")
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.host_memory",
                    "--ddp-rank",
                    str(r),
                    "--port",
                    str(port),
                    "--steps",
                    str(steps),
                    "--warmup",
                    str(warmup),
                    "--out",
                    out,
                ]
            )
            for r in range(REPLICAS)
        ]
        for p in procs:
            p.wait(timeout=900)
        results = []
        for r in range(REPLICAS):
            with open(f"{out}.{r}") as f:
                results.append(json.load(f))
    return {
        "step": max(r["step"] for r in results),
        "peak_mb": sum(r["peak_mb"] for r in results),
    }


def _one(kind: str, steps: int, warmup: int) -> dict[str, float]:
    if kind == "torch":
        return _run_torch(steps, warmup)
    if kind == "ddp":
        return _run_ddp(steps, warmup)
    return _run_crossdevice(steps, warmup, kind == "shared")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--ddp-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_rank is not None:
        _ddp_worker(args.ddp_rank, args.port, args.steps, args.warmup, args.out)
        return
    if args.one is not None:
        print(json.dumps(_one(args.one, args.steps, args.warmup)))
        return
    results: dict[str, list[dict[str, float]]] = {k: [] for k in args.kinds}
    # Each kind right after each other equally often: the run before a timed one moves it.
    orders = balanced_orders(len(args.kinds))
    for r in range(args.rounds):
        for kind in (args.kinds[k] for k in orders[r % len(orders)]):
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.host_memory",
                    "--one",
                    kind,
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                ],
                capture_output=True,
                text=True,
                timeout=1800,
                check=True,
            )
            results[kind].append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = results.get("torch")
    header = ("step s (median)", "peak RSS GB", "step / torch [min, max]", "RSS / torch")
    print(f"{'':8} {header[0]:>16} {header[1]:>12} {header[2]:>24} {header[3]:>12}")
    for kind, runs in results.items():
        step = statistics.median(r["step"] for r in runs)
        peak = statistics.median(r["peak_mb"] for r in runs) / 1024
        line = f"{kind:8} {step:16.3f} {peak:12.2f}"
        if base:
            ratios = [r["step"] / b["step"] for r, b in zip(runs, base, strict=True)]
            memory = [r["peak_mb"] / b["peak_mb"] for r, b in zip(runs, base, strict=True)]
            spread = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"
            line += f" {spread:>24} {statistics.median(memory):12.2f}"
        print(line)


if __name__ == "__main__":
    main()
