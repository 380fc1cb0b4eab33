"""Keep a mirrored module's replica copies identical: copies, cross-replica changes, compile.

* `make_replicas`: one copy per local replica device (replica 0's is the original),
  compiled submodules compiled again on each copy (a deep copy would call the
  original's compiled code), tensors the module derived from its parameters derived
  again from each copy's own (`derived`).
* `ReplicaMirror`: between `strategy.run` calls and inside a `merge_fn`, a mirrored
  module reads like replica 0's copy (TF's `MirroredVariable` in cross-replica context).
  Code there may change that copy alone: freeze a layer (`requires_grad_`), initialise
  weights in place, switch a submodule to eval mode, update an averaged model. The
  mirror records replica 0's state when such a section starts and, when it ends, gives
  every replica what replica 0 has (`sections`): changed parameter and buffer values
  (found by torch's version counters, so writes through `.data` go unseen),
  `requires_grad` flags and submodules' training flags (a buffer written in place is
  written in place on every copy, so a view of it that the module keeps follows).
  Replicas never run meanwhile. Plain attributes set on replica 0's submodules
  (`attributes`) and gradients changed on replica 0 (`outside_gradients`) follow too;
  with one local replica, buffers written there count as agreed (`_buffers_written`).
  Inside `run`, a replica may write its parameters in place only as every replica does
  (with one copy each: the same number of writes, and parameters written other than by
  the optimizer's step must hold the same bits on every replica when the replica code
  ends: `param_edits.py`; with shared storage: none).
* A run that raised: its exception reaches the caller as itself (`enter_cross_replica`).
  The checks above (and `BufferSync.settle`) would find a run cut off halfway (a
  replica's BatchNorm updated, its combining never reached) and raise their own error
  during the handling of the real one; instead the local replicas are brought to agreed
  state without raising (`_after_failed_run`).
* `compiled_context` / `compile_replicas`: `torch.compile` applied to each replica's
  module, never to the mirrored module's own dispatch code.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from crossdevice._core import context
from crossdevice._frameworks.torch.attributes import AttributeMirror
from crossdevice._frameworks.torch.buffers import BufferSync
from crossdevice._frameworks.torch.derived import copy_module
from crossdevice._frameworks.torch.hooks import HookMirror
from crossdevice._frameworks.torch.outside_gradients import GradientMirror
from crossdevice._frameworks.torch.param_edits import StepWrites, check_values, other_writes
from crossdevice._frameworks.torch.storage import ParameterCheck, realias

__all__ = [
    "ReplicaMirror",
    "compile_replicas",
    "compiled_context",
    "copy_replicas",
    "make_replicas",
    "recompile_copy",
]

_VERSION = operator.attrgetter("_version")


def compiled_context(compiled_call: Callable[..., Any]) -> Any:
    """The `torch.compile` context behind a module's `_compiled_call_impl`.

    Raises:
        RuntimeError: this torch keeps it elsewhere.
    """
    code = getattr(compiled_call, "__code__", None)
    closure = getattr(compiled_call, "__closure__", None) or ()
    for name, cell in zip(getattr(code, "co_freevars", ()), closure, strict=False):
        if name == "self" and callable(cell.cell_contents):
            return cell.cell_contents
    raise RuntimeError(
        "a submodule was compiled in place (module.compile()) before mirroring, and this "
        "torch version does not expose how; compile after mirroring instead: "
        "prepared_model.compile(...)"
    )


def recompile_copy(original: torch.nn.Module, copy_: torch.nn.Module) -> None:
    """Give each compiled submodule of `copy_` its own compiled call, as in `original`."""
    for source, target in zip(original.modules(), copy_.modules(), strict=True):
        compiled = source.__dict__.get("_compiled_call_impl")
        if compiled is not None:
            target._compiled_call_impl = compiled_context(compiled)(target._call_impl)


def make_replicas(
    module: torch.nn.Module, devices: Sequence[torch.device], shared: bool = False
) -> list[torch.nn.Module]:
    """`module` moved to `devices[0]`, and a deep copy on each other device.

    With `shared`, the copies' parameters are aliases of replica 0's (`alias`): their
    own `Parameter` objects over the same storage; buffers are copied. Tensors the
    module derived from its parameters are derived again from each copy's own
    (`derived.copy_module`).
    """
    replicas = [module.to(devices[0])]
    for device in devices[1:]:
        memo: dict[int, Any] = {}
        if shared:
            memo.update({id(p): alias(p) for p in module.parameters()})
        replica = copy_module(module, memo, device)
        recompile_copy(module, replica)
        replicas.append(replica)
    return replicas


def copy_replicas(
    replicas: Sequence[torch.nn.Module], memo: dict[int, Any], shared: bool
) -> list[torch.nn.Module]:
    """Deep copies of every replica's module (`copy.deepcopy` of a mirrored module).

    With `shared`, the copies' parameters alias the first copy's, as the originals did.
    """
    first = copy_module(replicas[0], memo)
    recompile_copy(replicas[0], first)
    copies = [first]
    for replica in replicas[1:]:
        if shared:
            for own, new in zip(replica.parameters(), first.parameters(), strict=True):
                memo[id(own)] = alias(new)
        duplicate = copy_module(replica, memo)
        recompile_copy(replica, duplicate)
        copies.append(duplicate)
    return copies


def alias(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """A new `Parameter` over `param`'s storage, with its own version counter and `.grad`.

    Autograd, hooks and `.grad` stay per replica; values are stored once. Its own version
    counter tells an in-place write through it from one through `param` (`ReplicaMirror`).
    """
    made = torch.nn.Parameter(torch.empty(0, dtype=param.dtype, device=param.device), False)
    realias(made, param)
    made.requires_grad_(param.requires_grad)
    made.__dict__.update(param.__dict__)  # attributes a library set on the parameter
    return made


def compile_replicas(replicas: Sequence[torch.nn.Module], context: Any) -> None:
    """Compile every replica's module in place with one `torch.compile` context."""
    for replica in replicas:
        replica._compiled_call_impl = context(replica._call_impl)


