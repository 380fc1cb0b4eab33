"""`crossdevice demo`: train a digits classifier data-parallel with `MirroredStrategy`.

The program is a plain `tf.distribute` custom training loop with NumPy in place of
TensorFlow: variables made under `strategy.scope()`, a dataset distributed with
`experimental_distribute_dataset`, a step function run on every replica with
`strategy.run`, gradients all-reduced with `ReplicaContext.all_reduce` and applied in a
`merge_call` through `strategy.extended.update` (what Keras' optimizer does in
`apply_gradients`), and per-example losses reduced with `strategy.reduce(MEAN, ..., axis=0)`,
the correct mean also for the short last batch.

The model is a one-hidden-layer MLP (64 -> 64 tanh -> 10 softmax) with a hand-written
backward pass, trained by SGD on the UCI handwritten digits shipped in the package
(`crossdevice._data`). At the end the same global batches are replayed on a single
replica; the two runs must give the same parameters up to float32 rounding, because
data parallelism only changes the order in which per-example gradients are added.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from crossdevice._data.digits import NUM_CLASSES, NUM_FEATURES, load_digits, train_test_split

__all__ = [
    "Batch",
    "TrainResult",
    "epoch_batches",
    "init_params",
    "loss_and_grad_sums",
    "predict",
    "register",
    "run",
    "train",
]

DEFAULT_REPLICAS: Final = 4
DEFAULT_EPOCHS: Final = 10
DEFAULT_BATCH_SIZE: Final = 64
DEFAULT_SEED: Final = 0
HIDDEN_UNITS: Final = 64
LEARNING_RATE: Final = 0.5
TEST_FRACTION: Final = 0.2
#: The held-out accuracy the demo must reach (10 epochs of the defaults give about 0.96).
MIN_ACCURACY: Final = 0.90
DTYPE: Final = np.float32
#: Tolerance between data-parallel and single-replica parameters. Float32 sums added in
#: a different order differ by a few ulps; over 10 epochs of SGD the largest difference
#: measured is under 1e-6 for weights of size ~1 (4 and 16 replicas).
PARAM_RTOL: Final = 1e-4
PARAM_ATOL: Final = 1e-5

#: `--cross-device-ops` choices: the crossdevice class name for each (None: the default
#: MirroredStrategy picks, ReductionToOneDevice on CPU devices as in TF).
CROSS_DEVICE_OPS: Final[dict[str, str | None]] = {
    "default": None,
    "reduce_to_one": "ReductionToOneDevice",
    "hierarchical_copy": "HierarchicalCopyAllReduce",
    "nccl": "NcclAllReduce",
}

Batch = tuple[np.ndarray, np.ndarray]
Params = list[np.ndarray]


# --- the model: pure NumPy functions --------------------------------------------------


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


def epoch_batches(x: np.ndarray, labels: np.ndarray, batch_size: int, seed: int) -> list[Batch]:
    """The shuffled global batches of one epoch; the last one may be short.

    Args:
        x: `[n, 64]` inputs.
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


# --- training with a strategy ---------------------------------------------------------


@dataclasses.dataclass
class TrainResult:
    """What `train` returns: the final parameters, per-epoch metrics and timings."""

    params: Params
    replica_params: list[Params]
    epoch_loss: list[float]
    epoch_accuracy: list[float]
    test_accuracy: list[float]
    steps: int
    seconds: float


