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

So are the plain attributes set or deleted there on replica 0's submodules (a dropout
`p`, a LeakyReLU's `negative_slope`, a custom `self.temperature`: on one worker only,
each worker's gradient came from its own objective, found by session 56's bug hunt):
`Module.__setattr__` marks them (`attributes.watch`), and each one's value (a plain
value itself, else its kind) goes into the counts, so values that differ are found too.

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

from crossdevice._frameworks.torch import attributes
from crossdevice._frameworks.torch.agreement import PLAIN
from crossdevice._frameworks.torch.step_check import changes, fingerprint

__all__ = ["NOTHING", "OutsideWrites", "describe"]

#: A replica's counts, as its passes carry them: none written.
NOTHING: Final[tuple[Any, ...]] = ()

#: An attribute deleted in a section, as its value reads.
_DELETED: Final = "<deleted>"


def _plain(value: Any) -> Any:
    """An attribute's value as every process writes it alike.

    Plain values themselves (tuples and lists of them too), a tensor's shape and dtype,
    else its type's name.
    """
    if value is _DELETED or isinstance(value, PLAIN):
        return value
    if isinstance(value, tuple | list) and all(isinstance(v, PLAIN) for v in value):
        return tuple(value)
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}:{value.dtype}"
    return f"<{type(value).__name__}>"


class OutsideWrites:
    """One mirrored module's writes outside the replicas' code (see the module doc).

    A cross-replica section listener (`CrossReplicaSections.add`, held weakly there):
    add it after the module's `ReplicaMirror`, whose section end may replace replica 0's
    buffers (a failed run's repair) before these are recorded.

    Args:
        replica: replica 0's module (the one cross-replica code changes).
        replicas: how many local replicas count (each its own since its step).
    """

    __slots__ = (
        "__weakref__",
        "_attributes",
        "_marks",
        "_modules",
        "_names",
        "_optimizers",
        "_prints",
        "_slots",
        "counts",
    )

    def __init__(self, replica: torch.nn.Module, replicas: int) -> None:
        slots = [
            (prefix, module, leaf)
            for prefix, module in replica.named_modules()
            for leaf in module._buffers
        ]
        self._slots = [(module, leaf) for _, module, leaf in slots]
        self._names = [f"{prefix}.{leaf}" if prefix else leaf for prefix, _, leaf in slots]
        #: Replica 0's modules (with their names) and the plain attributes set on them.
        self._modules = list(replica.named_modules())
        self._attributes = attributes.watch(self, [m for _, m in self._modules])
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        #: Each optimizer's fingerprint when the open section started (None: no section).
        self._prints: list[list[Any] | None] = []
        #: Replica 0's buffers' (identity, version) then (None: no section open).
        self._marks: list[tuple[int, int] | None] | None = self._buffer_marks()
        #: Each replica's counts since its step: {buffer name: writes},
        #: {(optimizer number, class): (in-place writes, replaced or added, removed)} and
        #: {attribute path: its value as `_plain` has it}.
        self.counts: list[tuple[dict[str, int], dict[tuple[int, str], Any], dict[str, Any]]]
        self.counts = [({}, {}, {}) for _ in range(replicas)]

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
        self._attributes.clear()  # set inside run: the replica's own (a forward's cache)
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
        if self._attributes:
            self._count_attributes()
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
                for buffers, _, _ in self.counts:
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
            for _, states, _ in self.counts:
                old = states.get(key, (0, 0, 0))
                states[key] = (old[0] + change[0], old[1] + change[1], old[2] + change[2])

    def _count_attributes(self) -> None:
        """The plain attributes set or deleted in the section: each one's value now."""
        marked = sorted(self._attributes)
        self._attributes.clear()
        for j, name in marked:
            prefix, module = self._modules[j]
            if not attributes.follows(module, name):
                continue
            value = _plain(vars(module).get(name, _DELETED))
            for _, _, set_ in self.counts:
                set_[f"{prefix}.{name}" if prefix else name] = value

    def stepped(self, replica: int) -> None:
        """`replica` stepped: its counts start again."""
        for kept in self.counts[replica]:
            if kept:
                kept.clear()

    def values(self, replica: int) -> tuple[Any, ...]:
        """`replica`'s counts since its step, as its passes carry them (`NOTHING`: none)."""
        buffers, states, set_ = self.counts[replica]
        if not buffers and not states and not set_:
            return NOTHING
        return tuple(tuple(sorted(kept.items())) for kept in (buffers, states, set_))


def describe(values: tuple[Any, ...] | None) -> list[str]:
    """`OutsideWrites.values` in words, for the mismatch message (None: not watched)."""
    if values is None:
        return []
    if not values:
        return ["0 writes outside run to buffers, optimizer state, attributes"]
    buffers, states, set_ = values
    parts = [f"buffer {name!r} written {n}x outside run" for name, n in buffers]
    parts += [f"attribute {name!r} set to {value} outside run" for name, value in set_]
    for (_, name), (written, replaced, removed) in states:
        parts.append(
            f"{name} state changed outside run (load_state_dict, clear, edits): "
            f"{replaced} replaced/added, {removed} removed, {written} in-place"
        )
    return parts
