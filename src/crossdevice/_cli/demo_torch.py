"""The torch demo model: a small CNN trained with a mirrored module and `torch.optim.Adam`.

The step function is what a PyTorch user writes: forward, loss, `zero_grad`,
`backward`, `optimizer.step()`. `crossdevice.torch.prepare` mirrors the model and the
optimizer on the strategy's replicas; the gradients are all-reduced during backward, so
every replica applies the same update. The loss follows TF's rule (per-example loss
divided by the global batch, gradients summed across replicas), so N replicas compute
exactly the gradient of one device on the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from crossdevice._cli.demo_common import Batch, TrainResult, fit

__all__ = ["LEARNING_RATE", "create_model", "train"]

LEARNING_RATE: Final = 5e-3
#: How `crossdevice demo` names this model and its optimizer.
DESCRIPTION: Final = "PyTorch CNN (conv 32, conv 64, dense 64, dense 10, tanh; crossdevice.torch)"
OPTIMIZER: Final = f"torch.optim.Adam lr {LEARNING_RATE}"
#: Keras' Adam epsilon (torch's default is 1e-8): Adam divides by the root of tiny second
#: moments, and the smaller epsilon turns float32 rounding (any two summation orders)
#: into parameter noise of ~1e-2 over 100 steps instead of ~1e-6 (measured).
ADAM_EPSILON: Final = 1e-7


def create_model() -> Any:
    """The CNN of TF's custom-training tutorial for 1x8x8 digits, with smooth layers.

    tanh and average pooling instead of ReLU and max pooling, so that the single-replica
    check means something in float32: a batch of 16 and a batch of 64 round
    convolutions differently in their last bit, and ReLU and max pooling turn a few of
    those bits into different decisions, which Adam amplifies (max parameter difference
    0.04 after 230 steps, measured); with smooth layers the two runs differ by rounding
    only (4e-6 to 8e-6, measured on two seeds).
    """
    import torch

    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1),
        torch.nn.Tanh(),
        torch.nn.AvgPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.Tanh(),
        torch.nn.AvgPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * 2 * 2, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 10),
    )


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
    mixed_precision: str | None = None,
    checkpoint_dir: str | None = None,
) -> TrainResult:
    """Train the CNN with `strategy` on the given global batches, one list per epoch.

    Args:
        strategy: a `crossdevice` strategy.
        epochs: the global batches of each epoch (`[n, 64]` float32 pixels, int64 labels).
        seed: torch's seed for the initial parameters (the same for every strategy).
        test: held-out `(x, labels)`, evaluated after every epoch.
        learning_rate: Adam's step size.
        progress: a `tqdm`-like factory, or None.
        report: where to write the per-epoch lines, or None.
        label: a prefix for the progress bar.
        mixed_precision: None, or "bf16" (forward passes under bfloat16 autocast).
        checkpoint_dir: checkpoint into (and resume from) this directory.

    Returns:
        A `TrainResult`.
    """
    import torch

    import crossdevice.torch as cdt

    def images(x: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(x)).reshape(-1, 1, 8, 8)

    torch_epochs = [[(images(x), torch.from_numpy(y)) for x, y in batches] for batches in epochs]
    global_batch = max(len(y) for _, y in epochs[0])
    torch.manual_seed(seed)
    with strategy.scope():
        model = create_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate, eps=ADAM_EPSILON)
        model, optimizer = cdt.prepare(model, optimizer, mixed_precision=mixed_precision)

    def step_fn(x: Any, labels: Any) -> tuple[Any, Any]:
        logits = model(x)
        losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        optimizer.zero_grad()
        cdt.compute_average_loss(losses, global_batch_size=global_batch).backward()
        optimizer.step()
        return losses.detach(), (logits.argmax(1) == labels).to(torch.float32)

    test_x, test_y = images(test[0]), torch.from_numpy(test[1])

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            accuracy = float((model(test_x).argmax(1) == test_y).to(torch.float64).mean())
        model.train()
        return accuracy

    def read_params() -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
        replicas = [[p.detach().numpy().copy() for p in r.parameters()] for r in model.replicas]
        return replicas[0], replicas

    return fit(
        strategy,
        torch_epochs,
        step_fn,
        evaluate,
        read_params,
        progress=progress,
        report=report,
        label=label,
        checkpoint_dir=checkpoint_dir,
        objects={"model": model, "optimizer": optimizer},
    )
