"""One step, one update: shared stateful objects called inside `strategy.run`.

Every replica runs the step function, so an object that all replicas share and that
changes its own state when called (an LR scheduler's `step()`, an averaged model's
`update_parameters()`) would change N times per step. TF avoids this by design: such
updates go through `merge_call`, which runs once, in cross-replica context. `call_once`
is that rule for any callable, and these torch methods are routed through it while a
strategy with several replicas is in use (`torch_patches`):

* `step()` of every `torch.optim.lr_scheduler.LRScheduler` (subclasses included, also
  those defined later) and of `ReduceLROnPlateau`;
* `torch.optim.swa_utils.AveragedModel.update_parameters()`;
* `torch.nn.utils.clip_grad_norm_`, `clip_grad_value_` and `clip_grads_with_norm_` (the
  second half of torch's two-step clipping, after `get_total_norm`) over the parameters
  of replicas that keep one reduced gradient (storage shared on the host): clipped once,
  on replica 0's parameters, whose gradients every replica sees. These are torch.nn.utils'
  helpers that change gradients in place; `get_total_norm` only reads them (with a copy
  per replica, the running replica's own: `owners.own_gradients`).

Inside a replica, every replica must make the call (it is a rendezvous, like
`merge_call`); it runs once, and every replica gets its result. Its arguments must agree
across replicas: a metric that differs per replica is an error naming it (reduce it
first with `ReplicaContext.all_reduce`); across workers, the numbers it is given (a
metric) are compared too, so `ReduceLROnPlateau.step(local_loss)` is an error on every
worker, not learning rates that drift apart. Outside `strategy.run`, and on a strategy
with one replica in all, the call is an ordinary call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final

import torch

from crossdevice._arrays import torch_patches
from crossdevice._core import context, nest
from crossdevice._frameworks.torch.once_gradients import GradientWrites
from crossdevice._frameworks.torch.owners import canonical, own_copies, own_gradients
from crossdevice._sync.call import digest
from crossdevice._values.values import PerReplica

__all__ = ["call_once"]

_is_compiling: Final = torch.compiler.is_compiling


def call_once(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `fn(*args, **kwargs)` once per step, however many replicas call this.

    Inside `strategy.run` every local replica must call it at the same point of the
    step: `fn` runs once, in cross-replica context (TF's `merge_call`), and each replica
    gets its result. Elsewhere it calls `fn` directly. `fn` sees replica 0's copy of a
    mirrored model; what it does to its gradients (in place, replaced, set to None)
    reaches every replica's `.grad`, bitwise (`once_gradients.py`), as its changes to
    parameters and optimizer state do.

    Args:
        fn: the callable; it changes state that the replicas share.
        *args: its arguments, the same on every replica (equal tensors are accepted).
        **kwargs: its keyword arguments, likewise.

    Returns:
        What `fn` returns.

    Raises:
        ValueError: an argument differs between replicas, of this worker or of any
            other (numbers are compared across workers, by a digest in one small
            all-reduce, where the call passes any).
        RuntimeError: `fn` gave a mirrored parameter a gradient where it had none.

    Example:
        >>> import crossdevice, crossdevice.torch
        >>> strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> calls = []
        >>> _ = strategy.run(lambda: crossdevice.torch.call_once(calls.append, "step"))
        >>> calls
        ['step']
    """
    return _call_once(fn, args, kwargs, across_workers=True)


def _call_once(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], across_workers: bool
) -> Any:
    """`call_once`; `across_workers`: compare the arguments' numbers across workers too."""
    frame = context.current_frame()
    if frame is None or frame.replica_context is None:
        return fn(*args, **kwargs)
    local = len(frame.strategy.extended.worker_devices)
    if across_workers and frame.strategy.num_replicas_in_sync > local:
        _check_workers_agree(frame.replica_context, fn, (args, kwargs))
    if local == 1:
        return fn(*args, **kwargs)

    def merge_fn(strategy: Any, *merged_args: Any, **merged_kwargs: Any) -> Any:
        agreed = nest.map_structure(lambda leaf: _agreed(leaf, fn), (merged_args, merged_kwargs))
        # fn sees replica 0's model: what it does to replica 0's gradients reaches every
        # replica (the mirror hands on parameter values, not gradients).
        grads = GradientWrites(strategy)
        try:
            return fn(*agreed[0], **agreed[1])
        finally:
            _follow(grads, fn)

    return frame.replica_context.merge_call(merge_fn, args, kwargs)


