r"""Training that survives preemption and crashes: checkpoints, SIGTERM, automatic restart.

Run it on two workers under torchrun, which restarts the job when a worker fails:

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 \
        examples/preemption.py --checkpoint-dir /tmp/preemption

What happens:

* `PreemptionCheckpointHandler` restores the latest checkpoint in the directory when it
  is built (nothing the first time), so the same command starts or resumes the job.
* Every `--checkpoint-every` steps the manager saves model, optimizer, data position and
  random state (the chief writes, in the background).
* SIGTERM to any one worker (`kill -TERM <pid>`, or a cluster preempting the machine):
  after the current step every worker saves that same step and exits with code 42, and
  torchrun starts the job again, which resumes there.
* A worker that dies without warning (`kill -9`): the other one notices within seconds
  and exits with code 42 too, and the restarted job resumes from the last periodic
  checkpoint.

Either way the job finishes with the parameters an uninterrupted run ends with, bit for
bit. To watch it happen, let a worker preempt itself: `--preempt-worker 1
--preempt-at-step 20 --preempt-signal TERM` (or `KILL`) does it in the first launch only.
Without torchrun it runs as one process (MirroredStrategy) and SIGTERM works the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
from typing import Any

import numpy as np
import torch

import crossdevice
import crossdevice.torch as cdt
from crossdevice.datasets import load_digits


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint-dir", required=True, help="where checkpoints go")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--replicas", type=int, default=1, help="replicas per worker")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between saves")
    parser.add_argument("--preempt-worker", type=int, default=None, help="worker to preempt")
    parser.add_argument("--preempt-at-step", type=int, default=None)
    parser.add_argument("--preempt-signal", choices=["TERM", "KILL"], default="TERM")
    return parser.parse_args(argv)


def make_strategy(replicas: int) -> Any:
    """MultiWorkerMirroredStrategy under torchrun (or TF_CONFIG), else MirroredStrategy."""
    crossdevice.config.set_logical_cpu_devices(max(replicas, 2))
    devices = [f"CPU:{i}" for i in range(replicas)]
    if "RANK" in os.environ or "TF_CONFIG" in os.environ:
        return crossdevice.MultiWorkerMirroredStrategy(devices=devices)
    return crossdevice.MirroredStrategy(devices)


def main(argv: list[str] | None = None) -> str:
    """Train (or resume) to the end; returns the SHA-256 of the final parameters."""
    args = parse(argv)
    strategy = make_strategy(args.replicas)
    worker = int(os.environ.get("RANK", "0"))  # torchrun's rank of this worker
    torch.manual_seed(0)  # every worker alike: the same initial values and shuffles
    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.BatchNorm2d(16),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.2),
            torch.nn.Flatten(),
            torch.nn.Linear(16 * 8 * 8, 10),
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        model, optimizer = cdt.prepare(model, optimizer)

    images, labels = load_digits()
    data = torch.utils.data.TensorDataset(
        torch.from_numpy((images / 16.0).astype(np.float32)).reshape(-1, 1, 8, 8),
        torch.from_numpy(labels.astype(np.int64)),
    )
    # Shuffled from torch's global generator at each epoch's start; the checkpoint
    # recreates a resumed epoch's order and skips what was trained on.
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True)
    dist = strategy.experimental_distribute_dataset(loader)

    def step(x: Any, y: Any) -> Any:
        losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        optimizer.zero_grad()
        cdt.compute_average_loss(losses, global_batch_size=args.batch_size).backward()
        optimizer.step()
        return losses.detach()

    def train_step(x: Any, y: Any) -> Any:
        return strategy.run(step, args=(x, y))

    checkpoint = crossdevice.train.Checkpoint(model=model, optimizer=optimizer, data=dist)
    manager = crossdevice.train.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=2)
    handler = crossdevice.experimental.PreemptionCheckpointHandler(None, manager)
    resumed = handler.total_run_calls > 0
    if resumed:
        print(f"worker {worker}: resumed at epoch {dist.epoch}, step {handler.total_run_calls}")

    with handler.watch_preemption_scope():
        for _ in range(dist.epoch, args.epochs):
            for x, y in dist:
                handler.run(train_step, x, y)  # after a notice: save, exit(42)
                done = handler.total_run_calls
                if done % args.checkpoint_every == 0:
                    manager.save()
                if not resumed and worker == args.preempt_worker and done == args.preempt_at_step:
                    manager.sync()
                    os.kill(os.getpid(), getattr(signal, f"SIG{args.preempt_signal}"))
    manager.sync()
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().numpy().tobytes())
    if worker == 0:
        print(f"finished {handler.total_run_calls} steps; parameters {digest.hexdigest()}")
    return digest.hexdigest()


if __name__ == "__main__":
    main(sys.argv[1:])
