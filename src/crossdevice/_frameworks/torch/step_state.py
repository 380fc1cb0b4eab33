"""What every worker's backward pass must agree on: its optimizers' settings and clearing.

Across workers each worker steps its own optimizer with the summed gradients. The
gradients' all-reduce compared the buckets (their shapes, dtypes, call site) and the
optimizer step count, but not what the step would do with them, so a program that went
its own way on one worker trained on silently (found by the bug hunt, session 52):

* a scheduler stepped on the chief only (`if rank == 0: scheduler.step()`), or
  `g["lr"] = ...` on one worker: from then on each worker updated with its own rate, and
  the "mirrored" parameters went apart;
* a worker that skipped `zero_grad()` once: its stale gradients went into every
  worker's sum;
* parameters changed outside the step on one worker only (`if rank == 0:
  model.load_state_dict(...)`, an in-place edit under `no_grad`): the workers trained on
  from different weights with summed gradients (the bug hunt of session 54);
* one worker's model in eval mode (dropout off): a different objective, silently.

Local replicas already meet in `MirroredOptimizer.step()` (`step_check.py`): their
`zero_grad()` counts are compared there, and every replica steps with replica 0's
hyperparameters. Across workers nothing met but the collectives, so each backward pass
now carries a state (`purpose.agreeing`) with its gradients' all-reduces: a digest of
the hyperparameters of every optimizer that updates the pass's modules (each parameter
group's values but its parameters, in order), the `zero_grad()` calls made inside
`strategy.run` since the optimizer's last `step()`, the writes to the replica's
parameters since then (their version counters: an optimizer's step, a
`load_state_dict`, an in-place edit, each counts alike on every worker that makes it),
which of its modules are in eval mode, which parameters are frozen (a layer frozen
on one worker cut other buckets: a mismatch of shapes, not naming the cause), and the
writes outside `strategy.run` since the step to its buffers and to each optimizer's
state (`outside_run.py`: one worker that alone loaded, cleared or edited its optimizer's
state, "only one rank resumed the optimizer", or wrote a buffer no forward changes,
trained on silently, found by a later bug hunt; a forward's own buffer updates, such
as BatchNorm's statistics, are not counted), and the changes replica 0 made to its
reduced gradients before its last step with a print of each changed gradient's bits
(`gradient_edits.py`: clipping on one worker, the bug hunt of session 56; noise or a
scale of each worker's own, alike in count, session 58), and a print of the bits of each
parameter written other than by the optimizer's step since the replica's last pass
that reduced (`param_edits.py`: SGLD's or weight noise from each worker's own random
stream, alike in count; a `clamp_` on every worker passes). The
workers' fingerprints compare it with the call (`fingerprint.py`, field `state`):
states that differ are a `CollectiveMismatchError` on every worker, showing each
worker's values, before any worker uses the sum, so before any update with it. It is
not part of the call's cached route: a learning rate that a scheduler changes every
step costs nothing more. The last step of a pass over a distributed dataset has no next
pass: the end of the data carries the same state in a barrier (`backward._final_state`,
`_StepSync.ended`), so a difference made in that step fails the loop's last `next()`.

Not seen: a hyperparameter changed on one worker between its backward and its `step()`
(the next pass fails, one update later); optimizer state or buffers changed inside
`strategy.run` outside a forward and a step (`opt.state` edited in the step function;
a buffer so changed is `BufferSync.settle`'s business); buffers or optimizer state
written alike in number but not in value (each worker loading its own file); a module
whose optimizer is not mirrored (`register`: its buffers are not watched).
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Sequence
from typing import Any, Final

import torch

from crossdevice._core import purpose
from crossdevice._frameworks.torch import outside_run
from crossdevice._frameworks.torch.agreement import PLAIN
from crossdevice._frameworks.torch.param_edits import Step, StepWrites, other_writes, versions
from crossdevice._frameworks.torch.step_check import gradient_prints
from crossdevice._sync.call import digest

__all__ = [
    "Prints",
    "edited",
    "register",
    "stepped",
    "unprepared_scaler",
    "watch",
    "watched",
    "workers_agree",
    "zeroed",
]

#: Longest text of one worker's state in a mismatch message (the detail is cut at 300).
_TEXT_MAX: Final = 240

#: (name, `step_check.gradient_prints` value) of each reduced gradient changed before a step.
Prints = tuple[tuple[str, int | None], ...]


class _State:
    """One mirrored module's: its optimizers, each replica's `zero_grad()` count, writes."""

    __slots__ = (
        "edits",
        "last",
        "marks",
        "modules",
        "optimizers",
        "outside",
        "replica",
        "sections",
        "steps",
        "watched",
        "written",
        "zero_grads",
    )

    def __init__(self, replicas: int) -> None:
        self.optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self.zero_grads = [0] * replicas
        #: Each replica's changes to its reduced gradients before its last step
        #: (`gradient_edits.before_step`): their count, and (name, bits print) of each
        #: gradient changed (replica 0's only); the passes carry replica 0's.
        self.edits: list[tuple[int, Prints]] = [(0, ())] * replicas
        #: Each replica's parameters' version counters, summed, at its last step.
        self.written = [0] * replicas
        #: Each replica's parameters' version counters at its last pass that reduced,
        #: and its optimizer steps since (`param_edits.StepWrites.listen`, from the first
        #: optimizer on: `register`): the parameters written otherwise are printed.
        self.marks: list[list[int]] = [[] for _ in range(replicas)]
        self.steps: list[list[Step]] | None = None
        #: The module trains across workers: its writes and modes are compared (`watch`).
        self.watched = False
        #: Each replica's modules (held weakly), for their train / eval modes.
        self.modules: list[list[weakref.ref[torch.nn.Module]]] = [[] for _ in range(replicas)]
        #: (the values last seen, their digest): a repeat is not digested again.
        self.last: tuple[tuple[Any, ...], int] | None = None
        #: Replica 0's module and the strategy's cross-replica sections (`watch`), for
        #: `outside`: the writes there to buffers and optimizer state (`outside_run.py`).
        self.replica: weakref.ref[torch.nn.Module] | None = None
        self.sections: Any = None
        self.outside: outside_run.OutsideWrites | None = None


# GradientSync -> its _State (held weakly: a module that is gone takes its state along).
_STATES: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()


def _state(sync: Any) -> _State:
    state = _STATES.get(sync)
    if state is None:
        state = _STATES[sync] = _State(len(sync.steps))
    return state


def register(sync: Any, optimizer: torch.optim.Optimizer, writes: StepWrites) -> None:
    """`optimizer` (replica 0's: the one schedulers change) updates `sync`'s parameters.

    `writes`: what the optimizers' steps write to the module's parameters (its mirror's).
    """
    state = _state(sync)
    if state.watched and state.steps is None:  # (one process: no pass carries a state)
        state.steps = writes.listen()
    refs = state.optimizers
    if any(ref() is optimizer for ref in refs):
        return
    refs.append(weakref.ref(optimizer))
    if not state.watched:
        return
    outside = state.outside
    if outside is None:
        replica = state.replica() if state.replica is not None else None
        if replica is None:
            return
        # Listening from the first optimizer on: after the module's mirror, which `watch`
        # precedes (`OutsideWrites`); and "since the step" needs a step.
        outside = state.outside = outside_run.OutsideWrites(replica, len(state.written))
        state.sections.add(outside)
    outside.add(optimizer)


def watch(sync: Any, replicas: Sequence[torch.nn.Module], strategy: Any) -> None:
    """`replicas` are `sync`'s module's copies, as prepared (every worker alike).

    Only across workers: in one process no pass carries a state, and a step need not
    count its parameters' versions.
    """
    if getattr(strategy.extended, "_worker_communicator", None) is None:
        return
    state = _state(sync)
    state.watched = True
    state.replica = weakref.ref(replicas[0])
    state.sections = strategy.extended._sections
    for r, replica in enumerate(replicas):
        state.modules[r] = [weakref.ref(m) for m in replica.modules()]
        state.written[r] = _versions(sync, r)
        state.marks[r] = _each_version(sync, r)


def _versions(sync: Any, replica: int) -> int:
    """The sum of `replica`'s parameters' version counters (each write adds one).

    Replicas that store their parameters once count every replica's: a write through
    one replica's tensors (replica 0's, in cross-replica code) changes them all, and
    only that replica's counters move. Their one step is a meeting, so no replica writes
    while another reads these counts.
    """
    if sync.shared:
        return sum(sum(map(_VERSION, sync.params(r))) for r in range(len(sync.steps)))
    return sum(map(_VERSION, sync.params(replica)))


def _each_version(sync: Any, replica: int) -> list[int]:
    """`_versions` per parameter (summed over the replicas where stored once)."""
    return versions([sync.params(r) for r in range(len(sync.steps))], replica, sync.shared)


def _param_prints(sync: Any, state: _State, replica: int, now: list[int]) -> Prints:
    """(name, bits) of each parameter written other than by a step since the last pass.

    Since `replica`'s last pass that reduced (`param_edits.py`); such a pass takes a new
    mark. The end of the data (no pass: `backward._final_state`) and a pass inside `no_sync()`
    carry no state to the other workers: they keep the mark, and the next pass prints.
    """
    steps: list[Step] = [] if state.steps is None else state.steps[replica]
    changed = other_writes(state.marks[replica], now, steps)
    if sync._states[replica].in_pass and not sync._no_sync[replica]:  # reduces
        state.marks[replica] = now
        steps.clear()
    if not changed:
        return ()
    params, names = sync.params(replica), sync._names
    prints = gradient_prints([params[k] for k in changed])
    return tuple((names[k], value) for k, value in zip(changed, prints, strict=True))


_VERSION: Final = operator.attrgetter("_version")


def zeroed(sync: Any, replica: int) -> None:
    """`replica` cleared `sync`'s gradients (`zero_grad()`) inside `strategy.run`."""
    _state(sync).zero_grads[replica] += 1


def stepped(sync: Any, replica: int) -> None:
    """`replica` stepped an optimizer over `sync`'s parameters: its counts start again."""
    state = _state(sync)
    state.zero_grads[replica] = 0
    if state.watched:
        state.written[replica] = _versions(sync, replica)
        if state.outside is not None:
            state.outside.stepped(replica)


def watched(sync: Any) -> bool:
    """Whether `sync`'s module trains across workers (its passes carry a state)."""
    state = _STATES.get(sync)
    return state is not None and state.watched


def edited(sync: Any, replica: int, changes: int, prints: Prints = ()) -> None:
    """`replica` steps after `changes` changes to its reduced gradients (`gradient_edits`).

    `prints`: (name, `step_check.gradient_prints` value) of each gradient changed.
    """
    _state(sync).edits[replica] = (changes, prints)


# strategy -> {local replica: (the run, calls to unprepared GradScalers in it)}.
_UNPREPARED: weakref.WeakKeyDictionary[Any, dict[int, tuple[int, int]]]
_UNPREPARED = weakref.WeakKeyDictionary()


def unprepared_scaler(strategy: Any, replica: int | None) -> None:
    """`replica` called a `GradScaler` method of a scaler not prepared, in this run.

    Across workers such calls go into the pass's state: one worker that scales its loss
    alone (its scaler never given to `prepare`) sums a scaled gradient with unscaled ones,
    silently on every worker (the bug hunt of session 56); every worker alike is fine.
    """
    if replica is None or getattr(strategy.extended, "_worker_communicator", None) is None:
        return
    runs = strategy._runs
    calls = _UNPREPARED.setdefault(strategy, {})
    run, count = calls.get(replica, (runs, 0))
    calls[replica] = (runs, (count if run == runs else 0) + 1)


def _unprepared(strategy: Any, replica: int) -> int:
    run, count = _UNPREPARED.get(strategy, {}).get(replica, (-1, 0))
    return count if run == strategy._runs else 0


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
    scaled = _unprepared(strategy, replica)
    if scaled:
        value = (value * 1_000_003 + scaled) & 0x7FFF_FFFF_FFFF_FFFF
    return purpose.agreeing(value or 1, lambda: _describe(values, scaled))


def _values(sync: Any, replica: int) -> tuple[Any, ...]:
    """`sync`'s state for `replica` (see the module doc).

    Its zero_grad count, the writes to its parameters since the last step, its modules in
    eval mode, its frozen parameters, the writes outside run to its buffers and its
    optimizers' state since the last step, replica 0's changes to its reduced gradients
    before its last step, the bits of the parameters written other than by a step since
    the last pass (`_param_prints`), then each optimizer's groups.
    """
    state = _state(sync)
    counters = _each_version(sync, replica)
    written = sum(counters) - state.written[replica]
    evaluating = tuple(
        i for i, ref in enumerate(state.modules[replica]) if (m := ref()) and not m.training
    )
    frozen = tuple(i for i, p in enumerate(sync.params(replica)) if not p.requires_grad)
    outside = state.outside
    hand = None if outside is None else outside.values(replica)  # (None: not watched)
    out: list[Any] = [state.zero_grads[replica], written, evaluating, frozen, hand]
    out.append(state.edits[0])  # replica 0's: the others may have copied its changes
    out.append(_param_prints(sync, state, replica, counters))
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


def _edits_text(count: int, prints: Prints) -> str:
    """Replica 0's changes to its reduced gradients before the last step, in words."""
    text = f"{count} changes to the reduced gradients before the last step()"
    if not prints:
        return f"{text} (clip_grad_norm_, p.grad.mul_, p.grad = None)"
    # Two gradients' bits (`step_check.gradient_prints`, cut to 32) fit in `_TEXT_MAX`.
    shown = ", ".join(
        f"{name!r} " + ("None" if value is None else f"#{value & 0xFFFF_FFFF:08x}")
        for name, value in prints[:2]
    )
    more = f" +{len(prints) - 2}" if len(prints) > 2 else ""
    return f"{text}, bits {shown}{more}: edit alike on every worker (seeded noise, no rank scale)"


def _params_text(prints: Prints) -> str:
    """Parameters written other than by the step since the last pass, with their bits."""
    shown = ", ".join(
        f"{name!r} " + ("None" if value is None else f"#{value & 0xFFFF_FFFF:08x}")
        for name, value in prints[:2]
    )
    more = f" +{len(prints) - 2}" if len(prints) > 2 else ""
    # The advice first: the detail of a mismatch is cut short (`_TEXT_MAX`, the call's).
    return f"written outside step() (write alike, seeded noise): {shown}{more}"


def _describe(values: tuple[tuple[Any, ...], ...], scaled: int = 0) -> str:
    """One worker's state in words, for the mismatch message."""
    parts = []
    if scaled:
        parts.append(f"{scaled} calls in this run to a GradScaler not given to prepare")
    for own in values:
        zero_grads, written, evaluating, frozen, hand, edits, params = own[:7]
        rest = own[7:]
        parts.append(f"zero_grad() {zero_grads}x since step()")
        if edits[0]:
            parts.append(_edits_text(*edits))
        parts.append(f"{written} parameter writes since step() (load_state_dict, in-place)")
        if params:
            parts.append(_params_text(params))
        if evaluating:
            parts.append(f"{len(evaluating)} modules in eval mode (#{evaluating[0]} first)")
        if frozen:
            parts.append(f"{len(frozen)} parameters frozen (requires_grad False: #{frozen[0]})")
        parts += outside_run.describe(hand)
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