def train(
    strategy: Any,
    epochs: Sequence[Sequence[Batch]],
    initial_params: Params,
    test: Batch,
    *,
    learning_rate: float = LEARNING_RATE,
    progress: Callable[..., Any] | None = None,
    report: Callable[[str], None] | None = None,
    label: str = "",
) -> TrainResult:
    """Train the MLP with `strategy` on the given global batches, one list per epoch.

    Args:
        strategy: a `crossdevice` strategy (MirroredStrategy, OneDeviceStrategy, ...).
        epochs: the global batches of each epoch.
        initial_params: the starting `[w1, b1, w2, b2]`.
        test: held-out `(x, labels)`, evaluated after every epoch.
        learning_rate: the SGD step size.
        progress: a `tqdm`-like factory (`progress(total=..., desc=...)`), or None.
        report: where to write the per-epoch lines, or None.
        label: a prefix for the progress bar.

    Returns:
        A `TrainResult`.
    """
    import crossdevice

    with strategy.scope():
        variables = [
            crossdevice.Variable(p, name=name)
            for p, name in zip(initial_params, ("w1", "b1", "w2", "b2"), strict=True)
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

    num_train = sum(len(labels) for _, labels in epochs[0])
    result = TrainResult([], [], [], [], [], 0, 0.0)
    start = time.perf_counter()
    total_steps = sum(len(batches) for batches in epochs)
    bar = progress(total=total_steps, desc=label, unit="step") if progress else None
    try:
        for epoch, batches in enumerate(epochs, start=1):
            dist_batches = strategy.experimental_distribute_dataset(batches)
            loss_sum = 0.0
            num_correct = 0.0
            for x, labels in dist_batches:
                losses, correct = strategy.run(step_fn, args=(x, labels))
                # MEAN over axis 0 divides by the examples actually present on all
                # replicas, so the short last batch gets its true mean (TF's rule).
                step_loss = float(strategy.reduce(crossdevice.ReduceOp.MEAN, losses, axis=0))
                loss_sum += float(strategy.reduce(crossdevice.ReduceOp.SUM, losses, axis=0))
                num_correct += float(strategy.reduce(crossdevice.ReduceOp.SUM, correct, axis=0))
                result.steps += 1
                if bar is not None:
                    bar.set_postfix(epoch=f"{epoch}/{len(epochs)}", loss=f"{step_loss:.4f}")
                    bar.update(1)
            params = [np.array(v.numpy()) for v in variables]
            test_accuracy = float(np.mean(predict(params, test[0]) == test[1]))
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
    result.params = [np.array(v.numpy()) for v in variables]
    # Every replica's copy of every variable, to check they stayed identical.
    local = [strategy.experimental_local_results(v) for v in variables]
    result.replica_params = [
        [np.array(np.asarray(component)) for component in components]
        for components in zip(*local, strict=True)
    ]
    return result


# --- the command ----------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def register(subparsers: Any) -> None:
    """Add the `demo` subcommand to an `argparse` subparsers object.

    Args:
        subparsers: what `ArgumentParser.add_subparsers()` returned.
    """
    parser = subparsers.add_parser(
        "demo",
        help="train a digits classifier data-parallel on logical CPU replicas",
        description=(
            "Train an MLP on the UCI handwritten digits (shipped with crossdevice) with "
            "MirroredStrategy on N logical CPU replicas, then check that the parameters "
            "equal a single-replica run on the same global batches."
        ),
    )
    parser.add_argument(
        "--replicas",
        type=_positive_int,
        default=DEFAULT_REPLICAS,
        help=f"number of replicas (logical CPU devices; default {DEFAULT_REPLICAS})",
    )
    parser.add_argument(
        "--epochs",
        type=_positive_int,
        default=DEFAULT_EPOCHS,
        help=f"passes over the training set (default {DEFAULT_EPOCHS})",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=DEFAULT_BATCH_SIZE,
        help=f"global batch size, split across the replicas (default {DEFAULT_BATCH_SIZE})",
    )
    parser.add_argument(
        "--cross-device-ops",
        choices=sorted(CROSS_DEVICE_OPS),
        default="default",
        help="the CrossDeviceOps of the MirroredStrategy (default: the strategy's choice)",
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help="seed of split, init and shuffles"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument(
        "--multi-worker",
        action="store_true",
        help=(
            "run as one worker of a MultiWorkerMirroredStrategy job; launch with "
            "`torchrun --nproc-per-node 2 -m crossdevice demo --multi-worker` (or set "
            "TF_CONFIG in each process); --replicas is then the replicas per worker"
        ),
    )
    parser.set_defaults(func=run)


def _set_logical_cpus(n: int) -> None:
    import crossdevice

    config = crossdevice.config
    config.set_logical_cpu_devices(max(n, config.get_logical_cpu_devices()))


def _replicas(n: int) -> str:
    return f"{n} replica" if n == 1 else f"{n} replicas"


def _max_difference(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y), initial=0.0)) for x, y in zip(a, b, strict=True))


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when accuracy and the single-replica check pass, else 1.

    Args:
        args: the parsed `demo` arguments (`replicas`, `epochs`, `batch_size`,
            `cross_device_ops`, `seed`, `no_progress`).

    Returns:
        The exit status.
    """
    import crossdevice

    strategy: Any = None
    chief = True
    if getattr(args, "multi_worker", False):
        _set_logical_cpus(args.replicas)
        strategy = crossdevice.MultiWorkerMirroredStrategy(
            devices=[f"CPU:{i}" for i in range(args.replicas)]
        )
        chief = strategy.extended._worker_index == 0
    print = builtins.print if chief else _quiet  # only the chief reports
    progress: Callable[..., Any] | None = None
    report: Callable[[str], None] = print
    if not args.no_progress and chief:
        from tqdm import tqdm

        progress = tqdm
        report = tqdm.write  # prints above the bar instead of through it

    _set_logical_cpus(args.replicas)
    images, labels = load_digits()
    x = (images / 16.0).astype(DTYPE)
    seeds = np.random.SeedSequence(args.seed).generate_state(2)
    x_train, y_train, x_test, y_test = train_test_split(
        x, labels.astype(np.int64), TEST_FRACTION, int(seeds[0])
    )
    epochs = [
        epoch_batches(x_train, y_train, args.batch_size, int(seeds[1]) + epoch)
        for epoch in range(args.epochs)
    ]
    initial = init_params(args.seed)

    ops_name = CROSS_DEVICE_OPS[args.cross_device_ops]
    if strategy is None:
        cross_device_ops = getattr(crossdevice, ops_name)() if ops_name else None
        devices = [f"CPU:{i}" for i in range(args.replicas)]
        strategy = crossdevice.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
        where = f"MirroredStrategy on {_replicas(args.replicas)} (logical CPU devices; "
        where += f"{ops_name or 'the strategy' + chr(39) + 's default CrossDeviceOps'})"
    else:
        workers = strategy.num_replicas_in_sync // args.replicas
        where = (
            f"MultiWorkerMirroredStrategy: {workers} workers x {_replicas(args.replicas)} "
            "(torch.distributed, Gloo)"
        )
    total = strategy.num_replicas_in_sync
    print(
        f"crossdevice demo: MLP {NUM_FEATURES}-{HIDDEN_UNITS}-{NUM_CLASSES} on the UCI digits "
        f"({len(x_train)} training / {len(x_test)} held-out examples)\n"
        f"{where}, global batch {args.batch_size} "
        f"(~{args.batch_size / total:g} per replica), {args.epochs} epochs, "
        f"SGD lr {LEARNING_RATE}, seed {args.seed}",
        flush=True,
    )
    parallel = train(
        strategy,
        epochs,
        initial,
        (x_test, y_test),
        progress=progress,
        report=report,
        label=f"{_replicas(total)}: ",
    )
    final_accuracy = parallel.test_accuracy[-1]
    accuracy_ok = final_accuracy >= MIN_ACCURACY
    print(
        f"held-out accuracy: {final_accuracy:.4f} "
        f"({'ok' if accuracy_ok else 'FAILED'}: needs >= {MIN_ACCURACY:.2f})"
    )

    # The same global batches on one replica: only the summation order differs.
    single = train(
        crossdevice.OneDeviceStrategy("CPU:0"),
        epochs,
        initial,
        (x_test, y_test),
        progress=progress,
        label="1 replica (check): ",
    )
    difference = _max_difference(parallel.params, single.params)
    params_ok = all(
        np.allclose(a, b, rtol=PARAM_RTOL, atol=PARAM_ATOL)
        for a, b in zip(parallel.params, single.params, strict=True)
    )
    replicas_ok = all(
        all(np.array_equal(copy, copies[0]) for copy in copies)
        for copies in zip(*parallel.replica_params, strict=True)
    )
    print(
        f"single-replica check: max |{_replicas(total)} - 1 replica| = {difference:.3g} "
        f"over {sum(p.size for p in parallel.params)} parameters "
        f"(rtol {PARAM_RTOL:g}, atol {PARAM_ATOL:g}): "
        f"{'parameters match' if params_ok else 'MISMATCH'}"
    )
    print(
        f"replica copies: {'identical on all' if replicas_ok else 'DIVERGED across'} "
        f"{_replicas(args.replicas)}"
    )
    print(
        f"time: {_replicas(total)} {parallel.seconds:.2f} s ({parallel.steps} steps, "
        f"{parallel.steps / parallel.seconds:.0f} steps/s); "
        f"1 replica {single.seconds:.2f} s"
    )
    ok = accuracy_ok and params_ok and replicas_ok
    if not chief and not ok:  # a worker that disagrees says so, chief or not
        builtins.print(f"demo: FAILED on worker {strategy.extended._worker_index}")
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1


def _quiet(*args: Any, **kwargs: Any) -> None:
    """`print` for workers other than the chief: they train and check, silently."""
    del args, kwargs
