"""Plain attributes set on replica 0's submodules outside `strategy.run` reach every replica.

Outside `strategy.run` a mirrored module reads as replica 0's copy, so the user reaches
its submodules (`model.module[1]`, `model[2]`, `model.encoder.dropout`) and sets plain
attributes on them: a dropout schedule (`model.encoder.dropout.p = 0.0`), a LeakyReLU's
`negative_slope`, a norm's `eps`, a custom module's `self.temperature`. Only replica 0's
copy took the value and the other replicas ran on with the old one (`[0.9, 0.1]`), a
silently wrong model (the bug hunt of session 55).

`AttributeMirror` gives every replica what cross-replica code set or deleted on replica
0's submodules, at the next `run` (or the end of a `merge_fn`): the same object for
plain values (numbers, strings, tuples, None, functions; a method bound to one of
replica 0's modules is bound to the replica's own), a copy on the replica's device for a
tensor that needs no gradient. What a replica sets inside `run` (a cache in its forward)
stays its own: the marks are dropped when the run ends (`forget`).

Cheap when nothing changed: while crossdevice's torch patches are installed,
`torch.nn.Module.__setattr__` and `__delattr__` mark the (submodule, name) of a watched
replica-0 module (one dictionary lookup per set); `follow` only reads the marks. It
costs nothing per `run` when nothing was set (timed at about 0.1 us for a model of 50
submodules), and about 0.4 us per attribute set on any module.

Not followed (documented in the torch guide): a mutable value changed in place
(`self.cfg["k"] = v`: assign a new one instead, `self.cfg = {**self.cfg, "k": v}`),
writes to `vars(m)` or `object.__setattr__` that skip `Module.__setattr__`, and a tensor
that needs gradient (computed from the parameters: each replica keeps its own). A
submodule replaced on replica 0's copy is an error at the next `run`.
"""

from __future__ import annotations

import sys
import threading
import types
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Final

import torch

from crossdevice._arrays import torch_patches
from crossdevice._core.callers import user_stacklevel

__all__ = ["AttributeMirror", "follows", "watch"]

# Attributes every torch module keeps for itself (parameter, buffer and submodule
# dictionaries, hooks, its compiled call) and the training flag (`ReplicaMirror` follows
# it): never copied between replicas as values.
_INTERNAL: Final = frozenset(vars(torch.nn.Module())) | {"_compiled_call_impl", "training"}

# id(replica-0 module) -> ((marks of one mirror, the module's index there), ...). The
# mirror holds its modules, so an id stays theirs while it is listed here.
_WATCHED: dict[int, tuple[tuple[set[tuple[int, str]], int], ...]] = {}
_LOCK = threading.Lock()


def _watch(modules: Sequence[torch.nn.Module], marks: set[tuple[int, str]]) -> None:
    with _LOCK:
        for j, module in enumerate(modules):
            _WATCHED[id(module)] = (*_WATCHED.get(id(module), ()), (marks, j))


def _unwatch(keys: list[int], marks: set[tuple[int, str]]) -> None:
    with _LOCK:
        for key in keys:
            kept = tuple(e for e in _WATCHED.get(key, ()) if e[0] is not marks)
            if kept:
                _WATCHED[key] = kept
            else:
                _WATCHED.pop(key, None)


class _OutsideForwards(set[tuple[int, str]]):
    """Marks that leave out what a module's forward sets (its caches), see `watch`."""


def watch(owner: object, modules: Sequence[torch.nn.Module]) -> set[tuple[int, str]]:
    """Marks of what is set or deleted on `modules` from now on, while `owner` lives.

    Each `(index in modules, attribute name)`, added by `Module.__setattr__` and
    `__delattr__` while crossdevice's torch patches are installed, except inside a
    module's forward (a cache it keeps, such as a rotary embedding's longest length,
    which a forward on one worker only, an evaluation on the chief, may set); the
    caller clears it.
    """
    marks: set[tuple[int, str]] = _OutsideForwards()
    _watch(modules, marks)
    weakref.finalize(owner, _unwatch, [id(m) for m in modules], marks)
    return marks


