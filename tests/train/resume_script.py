"""A small training job that checkpoints, for the kill-and-resume tests.

    python -m tests.train.resume_script MODEL MODE DIR [--save-at K --kill-at M]

MODEL is `cnn` (a torch CNN with BatchNorm and Dropout, float32, mirrored with
`crossdevice.torch.prepare`, trained by Adam, data from a shuffling `DataLoader`) or
`numpy` (the NumPy MLP of `crossdevice demo --numpy`, data reshuffled from NumPy's global
generator every epoch). MODE is the replica execution, `threads` or `cooperative`. The
job trains 3 epochs on 2 replicas; with `--save-at K` it saves a checkpoint in DIR after
step K, and with `--kill-at M` it waits for that checkpoint to be on disk and kills
itself with SIGKILL after step M. Started again on DIR, it restores the latest
checkpoint and goes on. At the end it prints the SHA-256 of the parameters' bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import crossdevice as cd

EPOCHS = 3
BATCH = 16
EXAMPLES = 72  # 5 steps per epoch, the last one short


def _digest(arrays: list[np.ndarray]) -> str:
    hasher = hashlib.sha256()
    for array in arrays:
        hasher.update(np.ascontiguousarray(array).tobytes())
    return hasher.hexdigest()


class NumpyShuffled:
    """The digits' first EXAMPLES examples, reshuffled by NumPy's global generator."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        order = np.random.permutation(len(self.x))
        for start in range(0, len(order), BATCH):
            rows = order[start : start + BATCH]
            yield self.x[rows], self.y[rows]

    def __len__(self) -> int:
        return math.ceil(len(self.x) / BATCH)


def _digits() -> tuple[np.ndarray, np.ndarray]:
    images, labels = cd.datasets.load_digits()
    return (images[:EXAMPLES] / 16.0).astype(np.float32), labels[:EXAMPLES].astype(np.int64)


def _cnn(strategy: Any) -> tuple[dict[str, Any], Any, Callable[[], list[np.ndarray]]]:
    import torch

    import crossdevice.torch as cdt
    from tests.frameworks.helpers import bn_dropout_model

    torch.manual_seed(0)
    with strategy.scope():
        model = bn_dropout_model(torch)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, optimizer = cdt.prepare(model, optimizer)
    x, y = _digits()
    data = torch.utils.data.TensorDataset(
        torch.from_numpy(x).reshape(-1, 1, 8, 8), torch.from_numpy(y)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)

    def step(images: Any, labels: Any) -> Any:
        losses = torch.nn.functional.cross_entropy(model(images), labels, reduction="none")
        optimizer.zero_grad()
        cdt.compute_average_loss(losses, global_batch_size=BATCH).backward()
        optimizer.step()
        return losses.detach()

    def params() -> list[np.ndarray]:
        return [t.detach().numpy().copy() for t in model.state_dict().values()]

    return {"model": model, "optimizer": optimizer}, (loader, step), params


def _numpy(strategy: Any) -> tuple[dict[str, Any], Any, Callable[[], list[np.ndarray]]]:
    from crossdevice._cli import demo_numpy

    with strategy.scope():
        variables = [cd.Variable(p) for p in demo_numpy.init_params(0)]

    def apply(strategy: Any, pairs: list[tuple[Any, Any]]) -> None:
        for grad, var in pairs:
            strategy.extended.update(
                var, lambda v, g: v.assign_sub(demo_numpy.LEARNING_RATE * g), args=(grad,)
            )

    def step(x: np.ndarray, labels: np.ndarray) -> Any:
        ctx = cd.get_replica_context()
        losses, _, grads = demo_numpy.loss_and_grad_sums(
            [v.read_value() for v in variables], x, labels
        )
        *summed, total = ctx.all_reduce("sum", [*grads, np.float32(len(labels))])
        ctx.merge_call(
            apply, args=([(g / total, v) for g, v in zip(summed, variables, strict=True)],)
        )
        return losses

    def params() -> list[np.ndarray]:
        return [np.asarray(v.numpy()) for v in variables]

    return {"variables": variables}, (NumpyShuffled(*_digits()), step), params


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", choices=["cnn", "numpy"])
    parser.add_argument("mode", choices=["threads", "cooperative"])
    parser.add_argument("directory")
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--kill-at", type=int)
    args = parser.parse_args(argv)
    cd.config.set_replica_execution(args.mode)
    np.random.seed(1)
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    tracked, (data, step_fn), params = (_cnn if args.model == "cnn" else _numpy)(strategy)
    dist = strategy.experimental_distribute_dataset(data)
    step = cd.Variable(np.int64(0))
    ckpt = cd.train.Checkpoint(data=dist, step=step, **tracked)
    manager = cd.train.CheckpointManager(ckpt, args.directory, max_to_keep=2)
    if manager.restore_or_initialize() is not None:
        print(f"resumed at epoch {dist.epoch}, step {int(step.numpy())}", flush=True)
    for _ in range(dist.epoch, EPOCHS):
        for x, labels in dist:
            strategy.run(step_fn, args=(x, labels))
            step.assign_add(1)
            done = int(step.numpy())
            if done == args.save_at:
                manager.save()  # written in the background while training goes on
            if done == args.kill_at:
                manager.sync()
                os.kill(os.getpid(), signal.SIGKILL)
    digest = _digest(params())
    print(f"parameters {digest}", flush=True)
    return digest


if __name__ == "__main__":
    main()
