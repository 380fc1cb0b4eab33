"""`crossdevice demo`: train a digits classifier data-parallel with `MirroredStrategy`.

By default a PyTorch CNN (`demo_torch`): the model and its `torch.optim.Adam` optimizer
are mirrored with `crossdevice.torch.prepare`, and the step function is plain torch
(forward, `backward()`, `optimizer.step()`). `--numpy` trains the NumPy MLP of
`demo_numpy` instead, for machines without torch. The data are the UCI handwritten
digits shipped in the package (`crossdevice.datasets`). At the end the same global
batches are replayed on a single replica; the two runs must give the same parameters up
to float32 rounding, because data parallelism only changes the order in which
per-example gradients are added. With `--checkpoint-dir DIR` the run saves a checkpoint
every epoch; SIGTERM or Ctrl-C saves after the current step and exits (with
`crossdevice.experimental.RESTART_EXIT_CODE`, 42), and the same command resumes.
"""

from __future__ import annotations

import argparse
import builtins
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from crossdevice._cli.demo_common import TrainResult, epoch_batches
from crossdevice._cli.progress import progress_reporting
from crossdevice._cli.trace import add_trace_argument, tracing
from crossdevice.datasets import load_digits, train_test_split

__all__ = ["CROSS_DEVICE_OPS", "MIN_ACCURACY", "register", "run"]

DEFAULT_REPLICAS: Final = 4
DEFAULT_EPOCHS: Final = 10
DEFAULT_BATCH_SIZE: Final = 64
DEFAULT_SEED: Final = 0
TEST_FRACTION: Final = 0.2
#: How far a mixed-precision run's held-out accuracy may fall from float32's (#27).
MIXED_PRECISION_ACCURACY = 0.005

#: The held-out accuracy each demo model must reach (10 epochs of the defaults give about
#: 0.97 for the CNN and 0.96 for the MLP).
MIN_ACCURACY: Final = {"torch": 0.95, "numpy": 0.90}
DTYPE: Final = np.float32
#: Tolerance between data-parallel and single-replica parameters. Float32 sums added in
#: a different order differ by a few ulps; over 10 epochs the largest difference measured
#: is 1.4e-6 for the CNN (Adam) and under 1e-6 for the MLP (SGD), weights of size ~1.
PARAM_RTOL: Final = 1e-4
PARAM_ATOL: Final = 1e-5