def follows(module: torch.nn.Module, name: str) -> bool:
    """Whether `name`, set on `module`, is a plain attribute.

    Not a parameter, buffer, submodule, torch's own bookkeeping or the training flag.
    """
    return not (
        name in _INTERNAL
        or name in module._parameters
        or name in module._buffers
        or name in module._modules
    )


def _mark(module: Any, name: str) -> None:
    forward = None
    for marks, j in _WATCHED.get(id(module), ()):
        if type(marks) is _OutsideForwards:
            if forward is None:
                forward = _in_forward()
            if forward:
                continue
        marks.add((j, name))


#: The frames of a module's call (`Module.__call__`): a set under one is a forward's.
_CALLS: Final = frozenset(
    {torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__}
)


def _in_forward() -> bool:
    """Whether the caller runs inside a module's call (up to 64 frames up)."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(64):
        if frame is None:
            return False
        if frame.f_code in _CALLS:
            return True
        frame = frame.f_back
    return False


class AttributeMirror:
    """Gives every replica the plain attributes set on replica 0's submodules (module doc).

    Args:
        replicas: every local replica's module (two or more).
    """

    def __init__(self, replicas: Sequence[torch.nn.Module]) -> None:
        self._roots = list(replicas)
        self._modules = [list(r.modules()) for r in replicas]
        self._index = {id(m): j for j, m in enumerate(self._modules[0])}
        self._marks: set[tuple[int, str]] = set()
        self._warned: set[str] = set()  # the attributes `forget` warned about
        self._named: list[str] | None = None
        _watch(self._modules[0], self._marks)
        weakref.finalize(self, _unwatch, list(self._index), self._marks)

    def forget(self, compare: bool = False) -> None:
        """Attributes set so far (inside `run`) are the replicas' own: not followed.

        `compare`: the run (or the code before a `merge_fn`) ended without an error:
        warn, once per attribute, where replicas set one to values that differ. A module
        that keeps state in a plain attribute (`self.center = 0.9 * self.center + ...`
        in its forward) got one value per replica, each from the replica's own slice,
        where plain torch has one from the whole batch, and the model outside `run`
        reads replica 0's: a silently different model (the bug hunt of session 57). Not
        an error: a value kept only for inspection (the last batch's shape, attention
        maps) may differ harmlessly; one that feeds the computation should be a buffer,
        which `buffer_aggregation` combines (and an undeclared one is refused).
        """
        if compare and self._marks:
            self._warn_apart()
        self._marks.clear()

    def _warn_apart(self) -> None:
        if self._named is None:
            self._named = [name for name, _ in self._roots[0].named_modules()]
        for j, name in sorted(self._marks):
            path = self._named[j]
            where = f"{path}.{name}" if path else name
            if where in self._warned or not follows(self._modules[0][j], name):
                continue
            values = [vars(modules[j]).get(name, _SKIP) for modules in self._modules]
            if all(_alike(values[0], v) for v in values[1:]):
                continue
            self._warned.add(where)
            shown = ", ".join(f"replica {r}: {_short(v)}" for r, v in enumerate(values[:3]))
            warnings.warn(
                f"attribute {where!r} of a prepared model was set inside strategy.run to "
                f"values that differ between replicas ({shown}): each replica's forward set "
                "it from its own slice, so each keeps its own, and outside strategy.run the "
                "model reads replica 0's, where plain torch (one model, the whole batch) has "
                "one value. If it feeds the computation (a running statistic, a scale), keep "
                "it in a buffer (register_buffer) and pass prepare(..., buffer_aggregation=...) "
                "to combine the replicas' values; a value kept only for inspection may stay",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    def follow(self) -> None:
        """Give every replica the attributes set or deleted on replica 0's submodules.

        Raises:
            RuntimeError: a submodule of replica 0's copy was replaced or added.
        """
        if not self._marks:
            return
        marked = sorted(self._marks)
        self._marks.clear()
        for j, name in marked:
            source = self._modules[0][j]
            if name in _INTERNAL or name in source._parameters or name in source._buffers:
                continue  # values, flags and objects `ReplicaMirror` follows
            if name in source._modules:
                self._check_structure()
                continue
            state = vars(source)
            for r in range(1, len(self._modules)):
                target = self._modules[r][j]
                if name not in state:
                    vars(target).pop(name, None)
                    continue
                value = self._own(state[name], r)
                if value is not _SKIP:
                    object.__setattr__(target, name, value)

    def _own(self, value: Any, replica: int) -> Any:
        """`value` for `replica`: its own copy of a tensor, methods bound to its modules."""
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return _SKIP  # computed from the parameters: each replica keeps its own
            return value.detach().to(_device(self._roots[replica], value), copy=True)
        if isinstance(value, types.MethodType):
            j = self._index.get(id(value.__self__))
            if j is not None:
                return types.MethodType(value.__func__, self._modules[replica][j])
        return value

    def _check_structure(self) -> None:
        now = list(self._roots[0].modules())
        if len(now) != len(self._modules[0]) or any(
            a is not b for a, b in zip(now, self._modules[0], strict=True)
        ):
            raise RuntimeError(
                "a submodule of a prepared model was replaced or added outside "
                "strategy.run (model.module[1] = torch.nn.ReLU(), setattr(model.module, "
                "name, module)): that changed replica 0's copy only, and the other "
                "replicas were copied at prepare and cannot follow. Change the model's "
                "structure before crossdevice.torch.prepare, and prepare it again; plain "
                "attributes (model.module[1].p = 0.0) may change between steps"
            )


_SKIP: Final = object()


#: Largest tensor attribute compared (a running statistic is small; a stashed activation,
#: compared every step, would cost a copy to the host each time).
_COMPARED_MAX: Final = 1 << 16


def _alike(a: Any, b: Any) -> bool:
    """Whether two replicas' values of an attribute are the same value.

    Each replica's own device (`self.device = x.device`), integers and shapes (of the
    replica's slice), a tensor computed from the parameters and a large tensor are taken
    as alike.
    """
    if isinstance(a, torch.device) and isinstance(b, torch.device):
        return True
    if _shape_like(a) and _shape_like(b):
        return True  # a batch size or shape a forward keeps (`self.rows = x.shape[0]`)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.requires_grad or b.requires_grad or a.numel() > _COMPARED_MAX:
            return True  # computed from the parameters: each replica's own by design
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
        )
    try:
        return bool(a is b or a == b)
    except Exception:  # an object with an unusual `==` (an array): its type only
        return type(a) is type(b)


def _shape_like(value: Any) -> bool:
    """An integer, or a tuple of them (`torch.Size`): what a slice of its own gives."""
    if isinstance(value, tuple):
        return all(type(v) is int for v in value)
    return type(value) is int


def _short(value: Any) -> str:
    if value is _SKIP:
        return "not set"
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} sum {float(value.detach().double().sum()):.6g}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _device(replica: torch.nn.Module, like: torch.Tensor) -> torch.device:
    for tensor in (*replica.parameters(), *replica.buffers()):
        return tensor.device
    return like.device


def _setattr(original: Any) -> Any:
    is_compiling = torch.compiler.is_compiling

    def setattr_(self: Any, name: str, value: Any) -> None:
        original(self, name, value)
        # Compiled code never marks (a forward's cache, inside `run`): kept out of graphs.
        if not is_compiling() and _WATCHED:
            _mark(self, name)

    setattr_.__name__ = setattr_.__qualname__ = "__setattr__"
    setattr_.__wrapped__ = original  # type: ignore[attr-defined]
    return setattr_


def _delattr(original: Any) -> Any:
    is_compiling = torch.compiler.is_compiling

    def delattr_(self: Any, name: str) -> None:
        original(self, name)
        if not is_compiling() and _WATCHED:
            _mark(self, name)

    delattr_.__name__ = delattr_.__qualname__ = "__delattr__"
    delattr_.__wrapped__ = original  # type: ignore[attr-defined]
    return delattr_


def _module_class() -> Any:
    return torch.nn.Module


torch_patches.register(
    torch_patches.Patch(_module_class, "__setattr__", _setattr),
    torch_patches.Patch(_module_class, "__delattr__", _delattr),
)
