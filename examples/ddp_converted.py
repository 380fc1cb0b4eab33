"""A torch DDP training script, converted to crossdevice line by line.

The DDP original (launched with `torchrun --nproc-per-node 4 train.py`) is the usual
one: one process per replica, the model wrapped in `DistributedDataParallel`, a
`DistributedSampler` sharding the data, each process computing the mean loss of its
own batch (DDP averages gradients). The crossdevice version runs the 4 replicas as
threads of one process (`MirroredStrategy`), or across processes with
`--multi-worker` under the same torchrun, and keeps DDP's loss convention with
`gradient_reduction="mean"`. Lines that differ carry a `# DDP:` comment with the line
they replace.

    python examples/ddp_converted.py --replicas 4 --epochs 5
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

import crossdevice  # DDP: import torch.distributed as dist
import crossdevice.torch
from crossdevice.datasets import load_digits, train_test_split


class Net(torch.nn.Module):
    """A small MLP with BatchNorm and Dropout (both handled per replica)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(64, 128),
            torch.nn.BatchNorm1d(128),  # running stats: averaged across replicas each step
            torch.nn.ReLU(),
            torch.nn.Dropout(0.2),  # each replica draws its own masks, reproducibly
            torch.nn.Linear(128, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for `[batch, 64]` pixels."""
        return self.layers(x)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; returns the final parameters of every replica and the test accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per replica, as in DDP")
    parser.add_argument("--multi-worker", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    say = (lambda *_: None) if args.quiet else print

    # DDP: dist.init_process_group("gloo"); rank = dist.get_rank()
    crossdevice.config.set_logical_cpu_devices(max(2, args.replicas))
    devices = [f"CPU:{i}" for i in range(args.replicas)]
    if args.multi_worker:
        strategy: crossdevice.Strategy = crossdevice.MultiWorkerMirroredStrategy(devices=devices)
    else:
        strategy = crossdevice.MirroredStrategy(devices)
    torch.manual_seed(0)

    images, labels = load_digits()
    x_train, y_train, x_test, y_test = train_test_split(images, labels, 0.2, seed=0)
    x_train = torch.from_numpy(x_train / np.float32(16))
    y_train = torch.from_numpy(y_train.astype(np.int64))

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    # DDP: model = DistributedDataParallel(model)
    model, optimizer = crossdevice.torch.prepare(
        model, optimizer, strategy=strategy, gradient_reduction="mean"
    )

    def train_step(inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xb, yb = inputs
        loss = torch.nn.functional.cross_entropy(model(xb), yb)  # this replica's mean
        optimizer.zero_grad()
        loss.backward()  # DDP: the same: gradients are averaged across replicas here
        optimizer.step()
        return loss.detach()

    global_batch = args.batch_size * strategy.num_replicas_in_sync
    for epoch in range(args.epochs):
        # DDP: sampler.set_epoch(epoch); for xb, yb in DataLoader(..., sampler=sampler):
        order = torch.from_numpy(np.random.default_rng(epoch).permutation(len(y_train)))
        batches = [
            (x_train[order[i : i + global_batch]], y_train[order[i : i + global_batch]])
            for i in range(0, len(order), global_batch)
        ]
        losses = []
        for inputs in strategy.experimental_distribute_dataset(batches):
            per_replica = strategy.run(train_step, args=(inputs,))  # DDP: train_step(xb, yb)
            losses.append(float(strategy.reduce("mean", per_replica, axis=None)))
        scheduler.step()
        say(f"epoch {epoch + 1}: loss {np.mean(losses):.4f}, lr {scheduler.get_last_lr()[0]:g}")

    model.eval()  # DDP: model.eval() (evaluated on rank 0 only)
    with torch.no_grad():
        logits = model(torch.from_numpy(x_test / np.float32(16)))
    accuracy = float((logits.argmax(1).numpy() == y_test).mean())
    say(f"held-out accuracy {accuracy:.4f}")
    # DDP: torch.save(model.module.state_dict(), ...) on rank 0; here the state is replica 0's
    return {
        "accuracy": accuracy,
        "state_dict": {k: v.clone() for k, v in model.state_dict().items()},
        "replica_params": [[p.detach().clone() for p in r.parameters()] for r in model.replicas],
    }


if __name__ == "__main__":
    main()
