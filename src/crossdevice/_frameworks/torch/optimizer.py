"""`MirroredOptimizer`: one copy of a `torch.optim` optimizer per replica.

Keras' `optimizer.apply_gradients` in a replica context all-reduces the gradients and
updates the mirrored variables once per step. Here the gradients are all-reduced during
backward (`MirroredModule`), so each replica's own optimizer copy applies the same
update to its own parameters: state (Adam's moments) is per replica and never shared
between threads, and the copies stay bitwise identical.

The copies are deep copies of the optimizer with each parameter replaced by the
replica's (its state, hyperparameters and hooks copied as they are), not new optimizers
built from `defaults`: that works for every `torch.optim` class and for third-party
optimizers that keep torch's protocol (AdamW's `defaults` hold arguments its constructor
refuses). The step never applies a gradient that was not reduced across replicas:
gradients set by hand (`torch.func`) are reduced at `step()`, and a gradient accumulated
but never reduced is an error. A step closure's loss (LBFGS calls it several times) is
reduced across replicas like the gradients, so every replica takes the same decisions.
Where the replicas store their parameters once and step once, each replica evaluates an
optional closure (SGD's, Adam's) before the step, as torch's optimizers call it once.
Every local replica's step meets the others (`step_check`): a replica that skips a step
or a `zero_grad()` is an error, and state changed in cross-replica context reaches
every replica. Each step's writes to the parameters are logged by their version
counters (`param_edits`), so that other writes inside `run` are compared by value.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from crossdevice._arrays import torch_guard, torch_patches
from crossdevice._frameworks.torch import backward, gradient_edits, step_state
from crossdevice._frameworks.torch.agreement import check_workers_agree, describe_optimizer
from crossdevice._frameworks.torch.gradients import GradientSync
from crossdevice._frameworks.torch.module import MirroredModule
from crossdevice._frameworks.torch.optimizer_hooks import on_every_replica
from crossdevice._frameworks.torch.optimizer_views import ReplicaGroup, ReplicaState
from crossdevice._frameworks.torch.optimizer_zero import plain_zero_grad, zero
from crossdevice._frameworks.torch.param_edits import StepWrites
from crossdevice._frameworks.torch.replicas import local_replica_index, local_replicas
from crossdevice._frameworks.torch.step_check import Edited, StepCheck
from crossdevice._frameworks.torch.threads import all_cores
from crossdevice._strategies.base import Strategy
from crossdevice._strategies.context import get_replica_context

__all__ = ["MirroredOptimizer", "needs_closure"]

# Where one parameter lives: (its module's gradient sync, its index there).
_Where = tuple[GradientSync, int]


class MirroredOptimizer(torch.optim.Optimizer):
    """A torch optimizer over mirrored modules' parameters, one copy per replica.

    Inside `strategy.run`, `step()` and `zero_grad()` act on the running replica's copy;
    `param_groups` (what learning-rate schedulers change) are replica 0's, and every
    replica takes their hyperparameters at each step; with several local replicas they
    are read-only there (each replica would make the change: make it outside `run`, with
    a scheduler, or in `crossdevice.torch.call_once`). Outside `run`, `state` is replica
    0's, and what is changed there (`state.clear()`, a moment zeroed in place) is copied
    to every replica before the next `run`. `state_dict()` is replica 0's and
    `load_state_dict()` loads every copy. Every replica must call `step()` and
    `zero_grad()` alike: a replica that skips one is an error at the step.
    `step(closure)` returns the closure's loss reduced across replicas (the global loss).
    `copy.deepcopy` copies it as plain torch copies an optimizer (see `__deepcopy__`).

    Args:
        optimizer: an optimizer built over parameters of `modules` (replica 0's copies,
            which are the original modules' own parameters). It becomes replica 0's copy.
        modules: the mirrored modules whose parameters it updates.

    Raises:
        ValueError: the optimizer holds a parameter of no mirrored module.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, modules: Sequence[MirroredModule]) -> None:
        # No super().__init__: the wrapped optimizers hold the state (as Accelerate does).
        if isinstance(optimizer, MirroredOptimizer):
            raise TypeError(f"the optimizer is mirrored already: {optimizer!r}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "MirroredOptimizer expects a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}: {optimizer!r}"
            )
        marked = torch_guard.mark_of(optimizer)
        if marked is not None:
            raise ValueError(
                f"the optimizer is replica {marked[1]}'s copy of an optimizer mirrored by "
                f"{marked[0]!r} already; use the MirroredOptimizer that prepare returned"
            )
        if not modules:
            raise ValueError("MirroredOptimizer needs the mirrored modules it optimizes")
        strategies = {id(m.strategy): m.strategy for m in modules}
        if len(strategies) != 1:
            raise ValueError(
                "the mirrored modules of one optimizer must share one strategy, got "
                f"{list(strategies.values())!r}"
            )
        self._setup(optimizer, modules)
        names = {
            id(p): f"{k}:{n}"
            for k, m in enumerate(modules)
            for n, p in m.replicas[0].named_parameters()
        }
        described = describe_optimizer(optimizer, lambda p: names.get(id(p), "?"))
        check_workers_agree(self.__dict__["_strategy"], "optimizers", described)

    def _setup(self, optimizer: torch.optim.Optimizer, modules: Sequence[MirroredModule]) -> None:
        """Mirror `optimizer` (replica 0's) over `modules` (checked by the caller)."""
        strategy: Strategy = modules[0].strategy
        where: dict[int, _Where] = {}
        for module in modules:
            sync: GradientSync = module.__dict__["_gradients"]
            for k, param in enumerate(sync.params(0)):
                where[id(param)] = (sync, k)
        writes = [module.__dict__["_mirror"].step_writes for module in modules]
        for module, own in zip(modules, writes, strict=True):  # compared across workers
            step_state.register(module.__dict__["_gradients"], optimizer, own)
        self.__dict__["_step_writes"] = writes  # what the steps write (`param_edits`)
        self.__dict__["_strategy"] = strategy
        self.__dict__["_where"] = where
        self.__dict__["_modules"] = list(modules)
        for group in optimizer.param_groups:
            self._check_params(group["params"])
        replicas = len(modules[0].replicas)
        shared = _shared(modules, optimizer)
        self.__dict__["_shared"] = shared
        if shared:
            # Parameters stored once: one optimizer, one state, one step per step.
            optimizers = [optimizer] * replicas
            torch_guard.mark(optimizer, strategy, None)
        else:
            optimizers = [optimizer]
            optimizers += [self._replica_copy(optimizer, i) for i in range(1, replicas)]
            for i, replica_optimizer in enumerate(optimizers):
                torch_guard.mark(replica_optimizer, strategy, i)
        self.__dict__["_optimizers"] = optimizers
        self.__dict__["_check"] = check = StepCheck(strategy, optimizers, shared)
        for module in modules:  # `model.zero_grad()` counts as this optimizer's too
            module.__dict__.setdefault("_step_checks", weakref.WeakSet()).add(check)
        self.defaults = optimizer.defaults

    def _check_params(self, params: Sequence[torch.Tensor]) -> None:
        where = self.__dict__["_where"]
        for param in params:
            if id(param) not in where:
                raise ValueError(
                    f"the optimizer updates a parameter of shape {tuple(param.shape)} "
                    "that belongs to no mirrored module; build the optimizer over the "
                    "parameters of the modules you mirror (prepare them together)"
                )

    def _replica(self, param: torch.Tensor, replica: int) -> torch.Tensor:
        sync, k = self.__dict__["_where"][id(param)]
        return sync.params(replica)[k]

    def _replica_copy(self, optimizer: torch.optim.Optimizer, replica: int) -> Any:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        memo: dict[int, Any] = {id(p): self._replica(p, replica) for p in params}
        # Every attribute, not only what Optimizer.__getstate__ keeps (LBFGS keeps its
        # parameter list in `_params`).
        duplicate = object.__new__(type(optimizer))
        duplicate.__dict__.update(copy.deepcopy(optimizer.__dict__, memo))
        # A scheduler wraps `optimizer.step` on the instance to count calls; the copy's
        # would call the original's step.
        duplicate.__dict__.pop("step", None)
        # State tensors go where the replica's parameters are (load_state_dict's rules).
        duplicate.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        return duplicate

    @property
    def shares_storage(self) -> bool:
        """Whether the replicas store parameters once and step one optimizer (`prepare`)."""
        return self.__dict__["_shared"]

    def gradients_of(self, replica: int) -> Any:
        """What holds replica `replica`'s gradients of this optimizer's parameters.

        Its own optimizer; with shared storage (one optimizer), a stable object whose
        `param_groups` list that replica's parameters (for `GradScaler.unscale_`).
        """
        if not self.__dict__["_shared"]:
            return self.__dict__["_optimizers"][replica]
        views = self.__dict__.setdefault("_views", {})
        view = views.get(replica)
        if view is None:
            view = views[replica] = _GradientView()
        groups = self.__dict__["_optimizers"][0].param_groups
        view.param_groups = [
            {**g, "params": [self._replica(p, replica) for p in g["params"]]} for g in groups
        ]
        return view

    @property
    def replicas(self) -> tuple[torch.optim.Optimizer, ...]:
        """Every local replica's optimizer, in replica order."""
        return tuple(self.__dict__["_optimizers"])

    def _index(self) -> int | None:
        return local_replica_index(self.__dict__["_strategy"])

    def _current(self) -> torch.optim.Optimizer:
        index = self._index()
        return self.__dict__["_optimizers"][0 if index is None else index]

    @property
    def param_groups(self) -> list[Any]:
        """Replica 0's parameter groups: change hyperparameters here (schedulers do).

        Inside `strategy.run` with several local replicas, read-only views of them with
        the running replica's own parameters (`optimizer_views.py`): a write there would
        be made once per replica.
        """
        groups = self.__dict__["_optimizers"][0].param_groups
        index = self._index()
        if index is None:
            return groups
        replicas = local_replicas(self.__dict__["_strategy"])
        if replicas == 1:
            return groups
        return [
            ReplicaGroup(g, [self._replica(p, index) for p in g["params"]], replicas)
            for g in groups
        ]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        raise AttributeError("a MirroredOptimizer's param_groups are its replicas'")

    @property
    def state(self) -> Any:
        """The running replica's state (replica 0's in cross-replica context).

        What is changed in cross-replica context reaches every replica before the
        replicas run again. Where the replicas share one optimizer (parameters stored
        once), inside `strategy.run` with several local replicas it is a read-only view
        of that optimizer's state keyed by the running replica's own parameters
        (`optimizer_views.py`).
        """
        index = self._index()
        state = self._current().state
        if index is None or not self.__dict__["_shared"]:
            return state
        replicas = local_replicas(self.__dict__["_strategy"])
        if replicas == 1:
            return state
        groups = self.__dict__["_optimizers"][0].param_groups
        pairs = [(self._replica(p, index), p) for g in groups for p in g["params"]]
        return ReplicaState(state, pairs, replicas, self.__dict__["_check"].writes)

    @state.setter
    def state(self, value: Any) -> None:
        raise AttributeError("a MirroredOptimizer's state is its replicas'")

    def _by_sync(self) -> dict[GradientSync, list[int]]:
        """The optimizer's parameters grouped by module: (gradient sync, indices there)."""
        groups = self.__dict__.get("_groups")
        if groups is None:
            where = self.__dict__["_where"]
            groups = {}
            for group in self.__dict__["_optimizers"][0].param_groups:
                for param in group["params"]:
                    sync, k = where[id(param)]
                    groups.setdefault(sync, []).append(k)
            self.__dict__["_groups"] = groups
        return groups

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the running replica's parameters with its (all-reduced) gradients.

        Gradients set by hand since the last step (`p.grad = ...` without a backward,
        e.g. from `torch.func`) are all-reduced first, as backward would have.

        Args:
            closure: as torch's: re-evaluates the model (forward and backward) on the
                replica's slice; its loss is reduced across replicas and returned. Where
                the replicas store their parameters once, each evaluates it before the
                one step (an optimizer that needs it inside its step, LBFGS, keeps a
                copy per replica).

        Raises:
            RuntimeError: called outside `strategy.run` while several replicas are in sync
                (their gradients are reduced only inside `run`), or a gradient was
                accumulated but never reduced, or a reduced gradient was replaced, or
                another local replica did not step too, or called `zero_grad()` a
                different number of times.
        """
        optimizer, closure, loss, once, index, groups, seen = _before_step(self, closure)
        # The replica's own optimizer step is what torch.compile may compile (as plain
        # torch's); around it, the checks and collectives run eagerly (`_ready_for_dynamo`).
        result = _meet_once(self, optimizer, index, seen) if once else optimizer.step(closure)
        _after_step(self, groups, index, None if once else seen)
        return loss if once else result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: the running replica's, or every replica's outside `run`."""
        index = self._index()
        optimizers = self.__dict__["_optimizers"]
        shared = self.__dict__["_shared"]
        groups = self._by_sync()
        if index is not None:
            self.__dict__["_check"].zeroed(index)
            for sync in groups:
                step_state.zeroed(sync, index)
        for r in range(len(optimizers)) if index is None else [index]:
            optimizer = optimizers[r]
            if shared or plain_zero_grad(optimizer):
                # torch's own loop, without its profiler range (one per call, the most
                # of its cost per step) unless a profiler records it.
                zero(
                    [p for g in optimizer.param_groups for p in g["params"]]
                    if not shared
                    else [sync.params(r)[k] for sync, ks in groups.items() for k in ks],
                    set_to_none,
                )
            else:
                optimizer.zero_grad(set_to_none)  # its class clears its own way
            for sync, indices in groups.items():
                sync.new_step(r, indices)

    register_step_pre_hook = on_every_replica("register_step_pre_hook")
    register_step_post_hook = on_every_replica("register_step_post_hook")
    register_state_dict_pre_hook = on_every_replica("register_state_dict_pre_hook")
    register_state_dict_post_hook = on_every_replica("register_state_dict_post_hook")
    register_load_state_dict_pre_hook = on_every_replica("register_load_state_dict_pre_hook")
    register_load_state_dict_post_hook = on_every_replica("register_load_state_dict_post_hook")

    def state_dict(self) -> dict[str, Any]:
        """The running replica's `state_dict` (replica 0's in cross-replica context)."""
        return self._current().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load `state_dict` into every replica's optimizer (outside `strategy.run`)."""
        if self._index() is not None:
            raise RuntimeError("load the optimizer's state outside strategy.run")
        for optimizer in dict.fromkeys(self.__dict__["_optimizers"]):  # once if shared
            optimizer.load_state_dict(copy.deepcopy(state_dict))
        self.__dict__["_check"].loaded()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of the mirrored modules' parameters to every replica's optimizer.

        `param_group["params"]` are replica 0's parameters (what the mirrored modules'
        `parameters()` give outside `strategy.run`). Call it outside `strategy.run`.
        """
        if self._index() is not None:
            raise RuntimeError("add parameter groups outside strategy.run")
        params = param_group.get("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params or ())
        self._check_params(params)
        optimizers = self.__dict__["_optimizers"]
        for r, optimizer in enumerate(optimizers[:1] if self.__dict__["_shared"] else optimizers):
            group = dict(param_group)
            group["params"] = [self._replica(p, r) for p in params]
            optimizer.add_param_group(group)
        self.__dict__.pop("_groups", None)
        self.__dict__["_check"].loaded()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy as plain torch's: over the copies of the parameters that `memo` makes.

        Plain torch copies an optimizer with its parameters: `copy.deepcopy(optimizer)`
        alone is over new tensors in no model, and `copy.deepcopy((model, optimizer))`
        (one memo) over the copied model's. So where this deep copy has copied every
        mirrored module the optimizer updates before it (the model first in a tuple, a
        dict, an object), the copy is a `MirroredOptimizer` over those copies, with the
        state and hyperparameters of replica 0's optimizer. Otherwise it is replica 0's
        optimizer deep-copied as plain torch copies it: a plain optimizer over copies of
        replica 0's parameters (or what `memo` maps them to: the copied model's replica 0
        parameters when the model is copied after it), which `prepare(model, optimizer)`
        mirrors.

        Raises:
            RuntimeError: called inside `strategy.run` (as a mirrored module's is).
        """
        if self._index() is not None:
            raise RuntimeError(
                "copy.deepcopy of a MirroredOptimizer was called inside strategy.run, where "
                "each replica would copy it; deep-copy it (with its model) outside "
                "strategy.run"
            )
        first = self.__dict__["_optimizers"][0]
        modules = self.__dict__["_modules"]
        copies = [c for m in modules if isinstance(c := memo.get(id(m)), MirroredModule)]
        if len(copies) < len(modules):
            return copy.deepcopy(first, memo)
        # torch's protocol (`__getstate__`: defaults, state, param_groups), then what it
        # leaves out, so that the copy steps as the original does (LBFGS's `_params`);
        # not a scheduler's wrapper of `step` on the instance.
        duplicate = copy.deepcopy(first, memo)
        for name, value in first.__dict__.items():
            if name not in duplicate.__dict__ and name != "step":
                duplicate.__dict__[name] = copy.deepcopy(value, memo)
        new = MirroredOptimizer.__new__(MirroredOptimizer)
        new._setup(duplicate, copies)  # the copies of agreed objects agree: no collective
        return new

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "a MirroredOptimizer cannot be pickled (its strategy cannot); save its "
            "state_dict(), or pickle its replica 0's optimizer, optimizer.replicas[0]"
        )

    def __repr__(self) -> str:
        optimizers = self.__dict__["_optimizers"]
        return f"MirroredOptimizer({len(optimizers)} replicas):\n{optimizers[0]!r}"