class ReplicaMirror:
    """Gives every replica replica 0's changes made in cross-replica code (module doc).

    Gradient buckets follow the `requires_grad` flags by themselves (`GradientSync`).

    With shared storage the values need no copying; instead an in-place write to a
    parameter inside `strategy.run` (not in a `merge_fn`) is an error naming it: every
    replica would apply its own write to the one tensor.

    It also keeps each replica's parameter objects and memory as prepared
    (`ParameterCheck`: `model.float()`, `param.data = ...`), gives every replica the
    hooks registered on replica 0 (`HookMirror`), and combines buffers that a replica
    changed outside a forward of the mirrored module (`BufferSync.settle`) when a run
    ends.

    Args:
        replicas: every local replica's module.
        buffers: their buffer aggregation, told when buffers are set from replica 0.
        shared: the replicas' parameters share replica 0's storage (`alias`).
        own_hooks: the handle ids of the library's own hooks on the replicas' parameters.
    """

    def __init__(
        self,
        replicas: Sequence[torch.nn.Module],
        buffers: BufferSync,
        shared: bool = False,
        own_hooks: Callable[[], Collection[int]] = tuple,
    ) -> None:
        self._shared = shared and len(replicas) > 1
        self._names = [name for name, _ in replicas[0].named_parameters()]
        self._running: list[list[int]] = []  # every replica's parameter versions in run
        #: Each replica's optimizer steps (`MirroredOptimizer.step` logs them), and their
        #: log since `_running` was taken, with a copy per replica (`_others`).
        params = [list(r.parameters()) for r in replicas]
        self.step_writes = StepWrites(params, self._shared)
        self._steps = None if self._shared or len(replicas) < 2 else self.step_writes.listen()
        self._in_run = False
        self._replicas = list(replicas)
        self._params = [list(r.parameters()) for r in replicas]
        self._modules = [list(r.modules()) for r in replicas]
        self._buffer_slots = [
            [(m, name) for m in r.modules() for name in m._buffers] for r in replicas
        ]
        self._buffers = buffers
        self._record: tuple[Any, ...] = ()
        # The exception the caller was handling when the run started (`strategy.run`
        # called in an `except` block), else None: one handled at the run's end that is
        # not this one is the run's own (`_run_failed`).
        self._handling: BaseException | None = None
        self.storage = ParameterCheck(replicas, self._names, self._shared)
        # Where replica 0's parameters sit, by name: a renamed one is told apart (`_renamed`).
        self._slots = [
            (prefix, module._parameters, name, param)
            for prefix, module in replicas[0].named_modules()
            for name, param in module._parameters.items()
            if param is not None
        ]
        self._hooks = HookMirror(replicas, own_hooks)
        several = len(replicas) > 1
        self._attributes = AttributeMirror(replicas) if several else None
        self._grads = GradientMirror(self._params) if several else None
        # Replica 0's buffers (object, version) when cross-replica code started, with one
        # local replica (`_buffers_written`).
        self._buffer_marks: list[tuple[int, int] | None] = []
        self.enter_cross_replica()

    def _state(self) -> tuple[Any, ...]:
        params = self._params[0]
        buffers = [m._buffers[name] for m, name in self._buffer_slots[0]]
        return (
            [p._version for p in params],
            [p.requires_grad for p in params],
            [None if b is None else (id(b), b._version) for b in buffers],
            [m.training for m in self._modules[0]],
        )

    def _buffer_state(self) -> list[tuple[int, int] | None]:
        return [
            None if b is None else (id(b), b._version)
            for b in (m._buffers[name] for m, name in self._buffer_slots[0])
        ]

    def _buffers_written(self) -> None:
        """With one local replica: buffers written by cross-replica code count as agreed.

        `model.load_state_dict(...)`, `model.to(torch.float64)`, `model.scale.mul_(1.5)`
        between steps: without this, the next forward took such a write for one of its
        own and refused it (`BufferSync.after_forward`), on every worker alike. With
        several local replicas `_propagate` refreshes the buffers it copies.
        """
        marks, self._buffer_marks = self._buffer_marks, []
        if marks and marks != self._buffer_state():
            self._buffers.refresh(0)

    def enter_cross_replica(self) -> None:
        """Remember replica 0's state (the replicas agree on it now).

        After a run that raised, nothing here raises: the run's exception reaches the
        caller as itself (`_after_failed_run`).

        Raises:
            RuntimeError: with shared storage, code inside `strategy.run` changed a
                parameter in place.
        """
        ran = self._in_run  # (a run that raised compares nothing)
        if self._in_run and self._run_failed():
            self._in_run = ran = False
            self._after_failed_run()
        if self._in_run and len(self._replicas) == 1:  # alone here, among several workers
            self._in_run = False
            self._buffers.settle()
        if len(self._replicas) == 1:
            self._buffer_marks = self._buffer_state()
            return
        if self._in_run:  # a run (or the code before a merge_fn) has just ended
            self._in_run = False
            if self._running:
                self._check_unchanged() if self._shared else self._check_alike()
            self.storage.follow_first(in_run=True)
            self._buffers.settle()
        self._hooks.enter_cross_replica()
        self._record = self._state()
        assert self._attributes is not None
        assert self._grads is not None
        self._attributes.forget(compare=ran)  # set inside the run: each replica's own
        self._grads.record()

    def _run_failed(self) -> bool:
        """Whether the run ending now raised (an exception is on its way to the caller).

        `strategy.run` calls `enter_cross_replica` in a `finally` clause: the exception
        handled there is the run's own, unless the caller called `run` while handling
        that same exception (an `except` block), as recorded when the run started.
        """
        pending = sys.exception()
        return pending is not None and pending is not self._handling

    def _after_failed_run(self) -> None:
        """Bring the local replicas to agreed state after a run that raised; never raise.

        The run may have stopped anywhere: a replica's BatchNorm updated its statistics
        while another raised before its own update or before their combining; a replica
        wrote a parameter in place that another never reached. Checking that as after a
        whole run would raise an error about correct code in place of the run's own.
        Instead each parameter some replicas wrote and others did not takes replica 0's
        value, and the buffers are combined among the local replicas (`BufferSync.
        after_failed_run`): the next run starts from values every local replica agrees
        on, and checks its own changes as usual. A check that fails anyway (a parameter
        object replaced inside the run) becomes a note on the run's exception.
        """
        pending = sys.exception()
        cleanups = [self._buffers.after_failed_run]
        if len(self._replicas) > 1:
            cleanups = [self._realign_parameters, self._follow_first_memory, *cleanups]
        for cleanup in cleanups:
            try:
                cleanup()
            except Exception as also:  # the run's own exception is the one to raise
                if pending is not None:
                    pending.add_note(
                        "bringing the replicas to agreed state after this failed run "
                        f"failed too: {also!r}"
                    )
        self._running = []

    def _follow_first(self) -> None:
        """`ParameterCheck.follow_first`, its error told when a parameter was renamed."""
        try:
            self.storage.follow_first()
        except RuntimeError as error:
            renamed = self._renamed()
            if renamed is None:
                raise
            old, new = renamed
            raise RuntimeError(
                f"parameter {old!r} of replica 0's copy of a mirrored module is no longer the "
                f"parameter of that name: its module now keeps it as {new!r}. torch.nn.utils."
                "prune renames the parameter it prunes ('weight' becomes 'weight_orig' at its "
                "first pruning, 'weight' again at prune.remove), and a prepared model keeps "
                "its parameters' names. Prune before crossdevice.torch.prepare (pruning an "
                "already-pruned parameter again between steps works: prune.l1_unstructured("
                "model[0], 'weight', amount)), and make pruning permanent (prune.remove) once "
                "training with the mirrored model is done: replica 0's module, model.module, "
                "then holds the pruned weights, to save or evaluate"
            ) from error

    def _renamed(self) -> tuple[str, str] | None:
        """(old, new) name of a parameter of replica 0 that its module now keeps elsewhere."""
        for prefix, owner, name, param in self._slots:
            if owner.get(name) is not param:
                for other, value in owner.items():
                    if value is param:
                        return _dotted(prefix, name), _dotted(prefix, other)
        return None

    def _realign_parameters(self) -> None:
        """Give every replica replica 0's value of each parameter written unequally."""
        if not self._running or self._shared:  # shared: one tensor, nothing to copy
            return
        now, before = self._versions(), self._running
        writes = [list(map(operator.sub, a, b)) for a, b in zip(now, before, strict=True)]
        others = self._others(now, before)  # (each replica's own noise: maybe apart too)
        with torch.no_grad():
            for k in range(len(self._names)):
                if k in others or len({w[k] for w in writes}) > 1:
                    source = self._params[0][k]
                    for params in self._params[1:]:
                        params[k].copy_(source)

    def _follow_first_memory(self) -> None:
        self.storage.follow_first(in_run=True)

    def _versions(self) -> list[list[int]]:
        return [list(map(_VERSION, params)) for params in self._params]

    def _check_alike(self) -> None:
        """With a copy per replica, each parameter was written alike on every replica.

        A write on some replicas only (`if replica == 0: p.mul_(0.9)`) would leave the
        copies apart for good, and so would writes alike in number but not in value
        (each replica's own noise): parameters written other than by the optimizer's
        step are compared by their bits (`param_edits.check_values`). Writes through
        `.data` go unseen (torch counts none). Reading the counters and comparing took
        about 0.1 ms for 200 parameters on 4 replicas (2-core host, loaded), once at each
        end of a run's replica code.
        """
        now, before = self._versions(), self._running
        writes = [list(map(operator.sub, a, b)) for a, b in zip(now, before, strict=True)]
        if all(w == writes[0] for w in writes[1:]):
            others = self._others(now, before)
            if others:
                self._running = []
                check_values(self._params, self._names, sorted(others), writes)
            return
        self._running = []
        k = next(k for k in range(len(self._names)) if len({w[k] for w in writes}) > 1)
        each = ", ".join(f"replica {r}: {w[k]}" for r, w in enumerate(writes))
        raise RuntimeError(
            f"parameter {self._names[k]!r} of a mirrored module was changed in place inside "
            f"strategy.run by some replicas only (in-place writes: {each}), so their copies "
            "now differ. Change parameters alike on every replica, or outside strategy.run "
            "(every replica then follows replica 0), or once with crossdevice.torch.call_once"
        )

    def _others(self, now: list[list[int]], before: list[list[int]]) -> set[int]:
        """The parameters some replica wrote other than by its optimizer's steps."""
        assert self._steps is not None
        found: set[int] = set()
        for a, b, steps in zip(now, before, self._steps, strict=True):
            found.update(other_writes(b, a, steps))
        return found

    def _check_unchanged(self) -> None:
        now = self._versions()
        for replica, (before, after) in enumerate(zip(self._running, now, strict=True)):
            for k, (a, b) in enumerate(zip(before, after, strict=True)):
                if a != b:
                    self._running = []
                    raise RuntimeError(
                        f"parameter {self._names[k]!r} of a mirrored module was changed in "
                        f"place inside strategy.run (replica {replica}'s copy): the replicas "
                        "store parameters once, so every replica's write lands on the same "
                        "tensor. Change parameters outside strategy.run, or once for all "
                        "replicas with crossdevice.torch.call_once(fn) (the optimizer's "
                        "step does); or prepare the model with share_storage=False"
                    )

    def leave_cross_replica(self) -> None:
        """Copy whatever cross-replica code changed on replica 0 to every other replica."""
        if not _in_replica():  # a run starts (not a merge_fn's end, whose error is the run's)
            self._handling = sys.exception()
        if len(self._replicas) == 1:
            self._in_run = True
            self._buffers_written()
            return
        try:
            self._follow_first()
            self._propagate()
            self._hooks.leave_cross_replica()
            self._follow_changes(again=False)
        finally:
            self._in_run = True
            self._running = self._versions()
            for steps in self._steps or ():  # the steps from here on
                steps.clear()

    def sync_now(self) -> None:
        """Bring every replica to replica 0's state now (cross-replica code)."""
        if len(self._replicas) > 1:
            self._follow_first()
            self._propagate()
            self._hooks.leave_cross_replica()
            self._follow_changes(again=True)

    def _follow_changes(self, again: bool) -> None:
        """Plain attributes and gradients cross-replica code changed on replica 0.

        `again`: cross-replica code goes on (`sync_now`), and its later gradient changes
        are followed too; else a run starts, which holds no reference to old gradients.
        """
        assert self._attributes is not None
        assert self._grads is not None
        self._attributes.follow()
        self._grads.follow()
        if again:
            self._grads.record()

    def settled(self) -> None:
        """Every replica was changed alike (`MirroredModule._apply`): record that state.

        Raises:
            RuntimeError: a parameter object was replaced (`ParameterCheck`).
        """
        self.storage.follow_first()
        self.storage.record()
        for r in range(len(self._replicas)):  # with one replica too (`_buffers_written`)
            self._buffers.refresh(r)
        if len(self._replicas) > 1:
            self._record = self._state()
        elif self._buffer_marks:
            self._buffer_marks = self._buffer_state()

    def _propagate(self) -> None:
        now = self._state()
        if now == self._record:
            return
        versions, flags, buffers, training = now
        old_versions, old_flags, old_buffers, old_training = self._record
        with torch.no_grad():
            for k, (v, old) in enumerate(zip(versions, old_versions, strict=True)):
                if v != old and not self._shared:  # shared values need no copy
                    source = self._params[0][k]
                    for params in self._params[1:]:
                        params[k].copy_(source)
            for k, (b, old) in enumerate(zip(buffers, old_buffers, strict=True)):
                if b != old:
                    module, name = self._buffer_slots[0][k]
                    source_buffer = module._buffers[name]
                    same = b is not None and old is not None and b[0] == old[0]
                    for r, slots in enumerate(self._buffer_slots[1:], start=1):
                        target_module, target_name = slots[k]
                        target = target_module._buffers[target_name]
                        if (
                            same
                            and target is not None
                            and source_buffer is not None
                            and _fits(target, source_buffer)
                        ):
                            # written in place on replica 0: in place here too, so a view
                            # of the buffer kept by the module follows (`derived`)
                            target.copy_(source_buffer)
                            continue
                        target_module._buffers[target_name] = (
                            None
                            if source_buffer is None
                            else source_buffer.detach().clone().to(self._device(r))
                        )
        if flags != old_flags:
            for k, flag in enumerate(flags):
                for params in self._params[1:]:
                    params[k].requires_grad_(flag)
        if training != old_training:
            for k, mode in enumerate(training):
                for modules in self._modules[1:]:
                    modules[k].training = mode
        for r in range(len(self._replicas)):
            self._buffers.refresh(r)
        self._record = self._state()

    def _device(self, replica: int) -> torch.device:
        for tensor in (*self._params[replica], *self._replicas[replica].buffers()):
            return tensor.device
        return torch.device("cpu")


def _fits(target: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether `source`'s values can be copied into `target` in place."""
    return (
        target is not source
        and (target.shape, target.dtype) == (source.shape, source.dtype)
        and not target.is_inference()
    )


def _dotted(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _in_replica() -> bool:
    """Whether a replica's code is on this thread's context stack (a merge_fn runs)."""
    return any(frame.replica_context is not None for frame in context.copy_stack())