#: `--cross-device-ops` choices: the crossdevice class name for each (None: the
#: strategy's default, HostAllReduce on CPU devices).
CROSS_DEVICE_OPS: Final[dict[str, str | None]] = {
    "default": None,
    "reduce_to_one": "ReductionToOneDevice",
    "hierarchical_copy": "HierarchicalCopyAllReduce",
    "nccl": "NcclAllReduce",
}


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
            "Train a PyTorch CNN (or, with --numpy, a NumPy MLP) on the UCI handwritten "
            "digits (shipped with crossdevice) with MirroredStrategy on N logical CPU "
            "replicas, then check that the parameters equal a single-replica run on the "
            "same global batches."
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
        "--mixed-precision",
        choices=["bf16"],
        default=None,
        help=(
            "torch model: forward passes under bfloat16 autocast; the check then compares "
            "the held-out accuracy with a float32 run (within half a point)"
        ),
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help=(
            "save a checkpoint here every epoch; SIGTERM or Ctrl-C saves and exits, and the "
            "same command resumes where it stopped"
        ),
    )
    parser.add_argument(
        "--numpy",
        action="store_true",
        help="train the NumPy MLP instead of the torch CNN (no torch needed)",
    )
    parser.add_argument(
        "--multi-worker",
        action="store_true",
        help=(
            "run as one worker of a MultiWorkerMirroredStrategy job; launch with "
            "`torchrun --nproc-per-node 2 -m crossdevice demo --multi-worker` (or set "
            "TF_CONFIG in each process); --replicas is then the replicas per worker"
        ),
    )
    add_trace_argument(parser)
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
            `cross_device_ops`, `seed`, `no_progress`, `numpy`, `multi_worker`,
            `checkpoint_dir`, `mixed_precision`, `trace`).

    Returns:
        The exit status.
    """
    import crossdevice

    kind = "numpy" if getattr(args, "numpy", False) else "torch"
    trainer = _trainer(kind)
    strategy: Any = None
    chief = True
    if getattr(args, "multi_worker", False):
        _set_logical_cpus(args.replicas)
        strategy = crossdevice.MultiWorkerMirroredStrategy(
            devices=[f"CPU:{i}" for i in range(args.replicas)]
        )
        chief = strategy.extended._worker_index == 0
    print = builtins.print if chief else _quiet  # only the chief reports
    progress, report = progress_reporting(enabled=chief and not args.no_progress)
    if not chief:
        report = _quiet

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
        f"crossdevice demo: {trainer.DESCRIPTION} on the UCI digits "
        f"({len(x_train)} training / {len(x_test)} held-out examples)\n"
        f"{where}, global batch {args.batch_size} "
        f"(~{args.batch_size / total:g} per replica), {args.epochs} epochs, "
        f"{trainer.OPTIMIZER}, seed {args.seed}",
        flush=True,
    )
    test = (x_test, y_test)
    mixed_precision, precision = _precision(args, kind)
    with tracing(getattr(args, "trace", None), quiet=not chief):  # the data-parallel run only
        parallel = trainer.train(
            strategy,
            epochs,
            args.seed,
            test,
            progress=progress,
            report=report,
            label=f"{_replicas(total)}: ",
            checkpoint_dir=getattr(args, "checkpoint_dir", None),
            **precision,
        )
    minimum = MIN_ACCURACY[kind]
    final_accuracy = parallel.test_accuracy[-1]
    accuracy_ok = final_accuracy >= minimum
    print(
        f"held-out accuracy: {final_accuracy:.4f} "
        f"({'ok' if accuracy_ok else 'FAILED'}: needs >= {minimum:.2f})"
    )

    # The same global batches on one replica: only the summation order differs.
    single = trainer.train(
        crossdevice.OneDeviceStrategy("CPU:0"),
        epochs,
        args.seed,
        test,
        progress=progress,
        label="1 replica (check): ",
    )
    if mixed_precision is None:
        ok = _report_check(print, parallel, single, total, args.replicas) and accuracy_ok
    else:
        ok = _report_precision(print, parallel, single, mixed_precision) and accuracy_ok
    if not chief and not ok:  # a worker that disagrees says so, chief or not
        builtins.print(f"demo: FAILED on worker {strategy.extended._worker_index}")
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1


def _precision(args: argparse.Namespace, kind: str) -> tuple[str | None, dict[str, str]]:
    """`--mixed-precision` (or None), and the keyword that asks the trainer for it."""
    mixed_precision = getattr(args, "mixed_precision", None)
    if mixed_precision is not None and kind != "torch":
        raise SystemExit("--mixed-precision applies to the torch model, not --numpy")
    return mixed_precision, {} if mixed_precision is None else {"mixed_precision": mixed_precision}


def _trainer(kind: str) -> Any:
    """The demo module of `kind` ("torch" or "numpy"); torch missing is a clear error."""
    if kind == "numpy":
        from crossdevice._cli import demo_numpy

        return demo_numpy
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit(
            "crossdevice demo trains a PyTorch model, and torch is not installed: "
            "pip install torch==2.13.0 (the CPU build), or run `crossdevice demo --numpy` "
            "for the NumPy model"
        ) from None
    from crossdevice._cli import demo_torch

    return demo_torch


def _report_check(
    print: Callable[..., None],
    parallel: TrainResult,
    single: TrainResult,
    total: int,
    local: int,
) -> bool:
    """Print the single-replica comparison and the replica-copy check; True if both hold."""
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
        f"{_replicas(local)} of this worker"
    )
    print(
        f"time: {_replicas(total)} {parallel.seconds:.2f} s ({parallel.steps} steps, "
        f"{parallel.steps / parallel.seconds:.0f} steps/s); "
        f"1 replica {single.seconds:.2f} s"
    )
    return params_ok and replicas_ok


def _report_precision(
    print: Callable[..., None], parallel: TrainResult, single: TrainResult, precision: str
) -> bool:
    """Compare a mixed-precision run's accuracy with float32's; True within half a point."""
    lost = single.test_accuracy[-1] - parallel.test_accuracy[-1]
    replicas_ok = all(
        all(np.array_equal(copy, copies[0]) for copy in copies)
        for copies in zip(*parallel.replica_params, strict=True)
    )
    ok = abs(lost) <= MIXED_PRECISION_ACCURACY and replicas_ok
    print(
        f"{precision} check: held-out accuracy {parallel.test_accuracy[-1]:.4f} against "
        f"float32's {single.test_accuracy[-1]:.4f} on 1 replica "
        f"({'within' if abs(lost) <= MIXED_PRECISION_ACCURACY else 'NOT within'} "
        f"{MIXED_PRECISION_ACCURACY * 100:g} points); replica copies "
        f"{'identical' if replicas_ok else 'DIVERGED'}"
    )
    return ok


def _quiet(*args: Any, **kwargs: Any) -> None:
    """`print` for workers other than the chief: they train and check, silently."""
    del args, kwargs