def _follow(grads: GradientWrites, fn: Callable[..., Any]) -> None:
    """`grads.follow`; where `fn` raised, its error is the one that reaches the caller."""
    pending = sys.exception()
    try:
        grads.follow(getattr(fn, "__qualname__", repr(fn)))
    except Exception as also:
        if pending is None:
            raise
        pending.add_note(f"giving every replica replica 0's gradients failed too: {also!r}")


def _check_workers_agree(ctx: Any, fn: Callable[..., Any], arguments: Any) -> None:
    """Raise on every worker if the workers passed different numbers to `fn`.

    Each worker runs it alone, so a per-worker metric (`ReduceLROnPlateau.step(loss)`
    with the worker's own loss) would move each worker's learning rate its own way, and
    the mirrored models apart, silently. The numbers (Python and NumPy scalars, small
    tensors that are not parameters) are compared by a digest in one small all-reduce:
    only calls that pass some (a metric, once an epoch as a rule) pay for it.
    """
    numbers = [(leaf, _canonical(leaf)) for leaf in nest.flatten(arguments)[0]]
    found = [(leaf, data) for leaf, data in numbers if data is not None]
    if not found:
        return
    import numpy as np

    # Two 24-bit parts of the digest and their squares, summed over the n replicas: each
    # sum is n times this replica's, squares too, only if every replica's digest is the
    # same (their variance, n * sum(d^2) - sum(d)^2, is then 0). Exact in int64.
    whole = digest(tuple(data for _, data in found))
    parts = np.array([whole & 0xFFFFFF, (whole >> 24) & 0xFFFFFF], np.int64)
    mine = np.concatenate([parts, parts * parts])
    sums = ctx.all_reduce("sum", mine)
    if not np.array_equal(np.asarray(sums), ctx.num_replicas_in_sync * mine):
        name = getattr(fn, "__qualname__", repr(fn))
        shown = [leaf for leaf, _ in found]
        raise ValueError(
            f"{name} runs once per step for all replicas (crossdevice.torch.call_once), "
            f"but the replicas of the workers passed different arguments (this one: "
            f"{shown!r}). Pass a value every replica agrees on: reduce a per-replica metric "
            "first "
            "(crossdevice.get_replica_context().all_reduce('mean', x))"
        )


def _canonical(leaf: Any) -> bytes | None:
    """A number's bytes for `_check_workers_agree`, or None for anything else."""
    if isinstance(leaf, bool | int | float):
        return repr(leaf).encode()
    if isinstance(leaf, torch.Tensor):
        if isinstance(leaf, torch.nn.Parameter) or leaf.numel() > _MAX_COMPARED:
            return None
        leaf = leaf.detach().cpu().numpy()
    if hasattr(leaf, "tobytes") and 0 < getattr(leaf, "size", 0) <= _MAX_COMPARED:
        return f"{leaf.dtype}{getattr(leaf, 'shape', ())}".encode() + leaf.tobytes()
    return None


#: Tensors up to this many elements are compared across workers (metrics, not weights).
_MAX_COMPARED: Final = 64


def _agreed(leaf: Any, fn: Callable[..., Any]) -> Any:
    """The one value of a merged argument, or an error if the replicas disagree."""
    if not isinstance(leaf, PerReplica):
        return leaf
    first, *others = leaf.values
    for k, other in enumerate(others, start=1):
        if not _equal(first, other):
            name = getattr(fn, "__qualname__", repr(fn))
            raise ValueError(
                f"{name} runs once per step for all replicas (crossdevice.torch.call_once), "
                f"but its arguments differ: replica 0 passed {first!r}, replica {k} passed "
                f"{other!r}. Pass a value every replica agrees on (reduce a per-replica "
                "metric first: crossdevice.get_replica_context().all_reduce('mean', x)), "
                "or call it outside strategy.run"
            )
    return first


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu()))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return a is b


