"""One rendezvous per optimizer step: the replicas agree on the step, or it is an error.

With parameters copied per replica (`share_storage=False`), each replica steps its own
optimizer copy, and nothing else in the step makes the replicas meet: a replica that
skips `step()` (`if torch.isfinite(local_loss): opt.step()`) or `zero_grad()` would
silently drift away from the others. So every local replica's `step()` meets the others
in one `merge_call` round, as the shared-storage step always did. A round costs what a
`merge_call` costs: on 2 host replicas of a loaded 2-core machine, `run` of a step that
only meets took 50-100 us more than an empty `run` on replica threads and about 50 us
more on cooperative replicas (medians of interleaved blocks of 200 runs). What it checks:

* a replica that skipped the step leaves the others waiting in `MirroredOptimizer.step()`:
  the rendezvous' usual error, naming the replica that returned or called something else;
* each replica brings how many times it called `zero_grad()` since its last step (or the
  last cross-replica section: the run's start, a `merge_fn`), the optimizer's or that of
  a prepared module it updates: counts that differ are an error naming each replica's;
* each replica brings the changes it made to its all-reduced gradients since the
  reduction (`gradient_edits.py`): where any replica made one, the changed gradients
  are compared bitwise (`gradient_prints`), and gradients that differ are an error
  naming each (clipping on one replica only; noise from each replica's own random
  stream, a scale that depends on the replica: alike in count, not in value). So at
  the shared-storage step too, whose one step reads replica 0's gradients: after
  gradient accumulation each replica holds its own, and another's change was dropped;
* optimizer state that the user changed in cross-replica context (`opt.state.clear()`,
  `st["exp_avg"].zero_()` between runs or in a `merge_fn`, where `opt.state` is replica
  0's) is copied from replica 0 to every other replica before the replicas run again.
  This is the mirrored modules' rule for parameters and buffers (`mirroring.py`,
  `sections`): a fingerprint of replica 0's state (its entries, each tensor's identity and
  `_version`) is taken when a cross-replica section starts and compared when it ends;
* where the replicas share one optimizer, its state tensors read inside the run
  (`optimizer_views.StateWrites`) must not be written there: each replica's write
  would land on them once per replica.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from crossdevice._frameworks.torch.agreement import PLAIN
from crossdevice._frameworks.torch.optimizer_views import StateWrites
from crossdevice._strategies.base import Strategy
from crossdevice._strategies.context import get_replica_context
from crossdevice._strategies.replica import in_section
from crossdevice._sync.call import CallSignature
from crossdevice._values.values import PerReplica

__all__ = ["Edited", "StepCheck", "changes", "check_edits", "fingerprint", "gradient_prints"]

_STEP_CALL: Final = CallSignature("MirroredOptimizer.step()")
_GONE: Final[Any] = object()
_TENSOR: Final = torch.Tensor


class StepCheck:
    """What the local replicas' optimizer steps must agree on (see the module doc).

    Args:
        strategy: the strategy of the replicas.
        optimizers: every local replica's optimizer (the same one N times when shared).
        shared: whether the replicas store parameters once (one optimizer, one state).
    """

    def __init__(
        self, strategy: Strategy, optimizers: Sequence[torch.optim.Optimizer], shared: bool
    ) -> None:
        self._optimizers = optimizers
        self._shared = shared
        self._zero_grads = [0] * len(optimizers)
        self._seen = fingerprint(optimizers[0])
        #: The shared optimizer's state read inside `strategy.run` (`optimizer_views`).
        self.writes = StateWrites(len(optimizers))
        if len(optimizers) > 1:
            strategy.extended._sections.add(self)  # held weakly

    def zeroed(self, replica: int) -> None:
        """Count a `zero_grad()` of `replica` inside `strategy.run`."""
        self._zero_grads[replica] += 1

    def meet(
        self,
        strategy: Strategy,
        replica: int,
        then: Callable[[], Any] | None = None,
        edits: Edited | None = None,
    ) -> Any:
        """Meet the other local replicas before `replica` steps; `then()` runs once there.

        `edits`: the changes `replica` made to its reduced gradients since the reduction
        (`gradient_edits.before_step`); where any replica made one, the changed gradients
        must be bitwise alike on every replica (`check_edits`).

        Returns:
            What `then` returned (None without it).

        Raises:
            RuntimeError: the replicas called `zero_grad()` different numbers of times since
                their last step, changed their gradients differently, or a replica did
                not come (the rendezvous' error).
        """
        ctx = get_replica_context()
        assert ctx is not None
        count = self._zero_grads[replica]
        self._zero_grads[replica] = 0

        def merge_fn(strategy: Any, counts: Any, changes: Any) -> Any:
            del strategy
            self._check_zero_grads(_each(counts))
            check_edits(_each(changes), self._shared)
            return None if then is None else then()

        extended = strategy.extended
        if then is not None and extended._sections:
            # `then` changes replica 0's parameters: a cross-replica section, as in any
            # merge_fn (mirrored modules see the change; ReplicaContext.merge_call's rule).
            merge_fn = in_section(merge_fn, extended._sections)
        return extended._merge_call_checked(
            ctx.replica_id_in_sync_group, merge_fn, (count, edits), _STEP_CALL
        )

    def enter_cross_replica(self) -> None:
        """Remember replica 0's state (the replicas agree on it now); recount zero_grad.

        The counts start afresh with each cross-replica section (a run's end, a merge_fn)
        rather than persist across runs: a run that failed halfway leaves no stale count.
        """
        zero_grads = self._zero_grads
        for r in range(len(zero_grads)):
            zero_grads[r] = 0
        if not self._shared:
            self._seen = fingerprint(self._optimizers[0])
        elif self.writes:  # the state read since the section before: unwritten
            self.writes.check()

    def leave_cross_replica(self) -> None:
        """Copy replica 0's state to the other replicas if it changed meanwhile.

        With one shared optimizer: the state read inside the run is watched from here on
        (the step's writes, or those made outside the run, are not the replicas').
        """
        if self._shared:
            if self.writes:
                self.writes.stamp()
            return
        first = self._optimizers[0]
        now = fingerprint(first)
        if now == self._seen:
            return
        state = first.state_dict()
        for optimizer in self._optimizers[1:]:
            # load_state_dict puts each tensor where the replica's parameter is.
            optimizer.load_state_dict(copy.deepcopy(state))
        self._seen = fingerprint(first)

    def loaded(self) -> None:
        """Every replica's state was set alike (`load_state_dict`, `add_param_group`)."""
        self._seen = fingerprint(self._optimizers[0])

    def _check_zero_grads(self, counts: list[int]) -> None:
        if len(set(counts)) > 1:
            raise RuntimeError(
                "MirroredOptimizer.step(): the replicas called zero_grad() different numbers "
                f"of times since their last step ({_listed(counts)}), so their gradients "
                "differ. Every replica must make the same zero_grad() and step() calls: "
                "decide on values every replica agrees on (reduce a per-replica loss or flag "
                "first, crossdevice.get_replica_context().all_reduce('max', x))"
            )


def fingerprint(optimizer: torch.optim.Optimizer) -> list[Any]:
    """What changes when `optimizer.state` changes.

    Its entries, each tensor's identity and version counter (every in-place write bumps
    it), and plain values. Laid out for `changes`: `[id(state), len(state)]`, then per
    entry its identity and length (-1: not a dict), then per item `name, id(value), tag`
    (a tensor's version, a plain value itself, else None).

    About 0.2 us per state tensor (Adam: 3 per parameter), taken twice per run.
    """
    state = optimizer.state
    out: list[Any] = [id(state), len(state)]
    append = out.append
    for entry in state.values():
        append(id(entry))
        if type(entry) is not dict:
            append(-1)
            continue
        append(len(entry))
        for name, value in entry.items():
            append(name)
            append(id(value))
            if isinstance(value, _TENSOR):
                append(value._version)
            elif isinstance(value, PLAIN):
                append(value)
            else:
                append(None)
    return out


def changes(before: list[Any], after: list[Any]) -> tuple[int, int, int]:
    """What happened to an optimizer's state between two `fingerprint`s of it.

    Returns:
        (in-place writes, items replaced or added, items removed): a tensor still
        there counts the writes its version counter saw; a new object under a name (a
        tensor replaced, a plain value changed, a new entry's items) counts one, as does
        each item gone. A new state dict (`load_state_dict`) replaced every item. The
        counts follow what was done, not addresses: every worker that does the same
        gets the same counts (`step_state.py` compares them).
    """
    if before[0] != after[0]:
        return 0, _count(after), _count(before)
    written = replaced = removed = 0
    old = dict(_entries(before))
    for ident, items in _entries(after):
        was = old.pop(ident, _GONE)
        if was is _GONE or was is None or items is None:  # a new entry (or not a dict)
            replaced += 1 if items is None else len(items)
            if was is not _GONE:
                removed += 1 if was is None else len(was)
            continue
        for name, (value, tag) in items.items():
            before_item = was.get(name)
            if before_item is None:
                replaced += 1
            elif before_item == (value, tag):
                continue
            elif before_item[0] == value and type(tag) is int and tag >= before_item[1]:
                written += tag - before_item[1]  # a tensor's version counter
            else:
                replaced += 1  # (the same address with a lower version: a new tensor)
        removed += sum(1 for name in was if name not in items)
    removed += sum(1 if items is None else len(items) for items in old.values())
    return written, replaced, removed


def _entries(print_: list[Any]) -> list[tuple[int, dict[Any, tuple[int, Any]] | None]]:
    """A `fingerprint`'s entries: (identity, {name: (id(value), tag)} or None)."""
    out: list[tuple[int, dict[Any, tuple[int, Any]] | None]] = []
    i = 2
    while i < len(print_):
        ident, size = print_[i], print_[i + 1]
        i += 2
        if size < 0:
            out.append((ident, None))
            continue
        items = {print_[j]: (print_[j + 1], print_[j + 2]) for j in range(i, i + 3 * size, 3)}
        out.append((ident, items))
        i += 3 * size
    return out


def _count(print_: list[Any]) -> int:
    """The items (or non-dict entries) of a `fingerprint`'s state."""
    return sum(1 if items is None else len(items) for _, items in _entries(print_))


class Edited:
    """One replica's changes to its reduced gradients since the reduction, at its step.

    Attributes:
        count: its in-place writes to them and the gradients it set to None
            (`gradient_edits.changes`).
        prints: each changed gradient's `gradient_prints` value (None: set to None), by
            (gradient sync, parameter index).
    """

    __slots__ = ("count", "prints")

    def __init__(self) -> None:
        self.count = 0
        self.prints: dict[tuple[Any, int], int | None] = {}


def gradient_prints(grads: Sequence[torch.Tensor | None]) -> list[int | None]:
    """A print of each gradient's (or parameter's) bits (None for None): equal bits, equal prints.

    The sum, wrapping at 2**64, of the gradient's bytes (in element order, zero-padded
    to whole words) read as little-endian int64 words; a sparse gradient's, of its
    coalesced indices and values. Integer sums are exact, so it depends on the bits
    alone, never on the order of summation, the thread count or the CPU, as a float
    sum would: every worker and replica gets the same print for the same gradient. So
    NaNs agree where their bits do, and -0.0 differs from 0.0, as the copies would.
    One pass over the memory, no copy where the gradient's words are aligned (about
    as much as the `mul_` of `clip_grad_norm_`), and one transfer to the host for all.
    """
    out: list[int | None] = [None] * len(grads)
    by_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    for k, grad in enumerate(grads):
        if grad is not None:
            places, sums = by_device.setdefault(grad.device, ([], []))
            places.append(k)
            sums.append(_word_sum(grad.detach()))
    for places, sums in by_device.values():
        for k, value in zip(places, torch.stack(sums).tolist(), strict=True):
            out[k] = value
    return out


def _word_sum(grad: torch.Tensor) -> torch.Tensor:
    """`gradient_prints`' sum for one detached gradient (a 0-d int64 tensor)."""
    if grad.layout != torch.strided:
        grad = grad.coalesce()
        return _word_sum(grad.indices()) * 1_000_003 + _word_sum(grad.values())
    flat = grad.reshape(-1)  # a copy only where the gradient is not contiguous
    size = flat.element_size()
    nbytes = flat.numel() * size
    if nbytes % 8 == 0 and (size >= 8 or flat.storage_offset() % (8 // size) == 0):
        return flat.view(torch.int64).sum()
    words = torch.zeros(-(-nbytes // 8), dtype=torch.int64, device=flat.device)
    words.view(torch.uint8)[:nbytes].copy_(flat.view(torch.uint8))
    return words.sum()


def check_edits(edits: Sequence[Edited | None], shared: bool = False) -> None:
    """Local replicas' changes to their reduced gradients (`Edited`), at their step.

    Where any replica made one, each gradient that any replica changed is compared
    between every replica by `gradient_prints` (a replica that left it as reduced
    prints it here): the changes must leave the same bits on every replica. Counts may
    differ (a `call_once` change that replica 0 made and the others copied). `shared`:
    the replicas store parameters once, and their one step reads replica 0's gradients.

    Raises:
        RuntimeError: gradients that differ, naming each with what every replica has.
    """
    if not any(e is not None and e.count for e in edits):
        return
    keys = list(dict.fromkeys(key for e in edits if e is not None for key in e.prints))
    table: list[list[int | None]] = []
    for r, e in enumerate(edits):
        own = {} if e is None else e.prints
        missing = [key for key in keys if key not in own]
        found = dict(zip(missing, gradient_prints([_grad(key, r) for key in missing]), strict=True))
        table.append([own[key] if key in own else found[key] for key in keys])
    apart = [k for k in range(len(keys)) if len({row[k] for row in table}) > 1]
    if not apart:
        return
    shown = "; ".join(_differs(keys[k], [row[k] for row in table]) for k in apart[:3])
    more = f" ({len(apart) - 3} more)" if len(apart) > 3 else ""
    counts = [0 if e is None else e.count for e in edits]
    raise RuntimeError(
        "MirroredOptimizer.step(): the replicas changed their all-reduced gradients "
        "differently before this step (in-place writes and gradients set to None: "
        f"{_listed(counts)}), and the gradients now differ: {shown}{more}. "
        f"{_APART_SHARED if shared else _APART_COPIES} "
        "Make the same changes on every replica: clip_grad_norm_ on every replica (not "
        "under `if replica_id == 0`), no scale that depends on the replica, noise from a "
        "torch.Generator seeded alike on every replica (torch.randn_like draws from each "
        "replica's own stream); or change them once for all replicas in "
        "crossdevice.torch.call_once(fn)"
    )


_APART_COPIES: Final = "Each would update with its own gradients and the replicas would go apart."
_APART_SHARED: Final = (
    "The replicas store their parameters once and the one step reads replica 0's "
    "gradients: the other replicas' changes would be dropped."
)


def _grad(key: tuple[Any, int], replica: int) -> torch.Tensor | None:
    """Replica `replica`'s gradient of `key` (gradient sync, parameter index)."""
    sync, index = key
    grad: torch.Tensor | None = sync.params(replica)[index].grad
    return grad


def _differs(key: tuple[Any, int], prints: list[int | None]) -> str:
    """`'name': replica 0: sum s (bits #print), ...`, for `check_edits`' error."""
    sync, index = key
    each = []
    for r, value in enumerate(prints):
        grad = _grad(key, r)
        if value is None or grad is None:
            each.append(f"replica {r}: None")
            continue
        dense = grad.to_dense() if grad.layout != torch.strided else grad
        total = float(dense.detach().sum(dtype=torch.float64))
        each.append(f"replica {r}: sum {total:.10g} (bits #{value & 0xFFFF_FFFF:08x})")
    return f"{sync._names[index]!r} ({', '.join(each)})"


def _each(value: Any) -> list[Any]:
    """A merge_fn's argument as every replica's value, in replica order."""
    return list(value.values) if isinstance(value, PerReplica) else [value]


def _listed(values: Sequence[Any]) -> str:
    """`replica 0: a, replica 1: b, ...`, for the step meeting's errors."""
    return ", ".join(f"replica {r}: {v}" for r, v in enumerate(values))
