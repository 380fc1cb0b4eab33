"""What code outside `strategy.run` wrote since the last step: buffers, optimizer state.

Across workers each worker keeps its own buffers and optimizer state, and nothing
compared them after `prepare`: one worker that loaded its optimizer alone (`if rank ==
1: opt.load_state_dict(...)`, DDP's "only one rank resumed the optimizer"), cleared it,
edited a state tensor, or wrote a buffer no forward changes (a scale, a temperature)
trained on silently with summed gradients while the "mirrored" parameters went apart (a
bug hunt after session 54's; parameters written so were found already, `step_state.py`).

So a mirrored module's `OutsideWrites` listens to the strategy's cross-replica sections
(`_strategies/sections.py`: the code between runs, a `merge_fn`): it records replica 0's
buffers (each tensor's identity and version counter, as the mirror does) and each of its
optimizers' state (`step_check.fingerprint`) when a section starts, and when it ends
counts what changed (`step_check.changes`: writes in place, items replaced or added,
items removed; for a buffer, its version counter's writes, or one if replaced). Each
replica's counts since its last `step()` go into its backward passes' state
(`step_state.py`), compared across workers with the gradients: a worker that did
something its peers did not fails on every worker, naming the buffer or optimizer.

Only sections count, never the replicas' own code: a forward pass's changes (BatchNorm's
running statistics, combined across replicas by `buffers.py`) and the optimizer's step
are everyone's alike. Counts are of what was done, not of addresses, so workers that do
the same (every worker loading one checkpoint) agree. A pass pays nothing for this (its
counts are kept, not recomputed); a run pays a fingerprint of each optimizer's state and
a read of replica 0's buffers' version counters at each end.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Final

import torch

from crossdevice._frameworks.torch.step_check import changes, fingerprint

__all__ = ["NOTHING", "OutsideWrites", "describe"]

#: A replica's counts, as its passes carry them: none written.
NOTHING: Final[tuple[Any, ...]] = ()


class OutsideWrites:
    """One mirrored module's writes outside the replicas' code (see the module doc).

    A cross-replica section listener (`CrossReplicaSections.add`, held weakly there):
    add it after the module's `ReplicaMirror`, whose section end may replace replica 0's
    buffers (a failed run's repair) before these are recorded.

    Args:
        replica: replica 0's module (the one cross-replica code changes).
        replicas: how many local replicas count (each its own since its step).
    """

    __slots__ = ("__weakref__", "_marks", "_names", "_optimizers", "_prints", "_slots", "counts")

    def __init__(self, replica: torch.nn.Module, replicas: int) -> None:
        slots = [
            (prefix, module, leaf)
            for prefix, module in replica.named_modules()
            for leaf in module._buffers
        ]
        self._slots = [(module, leaf) for _, module, leaf in slots]
        self._names = [f"{prefix}.{leaf}" if prefix else leaf for prefix, _, leaf in slots]
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        #: Each optimizer's fingerprint when the open section started (None: no section).
        self._prints: list[list[Any] | None] = []
        #: Replica 0's buffers' (identity, version) then (None: no section open).
        self._marks: list[tuple[int, int] | None] | None = self._buffer_marks()
        #: Each replica's counts since its step: {buffer name: writes} and
        #: {(optimizer number, class): (in-place writes, replaced or added, removed)}.
        self.counts: list[tuple[dict[str, int], dict[tuple[int, str], tuple[int, int, int]]]]
        self.counts = [({}, {}) for _ in range(replicas)]

    def add(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer` (replica 0's) updates the module: watch its state from now on."""
        self._optimizers.append(weakref.ref(optimizer))
        self._prints.append(fingerprint(optimizer) if self._marks is not None else None)

    def _buffer_marks(self) -> list[tuple[int, int] | None]:
        marks: list[tuple[int, int] | None] = []
        for module, leaf in self._slots:
            buffer = module._buffers.get(leaf)
            marks.append(None if buffer is None else (id(buffer), buffer._version))
        return marks

    def enter_cross_replica(self) -> None:
        """A section starts (a run ended, a `merge_fn` starts): record what is there."""
        try:
            self._prints = [
                None if (o := ref()) is None else fingerprint(o) for ref in self._optimizers
            ]
            self._marks = self._buffer_marks()
        except RuntimeError:  # an inference tensor (no version counter): not counted
            self._marks = None

    def leave_cross_replica(self) -> None:
        """A section ends: count what it changed, for every local replica.

        Never raises: what cannot be read (an inference tensor, which has no version
        counter) is not counted.
        """
        marks, self._marks = self._marks, None
        prints, self._prints = self._prints, [None] * len(self._optimizers)
        if marks is None:  # (a listener before this one raised where the section started)
            return
        with contextlib.suppress(RuntimeError):
            self._count(marks, prints)

    def _count(self, marks: list[tuple[int, int] | None], prints: list[list[Any] | None]) -> None:
        now = self._buffer_marks()
        if now != marks:
            for name, was, mark in zip(self._names, marks, now, strict=True):
                if was == mark:
                    continue
                if was is not None and mark is not None and was[0] == mark[0]:
                    writes = mark[1] - was[1] if mark[1] >= was[1] else 1
                else:
                    writes = 1  # replaced, set, or removed
                for buffers, _ in self.counts:
                    buffers[name] = buffers.get(name, 0) + writes
        for k, (ref, before) in enumerate(zip(self._optimizers, prints, strict=True)):
            optimizer = ref()
            if optimizer is None or before is None:
                continue
            after = fingerprint(optimizer)
            if after == before:
                continue
            change = changes(before, after)
            key = (k, type(optimizer).__name__)
            for _, states in self.counts:
                old = states.get(key, (0, 0, 0))
                states[key] = (old[0] + change[0], old[1] + change[1], old[2] + change[2])

    def stepped(self, replica: int) -> None:
        """`replica` stepped: its counts start again."""
        buffers, states = self.counts[replica]
        if buffers:
            buffers.clear()
        if states:
            states.clear()

    def values(self, replica: int) -> tuple[Any, ...]:
        """`replica`'s counts since its step, as its passes carry them (`NOTHING`: none)."""
        buffers, states = self.counts[replica]
        if not buffers and not states:
            return NOTHING
        return (tuple(sorted(buffers.items())), tuple(sorted(states.items())))


def describe(values: tuple[Any, ...] | None) -> list[str]:
    """`OutsideWrites.values` in words, for the mismatch message (None: not watched)."""
    if values is None:
        return []
    if not values:
        return ["0 writes outside run to buffers, optimizer state"]
    buffers, states = values
    parts = [f"buffer {name!r} written {n}x outside run" for name, n in buffers]
    for (_, name), (written, replaced, removed) in states:
        parts.append(
            f"{name} state changed outside run (load_state_dict, clear, edits): "
            f"{replaced} replaced/added, {removed} removed, {written} in-place"
        )
    return parts
