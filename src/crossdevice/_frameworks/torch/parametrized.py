"""Parametrized modules' cached values: one per replica's copy, not one for all.

`torch.nn.utils.parametrize` computes a parametrized tensor (`weight_norm`, `orthogonal`,
`spectral_norm`, any `register_parametrization`) through a property it puts on the
module's own class, and under `with parametrize.cached():` keeps each value in one
process-wide dict keyed by `(id(module), name)`, where `module` is the module the
parametrization was registered on, captured by the property. A copy
(`copy.deepcopy`, as `prepare` makes each replica's) keeps that class, hence that key:
under `cached()` every replica read the first replica's cached weight and its graph, so
backward ran through another replica's copy (the hook's "replica 0 ran backward through
replica 1's copy", advice that did not apply) or through one graph twice (torch's
"backward through the graph a second time"), by timing (the bug hunt of session 56).
Plain torch's own deep copies of a parametrized module share the entry the same way.

So `key_by_instance` gives each parametrized class, once, properties that cache under
the module they are read on (`id(self)`): the same values, graphs and errors as
torch's, since everything but the cache's key is torch's own getter and setter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch
from torch.nn.utils import parametrize

__all__ = ["key_by_instance"]

#: Set on the getters made here: a class already keyed by instance is left alone.
_OURS: Final = "__crossdevice_keyed_by_instance__"


def key_by_instance(module: torch.nn.Module) -> None:
    """Make `module`'s parametrized submodules cache under themselves (see the module doc).

    Changes their classes' properties (each class is one module's, and its copies'):
    the module itself reads what it read before.
    """
    if not hasattr(parametrize, "_cache") or not hasattr(parametrize, "_cache_enabled"):
        return  # a torch whose cache is laid out otherwise: nothing known to fix
    for submodule in module.modules():
        if not parametrize.is_parametrized(submodule):
            continue
        cls = type(submodule)
        parametrizations: Any = submodule.parametrizations  # a ModuleDict, by name
        for name in parametrizations:
            prop = cls.__dict__.get(name)
            if not isinstance(prop, property) or prop.fget is None:
                continue  # not torch's layout: left as it is
            if getattr(prop.fget, _OURS, False):
                continue
            setattr(cls, name, property(_getter(name, prop.fget), prop.fset, prop.fdel))


def _getter(name: str, torch_getter: Callable[[Any], torch.Tensor]) -> Callable[[Any], Any]:
    def get_parametrized(self: Any) -> torch.Tensor:
        # torch's own getter unless it would cache: it raises under scripting or
        # tracing, and computes the value when caching is off.
        if (
            not parametrize._cache_enabled
            or torch._C._get_tracing_state() is not None
            or torch._jit_internal.is_scripting()
        ):
            return torch_getter(self)
        cache = parametrize._cache  # (`cached()` rebinds it when the last one leaves)
        key = (id(self), name)
        tensor = cache.get(key)
        if tensor is None:
            tensor = cache[key] = self.parametrizations[name]()
        return tensor

    setattr(get_parametrized, _OURS, True)
    get_parametrized.__doc__ = torch_getter.__doc__
    return get_parametrized
