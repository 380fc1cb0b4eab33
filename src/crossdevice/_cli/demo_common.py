"""What both demo models share: the global batches, the training loop, its result.

The loop is a plain `tf.distribute` custom training loop: each epoch's global batches
go through `experimental_distribute_dataset`, a step function runs on every replica
with `strategy.run`, and per-example losses are reduced with
`strategy.reduce(MEAN, ..., axis=0)`, the correct mean also for the short last batch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import crossdevice

__all__ = ["Batch", "TrainResult", "epoch_batches", "fit"]

Batch = tuple[Any, Any]


@dataclasses.dataclass
class TrainResult:
    """What a demo training run returns: final parameters, per-epoch metrics, timings."""

    params: list[np.ndarray]
    replica_params: list[list[np.ndarray]]
    epoch_loss: list[float]
    epoch_accuracy: list[float]
    test_accuracy: list[float]
    steps: int
    seconds: float


def epoch_batches(x: np.ndarray, labels: np.ndarray, batch_size: int, seed: int) -> list[Batch]:
    """The shuffled global batches of one epoch; the last one may be short.

    Args:
        x: `[n, ...]` inputs.
        labels: `[n]` class ids.
        batch_size: the global batch size.
        seed: the seed of this epoch's shuffle.

    Returns:
        A list of `(x_batch, labels_batch)`.
    """
    order = np.random.default_rng(seed).permutation(len(x))
    return [
        (x[order[i : i + batch_size]], labels[order[i : i + batch_size]])
        for i in range(0, len(x), batch_size)
    ]


def fit(
    strategy: crossdevice.Strategy,
    epochs: Sequence[Sequence[Batch]],
    step_fn: Callable[[Any, Any], tuple[Any, Any]],
    evaluate: Callable[[], float],
    read_params: Callable[[], tuple[list[np.ndarray], list[list[np.ndarray]]]],
    *,
    progress: Callable[..., Any] | None = None,
    report: Callable[[str], None] | None = None,
    label: str = "",
) -> TrainResult:
    """Train with `strategy`: `step_fn(x, labels) -> (losses, correct)` on every replica.

    Args:
        strategy: the strategy.
        epochs: the global batches of each epoch.
        step_fn: one training step of one replica; returns its per-example losses and a
            per-example 1.0/0.0 correctness.
        evaluate: the held-out accuracy now (called after every epoch).
        read_params: `(parameters, every replica's copy of them)` as NumPy arrays.
        progress: a `tqdm`-like factory (`progress(total=..., desc=...)`), or None.
        report: where to write the per-epoch lines, or None.
        label: a prefix for the progress bar.

    Returns:
        A `TrainResult`.
    """
    num_train = sum(len(labels) for _, labels in epochs[0])
    result = TrainResult([], [], [], [], [], 0, 0.0)
    start = time.perf_counter()
    total_steps = sum(len(batches) for batches in epochs)
    bar = progress(total=total_steps, desc=label, unit="step") if progress else None
    mean, total = crossdevice.ReduceOp.MEAN, crossdevice.ReduceOp.SUM
    try:
        for epoch, batches in enumerate(epochs, start=1):
            loss_sum = 0.0
            num_correct = 0.0
            for x, labels in strategy.experimental_distribute_dataset(batches):
                losses, correct = strategy.run(step_fn, args=(x, labels))
                # MEAN over axis 0 divides by the examples actually present on all
                # replicas, so the short last batch gets its true mean (TF's rule).
                step_loss = float(strategy.reduce(mean, losses, axis=0))
                loss_sum += float(strategy.reduce(total, losses, axis=0))
                num_correct += float(strategy.reduce(total, correct, axis=0))
                result.steps += 1
                if bar is not None:
                    bar.set_postfix(epoch=f"{epoch}/{len(epochs)}", loss=f"{step_loss:.4f}")
                    bar.update(1)
            test_accuracy = evaluate()
            result.epoch_loss.append(loss_sum / num_train)
            result.epoch_accuracy.append(num_correct / num_train)
            result.test_accuracy.append(test_accuracy)
            if report is not None:
                report(
                    f"{label}epoch {epoch:>3}/{len(epochs)}  loss {loss_sum / num_train:.4f}  "
                    f"accuracy {num_correct / num_train:.4f}  "
                    f"held-out accuracy {test_accuracy:.4f}"
                )
    finally:
        if bar is not None:
            bar.close()
    result.seconds = time.perf_counter() - start
    result.params, result.replica_params = read_params()
    return result
