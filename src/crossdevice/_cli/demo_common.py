"""What both demo models share: the global batches, the training loop, its result.

The loop is a plain `tf.distribute` custom training loop: the global batches go through
`experimental_distribute_dataset`, a step function runs on every replica with
`strategy.run`, and per-example losses are reduced with
`strategy.reduce(MEAN, ..., axis=0)`, the correct mean also for the short last batch.
With a checkpoint directory, a `PreemptionCheckpointHandler` wraps each step: the job
saves every epoch, saves and exits on SIGTERM or Ctrl-C, and resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
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


class _Epochs:
    """The global batches of epoch `epoch` (the training loop sets it before each pass)."""

    def __init__(self, epochs: Sequence[Sequence[Batch]]) -> None:
        self.epochs = epochs
        self.epoch = 0

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.epochs[self.epoch])

    def __len__(self) -> int:
        return len(self.epochs[self.epoch])


def _direct(fn: Callable[..., float], *args: Any) -> float:
    return fn(*args)


def _checkpointing(
    directory: str | None, objects: Mapping[str, Any], report: Callable[[str], None] | None
) -> tuple[Callable[..., float], int, Callable[[], Any]]:
    """`(run, steps done, save)`: through a preemption handler saving into `directory`.

    SIGTERM (and Ctrl-C, made a SIGTERM) saves after the step, says so, and exits with
    the restart code; `save()` saves a periodic checkpoint.
    """
    if directory is None:
        return _direct, 0, lambda: None
    say = report if report is not None else _quiet
    checkpoint = crossdevice.train.Checkpoint(**objects)
    manager = crossdevice.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
    experimental = crossdevice.experimental

    def exit_fn() -> None:
        say(
            f"saved {manager.latest_checkpoint} at step {handler.total_run_calls}; run the "
            "same command to resume"
        )
        sys.exit(experimental.RESTART_EXIT_CODE)

    handler = experimental.PreemptionCheckpointHandler(
        None, manager, termination_config=experimental.TerminationConfig(exit_fn=exit_fn)
    )
    return handler.run, handler.total_run_calls, manager.save


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
    checkpoint_dir: str | None = None,
    objects: Mapping[str, Any] | None = None,
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
        checkpoint_dir: save into this directory (each epoch, and on SIGTERM or Ctrl-C,
            which then exit) and resume from it.
        objects: what to checkpoint besides the data position and the epoch's sums.

    Returns:
        A `TrainResult`.
    """
    num_train = sum(len(labels) for _, labels in epochs[0])
    result = TrainResult([], [], [], [], [], 0, 0.0)
    start = time.perf_counter()
    total_steps = sum(len(batches) for batches in epochs)
    mean, total = crossdevice.ReduceOp.MEAN, crossdevice.ReduceOp.SUM
    source = _Epochs(epochs)
    dist = strategy.experimental_distribute_dataset(source)
    # This epoch's sums so far: checkpointed, so a resumed epoch reports them whole.
    sums = crossdevice.Variable(np.zeros(2, np.float64), name="epoch_sums")

    def train_step(x: Any, labels: Any) -> float:
        losses, correct = strategy.run(step_fn, args=(x, labels))
        # MEAN over axis 0 divides by the examples actually present on all replicas,
        # so the short last batch gets its true mean (TF's rule).
        step = [float(strategy.reduce(total, v, axis=0)) for v in (losses, correct)]
        sums.assign_add(np.asarray(step, np.float64), read_value=False)
        return float(strategy.reduce(mean, losses, axis=0))

    tracked = {"data": dist, "sums": sums, **(objects or {})}
    run, done, save = _checkpointing(checkpoint_dir, tracked, report)
    if done and report is not None:
        where = f"epoch {dist.epoch + 1}" if dist.epoch < len(epochs) else "the end"
        report(f"{label}resumed at {where}, step {done} (from {checkpoint_dir})")
    bar = progress(total=total_steps, initial=done, desc=label, unit="step") if progress else None
    interrupt = _ctrl_c_as_sigterm() if checkpoint_dir is not None else None
    try:
        for epoch in range(dist.epoch, len(epochs)):
            source.epoch = epoch
            for x, labels in dist:
                step_loss = run(train_step, x, labels)
                result.steps += 1
                if bar is not None:
                    bar.set_postfix(epoch=f"{epoch + 1}/{len(epochs)}", loss=f"{step_loss:.4f}")
                    bar.update(1)
            test_accuracy = evaluate()
            loss_sum, num_correct = (float(v) for v in sums.numpy())
            sums.assign(np.zeros(2, np.float64), read_value=False)
            save()
            result.epoch_loss.append(loss_sum / num_train)
            result.epoch_accuracy.append(num_correct / num_train)
            result.test_accuracy.append(test_accuracy)
            if report is not None:
                report(
                    f"{label}epoch {epoch + 1:>3}/{len(epochs)}  loss {loss_sum / num_train:.4f}  "
                    f"accuracy {num_correct / num_train:.4f}  "
                    f"held-out accuracy {test_accuracy:.4f}"
                )
    finally:
        if interrupt is not None:
            signal.signal(signal.SIGINT, interrupt)
        if bar is not None:
            bar.close()
    if not result.test_accuracy:  # resumed a finished run: nothing left to train
        result.test_accuracy.append(evaluate())
    result.seconds = time.perf_counter() - start
    result.params, result.replica_params = read_params()
    return result


def _ctrl_c_as_sigterm() -> Any:
    """Make Ctrl-C a termination notice (save, then exit); returns the previous handler.

    Leaves SIGINT alone (returns None) off the main thread, and where the process was
    started with it ignored (`nohup`, a background job of a non-interactive shell), as
    Python itself leaves it.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return None
    return signal.signal(signal.SIGINT, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))


def _quiet(line: str) -> None:
    del line
