"""Tensor attributes a module computed from its parameters, on each replica's copy.

A module may keep, as a plain attribute, a tensor that it computed from its own
parameters; in plain torch (and under DDP, where each rank builds its own module) it
keeps working in one of two ways:

* a view (`self.wt = self.l.weight.t()` in `__init__`): it follows the weight's
  in-place updates, and its graph sends gradient to the weight at every backward;
* another tensor a graph made (`self.w2 = self.weight * 2`): a value computed once,
  whose graph sends gradient to the weight at every backward (until a backward frees a
  tensor that graph saved: torch's "backward through the graph a second time"). torch's
  own `weight_norm`, `spectral_norm` and `torch.nn.utils.prune` keep `weight` this way
  and compute it again, from the module's own parameters, before each forward. So does
  a module that keeps an activation of its last forward (`self.attn = attn`).

`prepare` copies the module once per replica. `copy.deepcopy` refuses a tensor a graph
made, and copies a view into memory of its own: the copy's view would stay at its first
value. Until a bug hunt found it, each copy took such a tensor detached: a copy's
forward used frozen initial weights and sent them no gradient, a silently wrong model.
Now each copy gets the same derivation of its own parameters (`copy_module`):

* a view of one of the module's parameters or buffers (a submodule's too, kept anywhere
  in the module, also in a list, tuple or dict attribute) is the same view of the copy's
  own tensor (`Tensor._view_func`, which replays it as strided on CPU; the layout is
  checked), with autograd to it;
* another tensor with a graph is its value, whose backward runs the original's graph
  (kept alive, as the original keeps it) and gives the gradient it yields for the
  original's parameters to the copy's own (`_Follow`): the same gradient plain torch
  computes through that graph, at every backward.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch

from crossdevice._frameworks.torch import parametrized

__all__ = ["copy_module"]

#: A module's own dictionaries of parameters, buffers and submodules (never attributes).
_REGISTERED = frozenset({"_parameters", "_buffers", "_modules"})


def copy_module(
    module: torch.nn.Module, memo: dict[int, Any], device: torch.device | None = None
) -> torch.nn.Module:
    """`copy.deepcopy(module, memo)`, moved to `device`, with derived tensors re-derived.

    Parametrized submodules (`torch.nn.utils.parametrize`) then cache their values under
    each copy, not all under the original (`parametrized.key_by_instance`).

    Raises:
        RuntimeError: a derived tensor depends on a tensor outside the module, or a view
            cannot be replayed on the copy's tensor.
    """
    found = dict(_derived(module))
    stand_ins = {id(t): t.detach().clone() for t, _ in found.values() if id(t) not in memo}
    memo.update(stand_ins)
    duplicate = copy.deepcopy(module, memo)
    parametrized.key_by_instance(duplicate)  # its parametrizations cache under the copy
    if device is not None:
        duplicate = duplicate.to(device)
    if stand_ins:
        counterpart = _counterparts(module, duplicate)
        swap = {
            id(stand_in): _rederive(*found[key], counterpart) for key, stand_in in stand_ins.items()
        }
        for submodule in duplicate.modules():
            state = vars(submodule)
            for name, value in list(state.items()):
                if name not in _REGISTERED:
                    new = _replace(value, swap)
                    if new is not value:
                        state[name] = new
    return duplicate


def _derived(module: torch.nn.Module) -> Iterator[tuple[int, tuple[torch.Tensor, str]]]:
    """(id, (tensor, attribute name)) of each derived tensor kept on `module`'s submodules."""
    own = {id(t) for t in (*module.parameters(), *module.buffers())}
    for prefix, submodule in module.named_modules():
        for name, value in vars(submodule).items():
            if name in _REGISTERED:
                continue
            where = f"{prefix}.{name}" if prefix else name
            for tensor in _tensors(value):
                if tensor.grad_fn is not None or (tensor._is_view() and id(tensor._base) in own):
                    yield id(tensor), (tensor, where)


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.nn.Parameter):
        return
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, depth + 1)