class _GradientView:
    """One replica's parameters in an optimizer's groups (`gradients_of`)."""

    param_groups: list[dict[str, Any]]


def _shared(modules: Sequence[MirroredModule], optimizer: torch.optim.Optimizer) -> bool:
    """Whether the modules store their parameters once; refuses a mix, and closures."""
    sharing = {m.shares_storage for m in modules}
    if len(sharing) > 1:
        raise ValueError(
            "one optimizer over mirrored modules that store their parameters once and "
            "modules that copy them per replica: prepare them alike (share_storage=)"
        )
    shared = sharing.pop()
    if shared and needs_closure(optimizer):
        raise ValueError(
            f"{type(optimizer).__name__}.step needs a closure, which evaluates the model on "
            "each replica, and the model stores its parameters once for all replicas (one "
            "step for all): prepare it with share_storage=False"
        )
    return shared


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` requires a closure (LBFGS)."""
    parameter = inspect.signature(type(optimizer).step).parameters.get("closure")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _step_once(optimizer: torch.optim.Optimizer, writes: Sequence[StepWrites]) -> Any:
    """The one optimizer step of replicas that store parameters once (in a merge_fn).

    The replicas wait meanwhile: torch may use every core (`threads.all_cores`). Its
    writes are replica 0's parameters' (`param_edits`).
    """
    before = [own.read(0) for own in writes]
    with all_cores():
        result = optimizer.step()
    for own, seen in zip(writes, before, strict=True):
        own.stepped(0, seen)
    return result


def _reduced_closure(closure: Callable[[], Any], op: Any) -> Callable[[], Any]:
    """`closure`, its loss reduced across replicas (the gradients are by backward)."""

    def reduced() -> Any:
        loss = closure()
        if loss is None:
            return None
        ctx = get_replica_context()
        assert ctx is not None
        value = loss.detach() if isinstance(loss, torch.Tensor) else torch.as_tensor(loss)
        return ctx.all_reduce(op, value)

    return reduced


def _before_step(
    self: MirroredOptimizer, closure: Callable[[], Any] | None
) -> tuple[Any, Callable[[], Any] | None, Any, bool, int, dict[GradientSync, list[int]], Any]:
    """Checks and by-hand reductions before a step.

    Returns:
        (optimizer, closure for its step, loss, once, index, groups, seen). `once`: the
        replicas store their parameters once and meet to step once, without a closure:
        each has evaluated it already, and `loss` is what it returned, reduced; `seen`
        is then the replica's changes to its reduced gradients (`gradient_edits`),
        else its parameters' version counters before its step (`param_edits`).
    """
    index = self._index()
    backward.refuse_step_in_pass()
    optimizers = self.__dict__["_optimizers"]
    strategy: Strategy = self.__dict__["_strategy"]
    meet = index is not None and local_replicas(strategy) > 1
    if index is None:
        if strategy.num_replicas_in_sync > 1:
            raise RuntimeError(
                "MirroredOptimizer.step() was called outside strategy.run with "
                f"{strategy.num_replicas_in_sync} replicas in sync; call it inside the "
                "step function, after backward (gradients are all-reduced there)"
            )
        index = 0
    optimizer = optimizers[index]
    check: StepCheck = self.__dict__["_check"]
    shared = self.__dict__["_shared"]
    groups = self._by_sync()
    if meet and not shared:
        # Before anything changes: a replica that skipped the step fails the round.
        check.meet(strategy, index, edits=gradient_edits.before_step(groups, index, True))
    elif not shared:
        gradient_edits.before_step(groups, index, False)  # (across workers: recorded)
    if index and not shared:
        # Schedulers change replica 0's groups; every replica follows them.
        for source, target in zip(optimizers[0].param_groups, optimizer.param_groups, strict=True):
            for key, value in source.items():
                if key != "params":
                    target[key] = value
    loss = None
    if shared and meet and closure is not None:
        # One step for all replicas, so the closure cannot run inside it (it would
        # evaluate one replica's slice). torch's optimizers that take an optional closure
        # call it once, under enable_grad, before they update: each replica does that
        # here (its backward reduces the gradients), then the one step runs without it.
        # LBFGS, which needs its closure inside the step, keeps a copy per replica.
        with torch.enable_grad():
            loss = _reduced_closure(closure, next(iter(groups)).op)()
        closure = None
    for sync, indices in groups.items():
        if sync.enabled:
            by_hand = sync.check_step(index, indices)
            if by_hand:
                sync.reduce_by_hand(index, by_hand)
    if shared:
        # After the closure (its backward makes new gradients): after gradient
        # accumulation each replica holds its own, and the one step reads replica 0's,
        # so the replicas' changes to them are compared at the meeting (`_meet_once`).
        edits = gradient_edits.before_step(groups, index, meet)
        if meet:
            return optimizer, None, loss, True, index, groups, edits
    if closure is not None and strategy.num_replicas_in_sync > 1:
        closure = _reduced_closure(closure, next(iter(groups)).op)
    writes: list[StepWrites] = self.__dict__["_step_writes"]
    return optimizer, closure, None, False, index, groups, [w.read(index) for w in writes]


def _meet_once(
    self: MirroredOptimizer, optimizer: torch.optim.Optimizer, index: int, edits: Edited
) -> Any:
    """The one step of replicas that store their parameters once: they meet for it."""
    check: StepCheck = self.__dict__["_check"]
    writes = self.__dict__["_step_writes"]
    then = functools.partial(_step_once, optimizer, writes)
    return check.meet(self.__dict__["_strategy"], index, then, edits=edits)


def _after_step(
    self: MirroredOptimizer,
    groups: dict[GradientSync, list[int]],
    index: int,
    seen: list[list[int] | None] | None,
) -> None:
    """Count the step: its writes (`seen`: the versions before it), new buckets."""
    if seen is not None:
        for own, before in zip(self.__dict__["_step_writes"], seen, strict=True):
            own.stepped(index, before)
    for sync, indices in groups.items():
        sync.new_step(index, indices)
        sync.steps[index] += 1
        step_state.stepped(sync, index)


def _ready_for_dynamo() -> None:
    """Keep `MirroredOptimizer`'s checks and collectives out of torch.compile's graphs.

    A compiled training step calls `step()` and `zero_grad()` from traced code: they read
    this thread's replica and meet the other replicas, so dynamo runs them eagerly
    (traced, the first replica's index was baked in and the counts went astray: the bug
    hunt of session 54), but still compiles the replica's own optimizer step.
    """
    global _before_step, _meet_once, _after_step
    import torch._dynamo

    torch._dynamo.decorators.skip(MirroredOptimizer.step)
    _before_step = torch._dynamo.disable(_before_step)  # type: ignore[no-untyped-call]
    _meet_once = torch._dynamo.disable(_meet_once)  # type: ignore[no-untyped-call]
    _after_step = torch._dynamo.disable(_after_step)  # type: ignore[no-untyped-call]
    zero_grad = torch._dynamo.disable(MirroredOptimizer.zero_grad)  # type: ignore[no-untyped-call]
    MirroredOptimizer.zero_grad = zero_grad  # type: ignore[method-assign]


torch_patches.on_dynamo(_ready_for_dynamo)
