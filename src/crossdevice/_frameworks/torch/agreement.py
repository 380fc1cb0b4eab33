"""The workers agree on what they train, or `prepare` fails naming the difference.

Every worker builds its own model and optimizer, and nothing else compares them: a model
of another shape surfaced only as a packed buffer of the wrong size in the broadcast of
the chief's values, and a worker with another optimizer class, learning rate or weight
decay trained on silently, its parameters drifting away from its peers'. (DDP checks the
first, `_verify_param_shape_across_processes`, and not the second.)

So before the chief's values are broadcast, the workers compare the module's parameters
and buffers (names, shapes, dtypes); when an optimizer is mirrored, its class, its
groups' parameters and every setting of each group (`lr`, `betas`, `weight_decay`, ...).
Each side is one line per entry (`describe_module`, `describe_optimizer`); the workers
compare a digest of the lines in one collective. Where they differ, every worker learns
the chief's lines (two collectives) and the first line where each worker's differ (one
more), and each raises the same error listing them. A one-worker job compares nothing.

Settings that change later (a scheduler's `lr`) are compared at every backward pass
(`step_state.py`: a digest of them travels with the gradients, as does the step count:
a worker that skips `optimizer.step()` is found at its next backward too).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import torch

from crossdevice._strategies.base import Strategy
from crossdevice._train.job import gather_texts, sum_over_workers, worker_position

__all__ = [
    "PLAIN",
    "check_workers_agree",
    "describe_module",
    "describe_optimizer",
    "failing_together",
]

#: Setting values compared (and written) as they are: their `repr` is alike in every process.
PLAIN: Final = (int, float, bool, str, type(None))


def failing_together(strategy: Strategy) -> Any:
    """Inside, an exception on this worker reaches its peers as itself (`prepare`).

    `prepare` meets the other workers (this module's comparison, the chief's values): a
    worker whose `prepare` raised before (a bad argument on that worker only) left its
    peers waiting there until its process was gone, reported as a death 5 s later
    without its error. Now its communicator aborts with the error (as a step that
    raises does; `_MultiWorkerExtended._telling_workers`): its peers raise
    `WorkerFailedError` naming it and its error at once. One process: nothing to tell.
    """
    telling = getattr(strategy.extended, "_telling_workers", None)
    return contextlib.nullcontext() if telling is None else telling()


def describe_module(module: torch.nn.Module) -> list[str]:
    """One line per parameter and buffer: kind, name, dtype and shape (frozen or not)."""
    lines = [
        f"parameter {n}: {_tensor(t)}{'' if t.requires_grad else ' frozen'}"
        for n, t in module.named_parameters()
    ]
    lines += [f"buffer {n}: {_tensor(t)}" for n, t in module.named_buffers()]
    return lines


def describe_optimizer(
    optimizer: torch.optim.Optimizer, name_of: Callable[[torch.Tensor], str]
) -> list[str]:
    """The optimizer's class, and each group's parameters (`name_of`) and settings."""
    kind = type(optimizer)
    lines = [f"optimizer {kind.__module__}.{kind.__qualname__}"]
    for g, group in enumerate(optimizer.param_groups):
        lines.append(f"group {g} parameters: {', '.join(map(name_of, group['params']))}")
        lines += [f"group {g} {k}: {_setting(v)}" for k, v in group.items() if k != "params"]
    return lines


def check_workers_agree(strategy: Strategy, what: str, lines: Sequence[str]) -> None:
    """Return if every worker's `lines` are the chief's; else raise, naming the differences.

    Every worker of `strategy`'s job must call it with the same `what`, in cross-replica
    context (it makes one collective, four where the workers differ).

    Raises:
        ValueError: a worker's lines differ from the chief's (on every worker alike).
    """
    workers, index = worker_position(strategy)
    if workers == 1:
        return
    text = "\n".join(lines)
    digests = gather_texts(strategy, hashlib.blake2b(text.encode(), digest_size=16).hexdigest())
    if len(set(digests)) == 1:
        return
    chief = _from_chief(strategy, text if index == 0 else None).split("\n")
    found = _first_difference(list(lines), chief) if digests[index] != digests[0] else ""
    findings = gather_texts(strategy, found)
    listed = "\n".join(f"  worker {w}: {f}" for w, f in enumerate(findings) if f)
    raise ValueError(
        f"the workers prepared different {what}; every worker must build the same model "
        f"and optimizer (the chief's values are then given to all). Against the chief "
        f"(worker 0):\n{listed}\nBuild them from the same code and configuration on every "
        "worker (the same model arguments, learning rate and optimizer settings)."
    )


def _first_difference(mine: list[str], chief: list[str]) -> str:
    """This worker's first line that differs from the chief's, both shown."""
    for k, (a, b) in enumerate(zip(mine, chief, strict=False)):
        if a != b:
            return f"has {a!r} where the chief has {b!r} (entry {k})"
    if len(mine) > len(chief):
        return f"has {mine[len(chief)]!r} where the chief has nothing more"
    return f"lacks {chief[len(mine)]!r}, which the chief has"


def _from_chief(strategy: Strategy, text: str | None) -> str:
    """The chief's `text` on every worker (two sums: its length, then its bytes)."""
    data = np.frombuffer(text.encode(), np.uint8) if text is not None else np.zeros(0, np.uint8)
    size = int(sum_over_workers(strategy, np.asarray([data.size], np.int64))[0])
    row = np.zeros(size, np.int32)
    row[: data.size] = data
    got = sum_over_workers(strategy, row)
    return bytes(np.asarray(got).astype(np.uint8)).decode(errors="replace")


def _tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _setting(value: Any) -> str:
    """A group setting as text: exact for numbers, a tensor's value, else its type."""
    if isinstance(value, torch.Tensor):
        return repr(value.item()) if value.numel() == 1 else f"tensor {_tensor(value)}"
    if isinstance(value, PLAIN):
        return repr(value)
    if isinstance(value, tuple | list) and all(isinstance(v, PLAIN) for v in value):
        return repr(tuple(value))
    return type(value).__qualname__