def _once(original: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return original(self, *args, **kwargs)
        return call_once(original, self, *args, **kwargs)

    method.__doc__ = original.__doc__
    method.__name__ = getattr(original, "__name__", "method")
    method.__qualname__ = getattr(original, "__qualname__", method.__name__)
    method.__wrapped__ = original  # type: ignore[attr-defined]
    return method


def _clip_once(original: Callable[..., Any]) -> Callable[..., Any]:
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return original(parameters, *args, **kwargs)
        frame = context.current_frame()
        if frame is None or frame.replica_context is None:
            return original(parameters, *args, **kwargs)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        shared = canonical(params)
        replica = frame.local_replica_id
        if shared is None and replica is not None:  # a copy per replica: each its own
            return original(own_copies(params, replica), *args, **kwargs)
        if shared is None:
            return original(params, *args, **kwargs)
        # The workers' clipping settings are their program's: not compared each step.
        return _call_once(original, (shared, *args), kwargs, across_workers=False)

    clip.__doc__ = original.__doc__
    clip.__name__ = getattr(original, "__name__", "clip")
    clip.__wrapped__ = original  # type: ignore[attr-defined]
    return clip


def _own_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_total_norm(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        frame = context.current_frame()
        in_replica = frame is not None and frame.replica_context is not None
        replica = frame.local_replica_id if in_replica and frame is not None else None
        if replica is None or _is_compiling():
            return original(tensors, *args, **kwargs)
        given = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        return original(own_gradients(given, replica), *args, **kwargs)

    get_total_norm.__doc__ = original.__doc__
    get_total_norm.__wrapped__ = original  # type: ignore[attr-defined]
    return get_total_norm


def _scheduler_classes() -> list[type]:
    base = torch.optim.lr_scheduler.LRScheduler
    found: list[type] = []
    stack: list[type] = [base, torch.optim.lr_scheduler.ReduceLROnPlateau]
    while stack:
        cls = stack.pop()
        if cls not in found:
            found.append(cls)
            stack.extend(cls.__subclasses__())
    return [cls for cls in found if "step" in cls.__dict__]


class _SchedulerSteps:
    """Patch `step` of every scheduler class defining one, now and when defined later."""

    def __init__(self) -> None:
        self.steps: list[tuple[type, Any]] = []  # (class, its own step before)
        self.init_subclass: Any = _ABSENT

    def install(self) -> _SchedulerSteps:
        for cls in _scheduler_classes():
            self._patch(cls)
        base = torch.optim.lr_scheduler.LRScheduler
        self.init_subclass = base.__dict__.get("__init_subclass__", _ABSENT)
        steps = self

        def init_subclass(cls: Any, /, **kwargs: Any) -> None:
            super(base, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
            if "step" in cls.__dict__:
                steps._patch(cls)

        base.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
        return self

    def _patch(self, cls: type) -> None:
        original = cls.__dict__["step"]
        if original in _WRAPPERS:
            return  # patched already
        wrapped = _MADE.get(original)
        if wrapped is None:  # the same wrapper every time: compiled code keeps its guards
            wrapped = _MADE[original] = _once(original)
            _WRAPPERS.add(wrapped)
        self.steps.append((cls, original))
        cls.step = wrapped  # type: ignore[attr-defined]

    def remove(self) -> None:
        base = torch.optim.lr_scheduler.LRScheduler
        if self.init_subclass is _ABSENT:
            del base.__init_subclass__
        else:
            base.__init_subclass__ = self.init_subclass  # type: ignore[method-assign]
        while self.steps:
            cls, original = self.steps.pop()
            cls.step = original  # type: ignore[attr-defined]


_ABSENT: Final = object()
_MADE: dict[Any, Any] = {}  # a class's own step -> its once-per-step wrapper
_WRAPPERS: set[Any] = set()


torch_patches.register(
    *(
        torch_patches.Patch(owner, name, _clip_once)
        for owner in (lambda: torch.nn.utils, lambda: torch.nn.utils.clip_grad)
        for name in ("clip_grad_norm_", "clip_grad_value_")
    ),
    # torch.nn.utils' name only: in clip_grad it is the private helper clip_grad_norm_ calls.
    torch_patches.Patch(lambda: torch.nn.utils, "clip_grads_with_norm_", _clip_once),
    torch_patches.Patch(lambda: torch.nn.utils, "get_total_norm", _own_norm),
    torch_patches.Patch(hook=lambda: _SchedulerSteps().install()),
    torch_patches.Patch(lambda: torch.optim.swa_utils.AveragedModel, "update_parameters", _once),
)
