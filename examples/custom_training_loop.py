r"""TF's "Custom training with tf.distribute.Strategy" tutorial, ported to PyTorch + crossdevice.

The TensorFlow tutorial trains a small CNN with a custom training loop under
`tf.distribute.MirroredStrategy`. This is the same program, line by line, on the UCI
digits shipped with crossdevice (8x8 images instead of Fashion-MNIST's 28x28). A line
that differs from TF carries a `# TF:` comment with the TF line it replaces. Run it with

    python examples/custom_training_loop.py                    # 4 CPU replicas
    python examples/custom_training_loop.py --strategy one_device
    python examples/custom_training_loop.py --device-type GPU  # GPU:0..3 (logical GPUs
                                                # on a host with fewer than 4)
    torchrun --standalone --nproc-per-node 2 examples/custom_training_loop.py \\
        --strategy multi_worker --replicas 2                    # 2 workers x 2 replicas

The loss convention is TF's: each replica's per-example losses are summed and divided
by the GLOBAL batch size (`compute_average_loss`), and the replicas' gradients are
SUMmed, so N replicas compute exactly the gradient one device computes on the whole
batch. `--check` trains again on one replica with the same global batches and checks
that the parameters match. In float32 they match only as far as ReLU and max-pooling
let them: a batch of 16 and a batch of 64 round convolutions differently in the last
bit, which flips a few of those comparisons, and Adam amplifies the difference (1e-6 to
1e-2 after 230 steps, depending on the data order). `--dtype float64` leaves nothing
but rounding (about 1e-12), which is what the tests check.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np
import torch

import crossdevice  # TF: import tensorflow as tf
import crossdevice.torch
from crossdevice.datasets import load_digits, train_test_split  # TF: tf.keras.datasets

STRATEGIES = ("mirrored", "one_device", "central_storage", "multi_worker")


def make_strategy(name: str, replicas: int, device_type: str = "CPU") -> crossdevice.Strategy:
    """The strategy to train with (the tutorial's `tf.distribute.MirroredStrategy()`)."""
    devices = [f"{device_type}:{i}" for i in range(replicas)]
    if name == "mirrored":
        return crossdevice.MirroredStrategy(devices)  # TF: tf.distribute.MirroredStrategy()
    if name == "one_device":
        return crossdevice.OneDeviceStrategy(devices[0])
    if name == "central_storage":
        return crossdevice.experimental.CentralStorageStrategy(devices, parameter_device="CPU:0")
    # Under torchrun or TF_CONFIG: one process per worker, `replicas` replicas each.
    return crossdevice.MultiWorkerMirroredStrategy(devices=devices)


def is_chief(strategy: crossdevice.Strategy) -> bool:
    """TF's `_is_chief(task_type, task_id)` of the multi-worker tutorial."""
    resolver = strategy.cluster_resolver
    if resolver is None:
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    return task_type is None or task_type == "chief" or (task_type == "worker" and task_id == 0)


def create_model() -> torch.nn.Module:
    """The tutorial's CNN (`tf.keras.Sequential`), for 1x8x8 digits."""
    return torch.nn.Sequential(
        # TF: Conv2D(32, 3, activation='relu'); padding 1 because the digits are 8x8
        torch.nn.Conv2d(1, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),  # TF: MaxPooling2D()
        torch.nn.Conv2d(32, 64, 3, padding=1),  # TF: Conv2D(64, 3, activation='relu')
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),  # TF: Flatten()
        torch.nn.Linear(64 * 2 * 2, 64),  # TF: Dense(64, activation='relu')
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),  # TF: Dense(10)
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; returns the final parameters, metrics and step count (for tests)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default="mirrored")
    parser.add_argument("--replicas", type=int, default=4, help="local replicas")
    parser.add_argument(
        "--device-type",
        choices=("CPU", "GPU"),
        default="CPU",
        help="GPU: replicas on GPU:0..N-1, logical GPUs where the host has fewer",
    )
    parser.add_argument("--batch-size-per-replica", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float32",
        help="float64 makes --check exact to ~1e-12 (see the module doc)",
    )
    parser.add_argument("--check", action="store_true", help="compare with one replica")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    say = (lambda *_: None) if args.quiet else print

    # TF: tf.config.set_logical_device_configuration(cpu, [LogicalDeviceConfiguration()] * 4)
    crossdevice.config.set_logical_cpu_devices(max(2, args.replicas))
    if args.device_type == "GPU" and torch.cuda.device_count() < args.replicas:
        # TF: set_logical_device_configuration(gpu, [LogicalDeviceConfiguration(...)] * 4)
        crossdevice.config.set_logical_gpu_devices(args.replicas)
    torch.set_default_dtype(getattr(torch, args.dtype))  # TF: tf.keras.backend.set_floatx
    strategy = make_strategy(args.strategy, args.replicas, args.device_type)
    if not is_chief(strategy):
        say = lambda *_: None  # noqa: E731  (TF: only the chief writes summaries)
    say(f"Number of devices: {strategy.num_replicas_in_sync}")

    images, labels = load_digits()  # TF: fashion_mnist.load_data()
    train_images, train_labels, test_images, test_labels = train_test_split(
        images, labels, 0.2, seed=args.seed
    )
    # TF: train_images[..., None] / np.float32(255)  (channels first in torch)
    dtype = torch.get_default_dtype()
    train_images = torch.from_numpy(train_images.reshape(-1, 1, 8, 8) / 16).to(dtype)
    test_images = torch.from_numpy(test_images.reshape(-1, 1, 8, 8) / 16).to(dtype)
    train_labels = torch.from_numpy(train_labels.astype(np.int64))
    test_labels = torch.from_numpy(test_labels.astype(np.int64))

    batch_size_per_replica = args.batch_size_per_replica
    global_batch_size = batch_size_per_replica * strategy.num_replicas_in_sync
    result = train(
        strategy, args, global_batch_size, train_images, train_labels, test_images, test_labels, say
    )
    if args.check:
        single = crossdevice.OneDeviceStrategy(f"{args.device_type}:0")
        reference = train(
            single,
            args,
            global_batch_size,
            train_images,
            train_labels,
            test_images,
            test_labels,
            lambda *_: None,
        )
        difference = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(result["params"], reference["params"], strict=True)
        )
        result["max_difference"] = difference
        say(f"max |parameters - single-replica parameters| = {difference:.3g}")
    return result


