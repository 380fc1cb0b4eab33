"""The NumPy demo model: an MLP with a hand-written backward pass, trained by SGD.

A one-hidden-layer MLP (64 -> 64 tanh -> 10 softmax) on the UCI digits, for machines
without torch (`crossdevice demo --numpy`). Variables are `crossdevice.Variable`s made
under `strategy.scope()`; gradients are all-reduced with `ReplicaContext.all_reduce` and
applied in a `merge_call` through `strategy.extended.update` (what Keras' optimizer does
in `apply_gradients`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

import crossdevice
from crossdevice._cli.demo_common import Batch, TrainResult, fit
from crossdevice._data.digits import NUM_CLASSES, NUM_FEATURES

__all__ = ["HIDDEN_UNITS", "LEARNING_RATE", "init_params", "loss_and_grad_sums", "predict", "train"]

HIDDEN_UNITS: Final = 64
LEARNING_RATE: Final = 0.5
#: How `crossdevice demo` names this model and its optimizer.
DESCRIPTION: Final = f"NumPy MLP {NUM_FEATURES}-{HIDDEN_UNITS}-{NUM_CLASSES}"
OPTIMIZER: Final = f"SGD lr {LEARNING_RATE}"
DTYPE: Final = np.float32

Params = list[np.ndarray]


def init_params(seed: int, hidden: int = HIDDEN_UNITS) -> Params:
    """Initial `[w1, b1, w2, b2]` of the MLP (scaled normal weights, zero biases).

    Args:
        seed: the seed of the initialisation.
        hidden: the number of hidden units.

    Returns:
        `w1[64, hidden]`, `b1[hidden]`, `w2[hidden, 10]`, `b2[10]`, all float32.
    """
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((NUM_FEATURES, hidden)) / np.sqrt(NUM_FEATURES)
    w2 = rng.standard_normal((hidden, NUM_CLASSES)) / np.sqrt(hidden)
    return [
        w1.astype(DTYPE),
        np.zeros(hidden, DTYPE),
        w2.astype(DTYPE),
        np.zeros(NUM_CLASSES, DTYPE),
    ]


def _forward(params: Sequence[Any], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w1, b1, w2, b2 = (np.asarray(p) for p in params)
    hidden = np.tanh(x @ w1 + b1)
    return hidden, hidden @ w2 + b2


def predict(params: Sequence[Any], x: np.ndarray) -> np.ndarray:
    """The predicted class of each row of `x` (`[n, 64]` scaled pixels)."""
    return np.argmax(_forward(params, x)[1], axis=1)


def loss_and_grad_sums(
    params: Sequence[Any], x: np.ndarray, labels: np.ndarray
) -> tuple[np.ndarray, np.ndarray, Params]:
    """Per-example cross-entropy, correctness, and the gradient of the summed loss.

    The gradient is of `sum(losses)`, not the mean: the caller divides by the number of
    examples in the whole global batch, so that every replica's share adds up to the
    gradient of the global mean. An empty slice (a replica without data in the last
    step) gives empty losses and zero gradients.

    Args:
        params: `[w1, b1, w2, b2]`.
        x: `[n, 64]` scaled pixels.
        labels: `[n]` class ids.

    Returns:
        `(losses[n], correct[n], grads)` in the dtype of `w1`, with `correct` 1.0 where
        the prediction is right and `grads` shaped like `params`.
    """
    w1, _, w2, _ = (np.asarray(p) for p in params)
    dtype = w1.dtype
    hidden, logits = _forward(params, x)
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    rows = np.arange(len(labels))
    losses = np.log(total[:, 0]) - shifted[rows, labels]
    correct = (np.argmax(logits, axis=1) == labels).astype(dtype)
    # backward pass of sum(losses): softmax - onehot, then through the two layers
    d_logits = exp / total
    d_logits[rows, labels] -= 1.0
    d_hidden = (d_logits @ w2.T) * (1.0 - hidden * hidden)
    grads = [
        x.T @ d_hidden,
        d_hidden.sum(axis=0),
        hidden.T @ d_logits,
        d_logits.sum(axis=0),
    ]
    return losses.astype(dtype), correct, [g.astype(dtype, copy=False) for g in grads]


def train(
    strategy: Any,
    epochs: Sequence[Sequence[Batch]],
    seed: int,
    test: Batch,
    *,
    learning_rate: float = LEARNING_RATE,
    progress: Callable[..., Any] | None = None,
    report: Callable[[str], None] | None = None,
    label: str = "",
    checkpoint_dir: str | None = None,
) -> TrainResult:
    """Train the MLP with `strategy` on the given global batches, one list per epoch.

    Variables are made under `strategy.scope()`; each step all-reduces the summed
    gradients with `ReplicaContext.all_reduce` and applies them in a `merge_call`
    through `strategy.extended.update`, as Keras' optimizer does in `apply_gradients`.

    Args:
        strategy: a `crossdevice` strategy (MirroredStrategy, OneDeviceStrategy, ...).
        epochs: the global batches of each epoch.
        seed: the seed of the initial parameters (`init_params`).
        test: held-out `(x, labels)`, evaluated after every epoch.
        learning_rate: the SGD step size.
        progress: a `tqdm`-like factory (`progress(total=..., desc=...)`), or None.
        report: where to write the per-epoch lines, or None.
        label: a prefix for the progress bar.
        checkpoint_dir: checkpoint into (and resume from) this directory.

    Returns:
        A `TrainResult`.
    """
    with strategy.scope():
        variables = [
            crossdevice.Variable(p, name=name)
            for p, name in zip(init_params(seed), ("w1", "b1", "w2", "b2"), strict=True)
        ]

    def sgd(var: Any, grad: Any) -> Any:
        return var.assign_sub(learning_rate * grad)

    def apply_gradients(strategy: Any, grads_and_vars: Sequence[tuple[Any, Any]]) -> None:
        # Cross-replica context: update every component of each MirroredVariable with
        # its replica's (identical, all-reduced) gradient, as Keras' _distributed_apply.
        for grad, var in grads_and_vars:
            strategy.extended.update(var, sgd, args=(grad,), group=False)

    def step_fn(x: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ctx = crossdevice.get_replica_context()
        if ctx is None:  # cannot happen inside strategy.run; keeps the types honest
            raise RuntimeError("step_fn must run in a replica context, through strategy.run")
        losses, correct, grad_sums = loss_and_grad_sums(
            [v.read_value() for v in variables], x, labels
        )
        # One batched all-reduce: the summed gradients and the number of examples of
        # the global batch (which is short in the last step), then the global mean.
        count = np.asarray(len(labels), dtype=DTYPE)
        *summed, total = ctx.all_reduce(crossdevice.ReduceOp.SUM, [*grad_sums, count])
        grads = [g / total for g in summed]
        ctx.merge_call(apply_gradients, args=(list(zip(grads, variables, strict=True)),))
        return losses, correct

    def evaluate() -> float:
        params = [np.array(v.numpy()) for v in variables]
        return float(np.mean(predict(params, test[0]) == test[1]))

    def read_params() -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
        # Every replica's copy of every variable, to check they stayed identical.
        local = [strategy.experimental_local_results(v) for v in variables]
        replica_params = [
            [np.array(np.asarray(component)) for component in components]
            for components in zip(*local, strict=True)
        ]
        return [np.array(v.numpy()) for v in variables], replica_params

    return fit(
        strategy,
        epochs,
        step_fn,
        evaluate,
        read_params,
        progress=progress,
        report=report,
        label=label,
        checkpoint_dir=checkpoint_dir,
        objects={"variables": variables},
    )
