"""Gradients that `call_once`'s function changes reach every replica's `.grad`.

`call_once(fn)` runs `fn` once, in cross-replica context, where a mirrored module reads
as replica 0's copy: `fn` changes replica 0's gradients (`p.grad.mul_(0.5)`, the
documented place for an in-place change of the reduced gradient). The mirror that hands
replica 0's cross-replica changes to the other replicas (`mirroring.py`) follows
parameter values, not gradients, so with a copy per replica (`share_storage=False`,
every GPU layout) only replica 0's gradients changed and the copies stepped with the
old ones: silently apart (the bug hunt of session 54). With shared storage an in-place
change reached every replica through the one buffer, but `p.grad = None` did not.

`GradientWrites` records replica 0's gradients (object and version counter) of every
mirrored module of the strategy before `fn`, and afterwards gives every other replica
what changed, bitwise:

* changed in place: copied into the replica's own `.grad` (nothing to do where it views
  the same memory, as with shared storage);
* replaced (`p.grad = p.grad * 2`): the new value is copied into the gradient replica 0
  had, which stays `.grad` (the reduction knows that tensor: a new one would be an
  error at the step), then as above;
* set to None: None on every replica (the step skips it, as in plain torch);
* given where there was none: an error, since the step would take a gradient it never
  reduced for one that is the same on every replica.

Writes through `.data` bump no version counter and go unseen, as everywhere in the
mirror: change gradients with in-place operations.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["GradientWrites", "register"]

# strategy -> the gradient syncs of its mirrored modules (weakly: a module may go).
_SYNCS: weakref.WeakKeyDictionary[Any, list[weakref.ref[Any]]] = weakref.WeakKeyDictionary()


def register(strategy: Any, sync: Any) -> None:
    """`sync` (a `GradientSync`) belongs to a mirrored module of `strategy`."""
    syncs = _SYNCS.setdefault(strategy, [])
    syncs[:] = [ref for ref in syncs if ref() is not None]
    syncs.append(weakref.ref(sync))


class GradientWrites:
    """Replica 0's gradients before a `call_once` function; `follow()` after it.

    Args:
        strategy: the strategy whose replicas called `call_once`.
    """

    def __init__(self, strategy: Any) -> None:
        syncs = [ref() for ref in _SYNCS.get(strategy, ())]
        self._params: list[list[list[torch.nn.Parameter]]] = []
        self._before: list[list[tuple[torch.Tensor | None, int]]] = []
        for sync in syncs:
            if sync is None:
                continue
            replicas = _replica_params(sync)
            if len(replicas) < 2:
                continue
            self._params.append(replicas)
            self._before.append([_seen(p.grad) for p in replicas[0]])

    def follow(self, name: str) -> None:
        """Give every replica replica 0's gradients where the function changed them.

        Args:
            name: the function's name, for errors.

        Raises:
            RuntimeError: the function gave a parameter a gradient it had not, or one
                of another shape, dtype or device.
        """
        for replicas, before in zip(self._params, self._before, strict=True):
            for k, (old, version) in enumerate(before):
                param = replicas[0][k]
                grad = param.grad
                if grad is old and (grad is None or grad._version == version):
                    continue
                if grad is None:
                    for params in replicas[1:]:
                        params[k].grad = None
                    continue
                if old is None or not _alike(old, grad):
                    raise RuntimeError(
                        f"{name} ran once for all replicas (crossdevice.torch.call_once) "
                        f"and gave a parameter of shape {tuple(param.shape)} a new gradient "
                        f"({_describe(grad)}) where it had {_describe(old)}; the step "
                        "would reduce it across replicas as if each replica had computed "
                        "its own. Change the reduced gradient in place inside call_once "
                        "(p.grad.mul_(0.5)), or set it to None; set gradients of your own "
                        "inside strategy.run, on every replica"
                    )
                if grad is not old:  # replaced: the value goes into the reduced tensor
                    with torch.no_grad():
                        old.copy_(grad)
                    param.grad = grad = old
                for params in replicas[1:]:
                    _take(params[k], grad)


def _replica_params(sync: Any) -> list[list[torch.nn.Parameter]]:
    return [sync.params(r) for r in range(len(sync.steps))]  # `steps`: one per replica


def _seen(grad: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    return grad, (0 if grad is None else grad._version)


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def _describe(grad: torch.Tensor | None) -> str:
    if grad is None:
        return "None"
    return f"{grad.dtype} {tuple(grad.shape)} on {grad.device}"


def _take(param: torch.nn.Parameter, source: torch.Tensor) -> None:
    """Make `param.grad` hold `source`'s value (its own tensor where it has one)."""
    mine = param.grad
    with torch.no_grad():
        if source.is_sparse:  # no storage to compare: values copied where indices agree
            if mine is source:
                return
            if mine is not None and mine.is_sparse and _same_rows(mine, source):
                mine._values().copy_(source._values())
            else:
                param.grad = source.detach().to(param.device, copy=True)
        elif mine is None or mine.shape != source.shape or mine.dtype != source.dtype:
            param.grad = source.detach().to(param.device, copy=True)
        elif not _same_memory(mine, source):
            mine.copy_(source)


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether sparse `a` and `b` hold values at the same indices (shapes and dtypes too)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a._values().shape == b._values().shape
        and torch.equal(a._indices(), b._indices().to(a.device))
    )


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.stride() == b.stride()
    )
