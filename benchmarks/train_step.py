"""Epoch time of one torch training loop three ways: crossdevice, torch DDP, plain torch.

The same model (the CNN of TF's custom-training tutorial, on its 28x28 inputs, synthetic
data), the same Adam optimizer and the same global batches, per round:

* crossdevice: `MirroredStrategy` on 4 logical CPU replicas, the model and optimizer
  mirrored with `crossdevice.torch.prepare`, the step run with `strategy.run` on
  batches from `experimental_distribute_dataset` (the user's path, all of it);
* DDP: 4 processes on Gloo, one torch thread each (torchrun's default), each process
  its slice of every global batch;
* torch: one process, the whole global batch per step, torch's own thread count.

The three take turns, one epoch each per round (A B C A B C ...), and the report gives
each one's median epoch time and the medians of the per-round ratios. Run it with

    python -m benchmarks.train_step --per-replica 16 64 --rounds 7
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import time
from typing import Any

import numpy as np

REPLICAS = 4


#: Fashion-MNIST's shape, the input of TF's tutorial (synthetic here: nothing is downloaded).
IMAGE_SIZE = 28
EXAMPLES = 2048


def _model(torch: Any) -> Any:
    """TF's tutorial CNN as written there (valid convolutions), for 28x28 inputs."""
    torch.manual_seed(0)
    flat = 64 * ((((IMAGE_SIZE - 2) // 2) - 2) // 2) ** 2
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(flat, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    images = rng.random((EXAMPLES, 1, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    return images, rng.integers(0, 10, EXAMPLES).astype(np.int64)


def _global_batches(x: np.ndarray, y: np.ndarray, size: int) -> list[tuple[Any, Any]]:
    import torch

    full = len(x) // size * size  # whole batches only: every variant splits them evenly
    return [
        (torch.from_numpy(x[i : i + size]), torch.from_numpy(y[i : i + size]))
        for i in range(0, full, size)
    ]


def tutorial_step(model: Any, optimizer: Any, size: int) -> Any:
    """The tutorial's step on a strategy: per-example loss scaled by the global `size`."""
    import torch

    import crossdevice.torch as cdt

    def step(inputs: Any) -> Any:
        bx, by = inputs
        per_example = torch.nn.functional.cross_entropy(model(bx), by, reduction="none")
        loss = cdt.compute_average_loss(per_example, global_batch_size=size)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


# --- DDP workers ------------------------------------------------------------------------
def _ddp_worker(rank: int, port: int, conn: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=REPLICAS
    )
    model = torch.nn.parallel.DistributedDataParallel(_model(torch))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    x, y = _data()
    cache: dict[int, list[tuple[Any, Any]]] = {}
    while True:
        per_replica = conn.recv()
        if per_replica is None:
            break
        if per_replica not in cache:
            batches = _global_batches(x, y, per_replica * REPLICAS)
            cache[per_replica] = [
                (bx[rank::REPLICAS].contiguous(), by[rank::REPLICAS].contiguous())
                for bx, by in batches
            ]
        dist.barrier()
        start = time.perf_counter()
        for bx, by in cache[per_replica]:
            loss = torch.nn.functional.cross_entropy(model(bx), by)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        dist.barrier()
        conn.send(time.perf_counter() - start)
    dist.destroy_process_group()


class _DDP:
    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.conns = []
        self.procs = []
        for rank in range(REPLICAS):
            parent, child = context.Pipe()
            proc = context.Process(target=_ddp_worker, args=(rank, port, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def epoch(self, per_replica: int) -> float:
        for conn in self.conns:
            conn.send(per_replica)
        times = []
        for conn in self.conns:
            if not conn.poll(600):
                raise RuntimeError("a DDP worker did not answer within 600 s")
            times.append(conn.recv())
        return float(times[0])

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


# --- in-process variants ----------------------------------------------------------------
class _Crossdevice:
    def __init__(self, **prepare: Any) -> None:
        import torch

        import crossdevice
        import crossdevice.torch as cdt

        crossdevice.config.set_logical_cpu_devices(REPLICAS)
        self.strategy = crossdevice.MirroredStrategy([f"CPU:{i}" for i in range(REPLICAS)])
        with self.strategy.scope():
            model = _model(torch)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
            self.model, self.optimizer = cdt.prepare(model, optimizer, **prepare)
        self.threads = torch.get_num_threads()  # the policy's choice
        self.x, self.y = _data()
        self.cache: dict[int, list[tuple[Any, Any]]] = {}

    def epoch(self, per_replica: int) -> float:
        import torch

        torch.set_num_threads(self.threads)
        size = per_replica * REPLICAS
        batches = self.cache.setdefault(per_replica, _global_batches(self.x, self.y, size))
        step = tutorial_step(self.model, self.optimizer, size)
        start = time.perf_counter()
        for inputs in self.strategy.experimental_distribute_dataset(batches):
            self.strategy.run(step, args=(inputs,))
        return time.perf_counter() - start


class _Torch:
    def __init__(self, threads: int) -> None:
        import torch

        self.threads = threads
        self.model = _model(torch)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3, eps=1e-7)
        self.x, self.y = _data()
        self.cache: dict[int, list[tuple[Any, Any]]] = {}

    def epoch(self, per_replica: int) -> float:
        import torch

        torch.set_num_threads(self.threads)
        size = per_replica * REPLICAS
        batches = self.cache.setdefault(per_replica, _global_batches(self.x, self.y, size))
        start = time.perf_counter()
        for bx, by in batches:
            loss = torch.nn.functional.cross_entropy(self.model(bx), by)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-replica", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per batch size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument(
        "--crossdevice",
        nargs="+",
        default=["default"],
        metavar="CONFIG",
        help="crossdevice variants to take turns with the others: 'default', or "
        "comma-separated prepare() options such as threads_per_replica=0 or "
        "bucket_cap_bytes=131072 (the first is the one the ratios use)",
    )
    args = parser.parse_args(argv)
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"# train_step: TF tutorial CNN on {IMAGE_SIZE}x{IMAGE_SIZE}, Adam, {EXAMPLES} examples; "
        f"{REPLICAS} replicas; torch "
        f"{torch.__version__}; {cores} cores; medians of {args.rounds} interleaved rounds"
    )
    ddp = _DDP()
    try:
        variants: dict[str, Any] = {}
        for config in args.crossdevice:
            options = {}
            if config != "default":
                for item in config.split(","):
                    key, value = item.split("=")
                    options[key] = int(value)
            name = "crossdevice" if not variants else f"crossdevice[{config}]"
            variants[name] = _Crossdevice(**options)
        variants["ddp"] = ddp
        variants["torch"] = _Torch(cores or 1)
        for per_replica in args.per_replica:
            times: dict[str, list[float]] = {name: [] for name in variants}
            for round_ in range(args.warmup + args.rounds):
                for name, variant in variants.items():
                    seconds = variant.epoch(per_replica)
                    if round_ >= args.warmup:
                        times[name].append(seconds)
            cd, dd, tt = times["crossdevice"], times["ddp"], times["torch"]
            vs_ddp = statistics.median(a / b for a, b in zip(cd, dd, strict=True))
            vs_torch = statistics.median(a / b for a, b in zip(cd, tt, strict=True))
            steps = len(_global_batches(*_data(), per_replica * REPLICAS))
            print(
                f"batch {per_replica}/replica ({steps} steps/epoch): epoch crossdevice "
                f"{statistics.median(cd) * 1e3:.1f} ms, DDP {statistics.median(dd) * 1e3:.1f} ms, "
                f"torch {statistics.median(tt) * 1e3:.1f} ms; crossdevice/DDP {vs_ddp:.3f}, "
                f"crossdevice/torch {vs_torch:.3f} (median per-round ratios; min-max "
                f"{min(a / b for a, b in zip(cd, dd, strict=True)):.3f}-"
                f"{max(a / b for a, b in zip(cd, dd, strict=True)):.3f} vs DDP)",
                flush=True,
            )
            for name, seconds_list in times.items():
                if name.startswith("crossdevice["):
                    ratio = statistics.median(a / b for a, b in zip(seconds_list, cd, strict=True))
                    print(
                        f"  {name}: {statistics.median(seconds_list) * 1e3:.1f} ms, "
                        f"{ratio:.3f}x the default (median per-round ratio)",
                        flush=True,
                    )
    finally:
        ddp.close()


if __name__ == "__main__":
    main()