def _replace(value: Any, swap: dict[int, torch.Tensor], depth: int = 0) -> Any:
    """`value` with the stand-ins in `swap` replaced (lists and dicts in place)."""
    if isinstance(value, torch.Tensor):
        return swap.get(id(value), value)
    if depth >= 4:
        return value
    if isinstance(value, list):
        for k, item in enumerate(value):
            value[k] = _replace(item, swap, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            value[key] = _replace(item, swap, depth + 1)
    elif isinstance(value, tuple):
        items = [_replace(item, swap, depth + 1) for item in value]
        if any(a is not b for a, b in zip(items, value, strict=True)):
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _counterparts(module: torch.nn.Module, duplicate: torch.nn.Module) -> dict[int, torch.Tensor]:
    """The copy's parameter or buffer for each of `module`'s, by id."""
    pairs = zip(
        (*module.parameters(), *module.buffers()),
        (*duplicate.parameters(), *duplicate.buffers()),
        strict=True,
    )
    return {id(a): b for a, b in pairs}


def _rederive(
    source: torch.Tensor, where: str, counterpart: dict[int, torch.Tensor]
) -> torch.Tensor:
    if source._is_view() and id(source._base) in counterpart:
        return _replay_view(source, where, counterpart[id(source._base)])
    leaves = _leaves(source)
    outside = [leaf for leaf in leaves if id(leaf) not in counterpart]
    if outside:
        raise RuntimeError(
            f"attribute {where!r} of the module is a tensor computed (grad_fn="
            f"{type(source.grad_fn).__name__}) from a tensor that requires grad and is not "
            f"one of the module's parameters (shape {tuple(outside[0].shape)}): each "
            "replica's copy of the module could not send it gradients as plain torch "
            "does. Compute it in forward, from the module's parameters, or keep it "
            "detached (register_buffer(name, tensor.detach())), then prepare the model"
        )
    own = [counterpart[id(leaf)] for leaf in leaves]
    if not own:
        return source.detach().clone()
    with torch.enable_grad():  # (prepare may run under no_grad; the original has a graph)
        return _Follow.apply(_Source(source, leaves, where), *own)  # type: ignore[no-untyped-call]


def _replay_view(source: torch.Tensor, where: str, base: torch.Tensor) -> torch.Tensor:
    """`source`, a view of a tensor of the module, as the same view of `base`."""
    original = source._base
    assert original is not None
    with torch.set_grad_enabled(source.requires_grad):
        view = source._view_func(base)  # type: ignore[attr-defined]
    if (
        (view.shape, view.stride(), view.dtype) != (source.shape, source.stride(), source.dtype)
        or view.storage_offset() - base.storage_offset()
        != source.storage_offset() - original.storage_offset()
        or base.stride() != original.stride()
    ):
        raise RuntimeError(
            f"attribute {where!r} of the module is a view of one of its tensors (shape "
            f"{tuple(source.shape)}, stride {source.stride()}), and replica's copy of that "
            f"tensor has another layout (stride {base.stride()}, expected "
            f"{original.stride()}): its view could not be made the same. Take the view in "
            "forward instead (self.l.weight.t() there), then prepare the model"
        )
    return view


def _leaves(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors requiring grad that `tensor`'s graph sends gradient to, in order."""
    leaves: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.setdefault(id(variable), variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


class _Source:
    """What a copy's derived tensor follows: the original, its graph's leaves, its name."""

    def __init__(self, tensor: torch.Tensor, leaves: list[torch.Tensor], where: str) -> None:
        self.tensor = tensor
        self.leaves = leaves
        self.where = where


class _Follow(torch.autograd.Function):
    """The original's value; backward: the original's graph's gradient, to the copy's leaves."""

    @staticmethod
    def forward(ctx: Any, source: _Source, *own: torch.Tensor) -> torch.Tensor:
        ctx.source = source
        ctx.devices = [t.device for t in own]
        return source.tensor.detach().to(own[0].device, copy=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        source: _Source = ctx.source
        hooked = [leaf for leaf in source.leaves if getattr(leaf, "_backward_hooks", None)]
        if hooked:  # torch would run them on the original's parameters, for this replica
            raise RuntimeError(
                f"attribute {source.where!r} of a mirrored module is a tensor computed once "
                "from its parameters, outside forward, and a parameter it comes from has a "
                "gradient hook (register_hook): a replica's gradient through it cannot "
                "pass the original's graph without running the hook of another replica's "
                "parameter. Compute the tensor in forward instead"
            )
        try:
            grads = torch.autograd.grad(
                source.tensor,
                source.leaves,
                grad.to(source.tensor.device),
                retain_graph=True,
                allow_unused=True,
            )
        except RuntimeError as error:
            raise RuntimeError(
                f"attribute {source.where!r} of a mirrored module is a tensor computed "
                "once from its parameters, outside forward; each replica sends gradient "
                f"through its graph, and torch could not ({error}). Plain torch fails the "
                "same way at a later step. Compute the tensor in forward instead"
            ) from error
        return (
            None,
            *(None if g is None else g.to(d) for g, d in zip(grads, ctx.devices, strict=True)),
        )