def train(
    strategy: crossdevice.Strategy,
    args: argparse.Namespace,
    global_batch_size: int,
    train_images: torch.Tensor,
    train_labels: torch.Tensor,
    test_images: torch.Tensor,
    test_labels: torch.Tensor,
    say: Any,
) -> dict[str, Any]:
    """The tutorial's training loop under `strategy`; the same global batches for any strategy."""
    torch.manual_seed(args.seed)  # TF: tf.keras.utils.set_random_seed(seed)

    def train_dataset(epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # TF: Dataset.from_tensor_slices(...).shuffle(BUFFER_SIZE).batch(GLOBAL_BATCH_SIZE)
        order = torch.from_numpy(
            np.random.default_rng([args.seed, epoch]).permutation(len(train_labels))
        )
        return [
            (
                train_images[order[i : i + global_batch_size]],
                train_labels[order[i : i + global_batch_size]],
            )
            for i in range(0, len(order), global_batch_size)
        ]

    test_batches = [
        (test_images[i : i + global_batch_size], test_labels[i : i + global_batch_size])
        for i in range(0, len(test_labels), global_batch_size)
    ]
    test_dist_dataset = strategy.experimental_distribute_dataset(test_batches)

    with strategy.scope():
        # TF: SparseCategoricalCrossentropy(from_logits=True, reduction=Reduction.NONE)
        loss_object = torch.nn.CrossEntropyLoss(reduction="none")

        def compute_loss(labels: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
            per_example_loss = loss_object(predictions, labels)
            # TF: tf.nn.compute_average_loss(per_example_loss, global_batch_size=...)
            return crossdevice.torch.compute_average_loss(
                per_example_loss, global_batch_size=global_batch_size
            )

    with strategy.scope():
        model = create_model()
        # TF: tf.keras.optimizers.Adam(learning_rate); Keras' default epsilon is 1e-7
        # (torch's is 1e-8). It matters: Adam divides by the root of tiny second moments,
        # and a smaller epsilon turns float32 rounding into visible parameter noise.
        optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate, eps=1e-7)
        # The one line TF does not need: mirror the model and its optimizer (TF mirrors
        # every variable created under scope()).
        model, optimizer = crossdevice.torch.prepare(model, optimizer)

    def train_step(inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = inputs
        predictions = model(
            images
        )  # TF: with tf.GradientTape() as tape: model(images, training=True)
        loss = compute_loss(labels, predictions)
        optimizer.zero_grad()
        loss.backward()  # TF: tape.gradient(loss, model.trainable_variables); all-reduced here
        optimizer.step()  # TF: optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        # TF: train_accuracy.update_state(labels, predictions)
        correct = (predictions.argmax(1) == labels).sum().to(torch.float32)
        return loss.detach(), correct

    def test_step(inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = inputs
        with torch.no_grad():
            predictions = model(images)  # TF: model(images, training=False)
            t_loss = loss_object(predictions, labels).sum()  # TF: test_loss.update_state(...)
            correct = (predictions.argmax(1) == labels).sum().to(torch.float32)
        return t_loss, correct

    def distributed_train_step(dataset_inputs: Any) -> tuple[float, float]:
        per_replica_losses, per_replica_correct = strategy.run(train_step, args=(dataset_inputs,))
        return (
            float(strategy.reduce(crossdevice.ReduceOp.SUM, per_replica_losses, axis=None)),
            float(strategy.reduce(crossdevice.ReduceOp.SUM, per_replica_correct, axis=None)),
        )

    def distributed_test_step(dataset_inputs: Any) -> tuple[float, float]:
        losses, correct = strategy.run(test_step, args=(dataset_inputs,))
        return (
            float(strategy.reduce(crossdevice.ReduceOp.SUM, losses, axis=None)),
            float(strategy.reduce(crossdevice.ReduceOp.SUM, correct, axis=None)),
        )

    steps = 0
    start = time.perf_counter()
    for epoch in range(args.epochs):
        # TRAIN LOOP
        model.train()
        total_loss, num_batches, train_correct = 0.0, 0, 0.0
        for x in strategy.experimental_distribute_dataset(train_dataset(epoch)):
            loss, correct = distributed_train_step(x)
            total_loss += loss
            train_correct += correct
            num_batches += 1
            steps += 1
        train_loss = total_loss / num_batches
        # TEST LOOP
        model.eval()  # TF: training=False in test_step
        test_loss, test_correct = 0.0, 0.0
        for x in test_dist_dataset:
            batch_loss, correct = distributed_test_step(x)
            test_loss += batch_loss
            test_correct += correct
        say(
            f"Epoch {epoch + 1}, Loss: {train_loss:.4f}, "
            f"Accuracy: {100 * train_correct / len(train_labels):.2f}, "
            f"Test Loss: {test_loss / len(test_labels):.4f}, "
            f"Test Accuracy: {100 * test_correct / len(test_labels):.2f}"
        )
    seconds = time.perf_counter() - start
    replicas = model.replicas
    return {
        "params": [p.detach().cpu().numpy().copy() for p in replicas[0].parameters()],
        "replica_params": [
            [p.detach().cpu().numpy().copy() for p in r.parameters()] for r in replicas
        ],
        "test_accuracy": test_correct / len(test_labels),
        "steps": steps,
        "seconds": seconds,
    }


if __name__ == "__main__":
    outcome = main()
    if "max_difference" in outcome and outcome["max_difference"] > 1e-5:
        sys.exit(f"parameters differ from a single-replica run by {outcome['max_difference']}")
