"""What every worker's backward pass must agree on: its optimizers' settings and clearing.

Across workers each worker steps its own optimizer with the summed gradients. The
gradients' all-reduce compared the buckets (their shapes, dtypes, call site) and the
optimizer step count, but not what the step would do with them, so a program that went
its own way on one worker trained on silently (found by the bug hunt, session 52):

* a scheduler stepped on the chief only (`if rank == 0: scheduler.step()`), or
  `g["lr"] = ...` on one worker: from then on each worker updated with its own rate, and
  the "mirrored" parameters went apart;
* a worker that skipped `zero_grad()` once: its stale gradients went into every
  worker's sum.

Local replicas already meet in `MirroredOptimizer.step()` (`step_check.py`): their
`zero_grad()` counts are compared there, and every replica steps with replica 0's
hyperparameters. Across workers nothing met but the collectives, so each backward pass
now carries a state (`purpose.agreeing`) with its gradients' all-reduces: a digest of
the hyperparameters of every optimizer that updates the pass's modules (each parameter
group's values but its parameters, in order) and the `zero_grad()` calls made inside
`strategy.run` since the optimizer's last `step()`. The workers' fingerprints compare it
with the call (`fingerprint.py`, field `state`): states that differ are a
`CollectiveMismatchError` on every worker, showing each worker's values, before any
worker uses the sum, so before any update with it. It is not part of the call's cached
route: a learning rate that a scheduler changes every step costs nothing more.

Not seen: a hyperparameter changed on one worker between its backward and its `step()`
(the next pass fails, one update later); optimizer state changed by hand (`opt.state`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any, Final

import torch

from crossdevice._core import purpose
from crossdevice._frameworks.torch.agreement import PLAIN
from crossdevice._sync.call import digest

__all__ = ["register", "stepped", "workers_agree", "zeroed"]

#: Longest text of one worker's state in a mismatch message (the detail is cut at 300).
_TEXT_MAX: Final = 240


class _State:
    """One mirrored module's: its optimizers, and each replica's `zero_grad()` count."""

    __slots__ = ("last", "optimizers", "zero_grads")

    def __init__(self, replicas: int) -> None:
        self.optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self.zero_grads = [0] * replicas
        #: (the values last seen, their digest): a repeat is not digested again.
        self.last: tuple[tuple[Any, ...], int] | None = None


# GradientSync -> its _State (held weakly: a module that is gone takes its state along).
_STATES: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()


def _state(sync: Any) -> _State:
    state = _STATES.get(sync)
    if state is None:
        state = _STATES[sync] = _State(len(sync.steps))
    return state


def register(sync: Any, optimizer: torch.optim.Optimizer) -> None:
    """`optimizer` (replica 0's: the one schedulers change) updates `sync`'s parameters."""
    refs = _state(sync).optimizers
    if not any(ref() is optimizer for ref in refs):
        refs.append(weakref.ref(optimizer))


def zeroed(sync: Any, replica: int) -> None:
    """`replica` cleared `sync`'s gradients (`zero_grad()`) inside `strategy.run`."""
    _state(sync).zero_grads[replica] += 1


def stepped(sync: Any, replica: int) -> None:
    """`replica` stepped an optimizer over `sync`'s parameters: its count starts again."""
    _state(sync).zero_grads[replica] = 0


def workers_agree(strategy: Any, syncs: Sequence[Any], replica: int) -> Any:
    """A context for `replica`'s backward pass through `syncs`, whose collectives carry it.

    The pass's state (see the module doc); a null context with no workers.
    """
    if getattr(strategy.extended, "_worker_communicator", None) is None:
        return contextlib.nullcontext()
    values = tuple(_values(sync, replica) for sync in syncs)
    value = 0
    for sync, own in zip(syncs, values, strict=True):
        state = _state(sync)
        last = state.last
        if last is None or last[0] != own:
            last = state.last = (own, digest(own) or 1)
        value = (value * 1_000_003 + last[1]) & 0x7FFF_FFFF_FFFF_FFFF
    return purpose.agreeing(value or 1, lambda: _describe(values))


def _values(sync: Any, replica: int) -> tuple[Any, ...]:
    """`sync`'s state for `replica`: its zero_grad count, then each optimizer's groups."""
    state = _state(sync)
    out: list[Any] = [state.zero_grads[replica]]
    for ref in state.optimizers:
        optimizer = ref()
        if optimizer is None:
            continue
        out.append(type(optimizer).__name__)
        for group in optimizer.param_groups:
            out.append(tuple((k, _plain(v)) for k, v in group.items() if k != "params"))
    return tuple(out)


def _plain(value: Any) -> Any:
    """`value` as something whose `repr` every process writes alike."""
    if isinstance(value, PLAIN):  # (NumPy's float64 too: a scheduler's numpy rate)
        return value
    if isinstance(value, torch.Tensor):
        # A tensor learning rate (capturable optimizers): its value where reading it costs
        # no device sync, else its shape and dtype.
        if value.device.type == "cpu" and value.numel() == 1:
            return float(value)
        return f"tensor{tuple(value.shape)}:{value.dtype}"
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return type(value).__name__  # an object's repr may hold its address: its type only


def _describe(values: tuple[tuple[Any, ...], ...]) -> str:
    """One worker's state in words, for the mismatch message."""
    parts = []
    for own in values:
        zero_grads, rest = own[0], own[1:]
        parts.append(f"zero_grad() {zero_grads}x since step()")
        name, group = "", 0
        for item in rest:
            if isinstance(item, str):
                name, group = item, 0
                continue
            pairs = ", ".join(f"{k}={v}" for k, v in item)
            parts.append(f"{name} group {group}: {pairs}")
            group += 1
    text = "; ".join(parts)
    return text if len(text) <= _TEXT_MAX else text[: _TEXT_MAX - 3] + "..."
