"""Parameters written inside `strategy.run` other than by the optimizer: compared by value.

A mirrored module's replicas must hold the same parameters. Inside `run` the optimizer's
step writes them alike on every replica, given alike gradients and state (both checked
at the step: `step_check.py`, `gradient_edits.py`, `step_state.py`). Other writes were
compared only by count (`mirroring.ReplicaMirror._check_alike`; across workers, the
parameter writes in the next pass's state), so writes alike in number but not in value
trained the copies apart, silently: noise from each replica's own random stream after
the step (SGLD, weight noise: `p.add_(torch.randn_like(p), alpha=...)`, copies 0.064
apart after 5 steps), or each worker's own (DDP's workers, seeded alike, draw alike).

So the optimizer's own writes are told apart from the others: `MirroredOptimizer.step`
reads each replica's parameters' version counters around its optimizer's step and logs
them (`StepWrites`, one per mirrored module; a write made by a step hook counts as the
step's). A parameter whose counter moved by more than its steps' writes was written
otherwise (`other_writes`), and its value is compared by a print of its bits
(`step_check.gradient_prints`: an exact integer sum of its words, the same on every
CPU):

* between local copies where `_check_alike` runs, at the end of the replica code
  (`check_values`): parameters that differ are an error naming each, with every
  replica's sum and bits;
* across workers in the next backward pass's state (`step_state.py`): each parameter
  written otherwise since the replica's last pass that reduced, with its print; workers
  that differ fail on every worker, one update later.

Deterministic writes made alike (WGAN's `p.clamp_(-c, c)`, a constant decay, noise
from a `torch.Generator` seeded alike on every replica and worker) leave the same bits
and pass; the print costs one pass over the written parameters, about what the write
costs (0.04 ms for 1M float32 values, a `clamp_` 0.03 ms). With no such write: two reads
of the version counters per step and a comparison of lists at the end of the replica
code and at each pass (about 10 us per step for 200 parameters).

Not seen: writes that no version counter records (`p.data.add_(...)`), writes made in a
step hook (`register_step_post_hook`) counted as the step's.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Final

import torch

from crossdevice._frameworks.torch.step_check import gradient_prints

__all__ = ["Step", "StepWrites", "check_values", "other_writes", "versions"]

_VERSION: Final = operator.attrgetter("_version")


#: One optimizer step of one replica: its parameters' version counters before and after.
Step = tuple[list[int], list[int]]


class StepWrites:
    """Each local replica's optimizer steps, as their version counters (`Step`), for readers.

    A reader (`listen`) gets a log of every replica's steps and empties it where its own
    stretch of code starts (the mirror at each run's start, the pass state at each pass
    that reduces); `other_writes` then tells the steps' writes from the others. With no
    reader (one replica in all), a step reads nothing.

    Args:
        params: every local replica's parameters, in `parameters()` order.
        shared: the replicas store their parameters once: the one step (on replica 0's)
            counts every replica's counters, summed, and goes to every replica's log.
    """

    __slots__ = ("_logs", "_params", "_shared")

    def __init__(self, params: Sequence[Sequence[torch.nn.Parameter]], shared: bool) -> None:
        self._params = [list(p) for p in params]
        self._shared = shared
        self._logs: list[list[list[Step]]] = []

    def listen(self) -> list[list[Step]]:
        """A new log: each replica's steps from now on, in order (the reader empties it)."""
        log: list[list[Step]] = [[] for _ in self._params]
        self._logs.append(log)
        return log

    def read(self, replica: int) -> list[int] | None:
        """`replica`'s parameters' version counters before its step (None: no reader)."""
        if not self._logs:
            return None
        return versions(self._params, replica, self._shared)

    def stepped(self, replica: int, before: list[int] | None) -> None:
        """`replica` stepped since `read` returned `before`: log the step for each reader."""
        if before is None:
            return
        step = (before, versions(self._params, replica, self._shared))
        for log in self._logs:
            for own in log if self._shared else (log[replica],):
                own.append(step)


def versions(params: Sequence[Sequence[torch.Tensor]], replica: int, shared: bool) -> list[int]:
    """`replica`'s parameters' version counters; summed over the replicas if `shared`.

    Replicas that store their parameters once each hold their own tensors (and counters)
    over one memory: a write through any of them is a write to all.
    """
    if shared:
        return [sum(map(_VERSION, column)) for column in zip(*params, strict=True)]
    return list(map(_VERSION, params[replica]))


def other_writes(start: list[int], now: list[int], steps: Sequence[Step]) -> list[int]:
    """The parameters written other than by `steps` between `start` and `now`.

    Args:
        start: the version counters where the stretch of code started.
        now: the version counters now.
        steps: the steps taken meanwhile, in order (a reader's log).

    Returns:
        The indices of the parameters written more often than the steps wrote them.
        Where each step starts at the counters the one before left and the last left
        `now`, nothing else wrote: one comparison of lists per step.
    """
    at = start
    for before, after in steps:
        if before != at:
            break
        at = after
    else:
        if at == now:
            return []
    others = list(map(operator.sub, now, start))
    for before, after in steps:
        others = list(map(operator.sub, others, map(operator.sub, after, before)))
    return [k for k, count in enumerate(others) if count]


def check_values(
    params: Sequence[Sequence[torch.nn.Parameter]],
    names: Sequence[str],
    indices: Sequence[int],
    writes: Sequence[Sequence[int]],
) -> None:
    """Local copies of the parameters at `indices` (written otherwise): alike, bitwise.

    Args:
        params: every local replica's parameters.
        names: their names.
        indices: the parameters some replica wrote other than by its optimizer's step.
        writes: each replica's writes to each parameter, for the message.

    Raises:
        RuntimeError: copies that differ, naming each with every replica's sum and bits.
    """
    table = [gradient_prints([own[k] for k in indices]) for own in params]
    apart = [i for i in range(len(indices)) if len({row[i] for row in table}) > 1]
    if not apart:
        return
    shown = []
    for i in apart[:3]:
        k = indices[i]
        each = ", ".join(
            f"replica {r}: sum {_sum(own[k]):.10g} (bits #{_short(row[i])})"
            for r, (own, row) in enumerate(zip(params, table, strict=True))
        )
        shown.append(f"{names[k]!r} ({each})")
    more = f" ({len(apart) - 3} more)" if len(apart) > 3 else ""
    counts = ", ".join(f"replica {r}: {w[indices[apart[0]]]}" for r, w in enumerate(writes))
    raise RuntimeError(
        "parameters of a mirrored module were written in place inside strategy.run "
        "other than by the optimizer's step, alike in number on every replica (in-place "
        f"writes to {names[indices[apart[0]]]!r}, the step's included: {counts}) but not "
        "in value, so their "
        f"copies now differ: {'; '.join(shown)}{more}. Write them alike on every replica: "
        "draw noise from a torch.Generator seeded alike on every replica and worker "
        "(torch.randn(p.shape, generator=g), g = torch.Generator().manual_seed(step); "
        "torch.randn_like draws from each replica's own stream), no value that depends "
        "on the replica; or write them once for all replicas in "
        "crossdevice.torch.call_once(fn), or outside strategy.run (every replica then "
        "follows replica 0)"
    )


def _sum(param: torch.Tensor) -> float:
    return float(param.detach().sum(dtype=torch.float64))


def _short(value: int | None) -> str:
    """A print cut to 32 bits, as the messages show it."""
    return "None" if value is None else f"{value & 0xFFFF_FFFF:08x}"
