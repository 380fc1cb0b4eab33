"""Hooks registered on replica 0's objects outside `strategy.run` reach every replica.

Outside `strategy.run` a mirrored module reads as replica 0's copy: `model[0]`,
`model.parameters()` are replica 0's objects, and the original module (and its
parameters) become replica 0's at prepare. A hook registered on them
(`register_forward_hook`, `p.register_hook(lambda g: g * 2)`, ...) would run on replica
0 alone: the reduced gradient would be replica 0's hooked gradient plus the others'
plain ones, silently. As DDP and Accelerate users expect (their hooks run on the model
they registered them on), `HookMirror` gives every replica the hooks that cross-replica
code registered on replica 0 (before prepare too), under the same key, so that
`handle.remove()` on replica 0's handle takes them away from every replica (at the next
`run`). Hooks that a replica registers on its own copy inside `strategy.run` stay its own.

Covered: every module hook (forward, forward pre, backward, backward pre, state_dict,
state_dict pre, load_state_dict pre and post, with their kwargs / always-called flags)
and both parameter hooks (`register_hook`, `register_post_accumulate_grad_hook`). A
bound method of one of replica 0's modules is bound to the replica's own module.

Cheap when nothing changed: torch numbers every hook handle it makes
(`RemovableHandle.next_id`), so replica 0's hooks are only scanned after a handle was
made; removals are checked for the few mirrored hooks alone.
"""

from __future__ import annotations

import types
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["HookMirror"]

#: A module's hook dictionaries (torch.nn.Module.__init__), keyed by handle id.
MODULE_HOOKS: Final = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
#: A tensor's hook dictionaries (None until a hook is registered).
PARAM_HOOKS: Final = ("_backward_hooks", "_post_accumulate_grad_hooks")

# (on a parameter, module or parameter index, attribute)
_Slot = tuple[bool, int, str]


class HookMirror:
    """Copies replica 0's cross-replica hook registrations and removals to every replica.

    Args:
        replicas: every local replica's module.
        own: the handle ids of the library's own per-replica hooks (never copied).
    """

    def __init__(
        self, replicas: Sequence[torch.nn.Module], own: Callable[[], Collection[int]]
    ) -> None:
        self._modules = [list(r.modules()) for r in replicas]
        self._params = [list(r.parameters()) for r in replicas]
        self._index = {id(m): j for j, m in enumerate(self._modules[0])}
        self._own = own
        self._mirrored: dict[_Slot, list[Any]] = {}
        # Hooks registered before prepare are cross-replica ones: every replica gets them.
        now = self._scan()
        mine = set(own())
        self._add({slot: [k for k in keys if k not in mine] for slot, keys in now.items()})
        self._known = now
        self._mark = RemovableHandle.next_id

    def _hooks(self, replica: int, slot: _Slot) -> Any:
        on_param, index, attr = slot
        if on_param:
            return getattr(self._params[replica][index], attr)
        return self._modules[replica][index].__dict__.get(attr)

    def _scan(self) -> dict[_Slot, tuple[Any, ...]]:
        """Replica 0's hook keys, for every hook dictionary that holds some."""
        found: dict[_Slot, tuple[Any, ...]] = {}
        for j, module in enumerate(self._modules[0]):
            state = module.__dict__
            for attr in MODULE_HOOKS:
                hooks = state.get(attr)
                if hooks:
                    found[(False, j, attr)] = tuple(hooks)
        for k, param in enumerate(self._params[0]):
            for attr in PARAM_HOOKS:
                hooks = getattr(param, attr)
                if hooks:
                    found[(True, k, attr)] = tuple(hooks)
        return found

    def enter_cross_replica(self) -> None:
        """Hooks registered since (inside `run`) are the replicas' own: not copied."""
        if RemovableHandle.next_id != self._mark:
            self._known = self._scan()
            self._mark = RemovableHandle.next_id

    def leave_cross_replica(self) -> None:
        """Give every replica the hooks registered on replica 0 since, drop removed ones."""
        if len(self._modules) == 1:
            return
        self._drop_removed()
        if RemovableHandle.next_id == self._mark:
            return
        now = self._scan()
        mine = set(self._own())
        added = {}
        for slot, keys in now.items():
            before = self._known.get(slot, ())
            new = [k for k in keys if k not in before and k not in mine]
            if new:
                added[slot] = new
        self._add(added)
        self._known = now
        self._mark = RemovableHandle.next_id

    def _drop_removed(self) -> None:
        for slot in list(self._mirrored):
            first = self._hooks(0, slot) or {}
            keys = self._mirrored[slot]
            gone = [k for k in keys if k not in first]
            if not gone:
                continue
            for replica in range(1, len(self._modules)):
                hooks = self._hooks(replica, slot)
                for key in gone:
                    if hooks is not None:
                        hooks.pop(key, None)
            keys[:] = [k for k in keys if k in first]
            if not keys:
                del self._mirrored[slot]
            if slot in self._known:
                # Forget the removed keys alone: a hook registered on replica 0 since (a
                # re-prune removes its old hook and registers a container, in one call)
                # is still to be given to every replica (`leave_cross_replica`).
                self._known[slot] = tuple(k for k in self._known[slot] if k not in gone)

    def _add(self, added: dict[_Slot, list[Any]]) -> None:
        for slot, keys in added.items():
            if not keys:
                continue
            first = self._hooks(0, slot)
            mirrored = self._mirrored.setdefault(slot, [])
            mirrored.extend(keys)
            for replica in range(1, len(self._modules)):
                hooks = self._hooks(replica, slot)
                if hooks is None:  # a parameter without hooks yet
                    hooks = OrderedDict()
                    setattr(self._params[replica][slot[1]], slot[2], hooks)
                for key in keys:
                    if key not in hooks:  # a deep copy at prepare has its own already
                        hooks[key] = self._rebind(first[key], replica)
                _follow_order(first, hooks, set(mirrored))
                if not slot[0] and slot[2] in ("_backward_hooks", "_backward_pre_hooks"):
                    module = self._modules[replica][slot[1]]
                    module._is_full_backward_hook = self._modules[0][slot[1]]._is_full_backward_hook

    def _rebind(self, hook: Any, replica: int) -> Any:
        """`hook` for `replica`: one bound to a replica-0 module binds to the replica's."""
        if isinstance(hook, types.MethodType):
            j = self._index.get(id(hook.__self__))
            if j is not None:
                return types.MethodType(hook.__func__, self._modules[replica][j])
        wrapped = torch.nn.modules.module._WrappedHook
        if isinstance(hook, wrapped) and getattr(hook, "with_module", False):
            j = self._index.get(id(hook.module()))
            if j is not None:
                return wrapped(hook.hook, self._modules[replica][j])
        return hook


def _follow_order(first: Any, hooks: Any, mirrored: set[Any]) -> None:
    """Order `hooks` as replica 0's `first` (`prepend=True` hooks run first everywhere).

    Mirrored keys go where they are in `first`, the replica's own ones in the places of
    replica 0's own ones.
    """
    own = iter([k for k in hooks if k not in mirrored])
    order = []
    for key in first:
        if key in mirrored:
            if key in hooks:
                order.append(key)
        else:
            mine = next(own, None)
            if mine is not None:
                order.append(mine)
    order.extend(own)
    if list(hooks) != order:
        for key in order:
            hooks[key] = hooks.pop(key)
