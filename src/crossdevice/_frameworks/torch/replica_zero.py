"""Cross-replica calls that run code on a mirrored module: once, on replica 0's copy.

Outside `strategy.run` a mirrored module reads as replica 0's copy, and what code there
changes on that copy reaches every replica before they run again (`mirroring.py`).
`model.apply(fn)`, `model.load_state_dict(...)` (with its hooks) and `model.train()`
run code of the user's (an initialiser, a load hook, a submodule's own `train`), so they
follow the same rule: the code runs once, on replica 0's module, exactly as plain torch
runs it on the original module, and then every replica takes replica 0's result.

Running it on every replica's copy instead (as before) gave a silently wrong answer
wherever the replicas share something: with shared storage (the CPU default) an
in-place `fn` (`m.weight.mul_(0.5)`) landed once per replica on the one tensor (0.5**N),
and a random initialiser left the last replica's draw, not plain torch's; with a copy
per replica the global random generator still advanced once per replica, and `fn` saw
N + 1 modules per submodule of the model (the bug hunt of session 54).

What follows replica 0 (`follow`): parameter memory, `requires_grad` and training flags,
buffers replaced or written in place and hooks (`ReplicaMirror.sync_now`); plain
attributes a submodule got (`m.p = 0.0` on a Dropout, a flag a custom `train` sets);
for `apply` and `load_state_dict`, every parameter and buffer value too, as initialisers
often write through `.data`, which torch's version counters do not see.

`_apply` (`to`, `float`, `half`, ...) still converts every replica's copy (each on its
own device), but with shared storage a tensor over memory replica 0's pass converted
already takes that result (`once_per_storage`): the conversion runs once per storage,
as in plain torch, also for an in-place function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from crossdevice._frameworks.torch.hooks import MODULE_HOOKS

__all__ = [
    "STATE_DICT_HOOKS",
    "Snapshot",
    "conversion",
    "follow",
    "on_running_replica",
    "once_per_storage",
    "run_once",
]

#: `MirroredModule` methods that register a hook on the running replica's module (replica
#: 0's outside `strategy.run`, whose hooks every replica gets: `hooks.py`), where
#: `state_dict()` and `load_state_dict()` run it as plain torch runs the original's. On
#: the mirrored module itself a load hook never ran: its `load_state_dict` is its own.
STATE_DICT_HOOKS: Final = (
    "register_state_dict_pre_hook",
    "register_state_dict_post_hook",
    "register_load_state_dict_pre_hook",
    "register_load_state_dict_post_hook",
)

# Attributes every torch module keeps for itself (its parameter, buffer and submodule
# dictionaries, hooks, its compiled call): never copied between replicas as values.
_INTERNAL: Final = (
    frozenset(vars(torch.nn.Module()))
    | frozenset(MODULE_HOOKS)
    | {
        "_compiled_call_impl",
    }
)


class Snapshot:
    """Replica 0's submodules' attributes and structure before a cross-replica call."""

    def __init__(self, replica: torch.nn.Module) -> None:
        self._modules = list(replica.modules())
        self._attributes = [dict(vars(m)) for m in self._modules]
        self._structure = [_structure(m) for m in self._modules]

    def changed_attributes(self) -> list[tuple[int, dict[str, Any], list[str]]]:
        """(submodule index, attributes set or replaced, attributes deleted) per submodule.

        Raises:
            RuntimeError: the call added or replaced submodules, or added or removed
                parameters or buffers.
        """
        now = list(self._modules[0].modules())
        if (
            len(now) != len(self._modules)
            or any(a is not b for a, b in zip(now, self._modules, strict=True))
            or any(_structure(m) != s for m, s in zip(now, self._structure, strict=True))
        ):
            raise RuntimeError(
                "a call on a prepared model outside strategy.run (model.apply(fn), "
                "load_state_dict or train) added or replaced a submodule, or added or "
                "removed a parameter or buffer, on replica 0's copy only; the other "
                "replicas were copied at prepare and cannot follow. Change the model's "
                "structure before crossdevice.torch.prepare, and prepare it again"
            )
        changes = []
        for k, (module, before) in enumerate(zip(self._modules, self._attributes, strict=True)):
            state = vars(module)
            set_ = {
                name: value
                for name, value in state.items()
                if name not in _INTERNAL and (name not in before or before[name] is not value)
            }
            deleted = [name for name in before if name not in state and name not in _INTERNAL]
            if set_ or deleted:
                changes.append((k, set_, deleted))
        return changes


def _structure(module: torch.nn.Module) -> tuple[Any, ...]:
    return (
        tuple(module._modules),
        tuple(id(m) for m in module._modules.values()),
        tuple(module._parameters),
        tuple(module._buffers),
    )


def on_running_replica(name: str) -> Callable[..., Any]:
    """A `MirroredModule` method calling the running replica's module's method `name`."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"`{name}` of the running replica's module (replica 0's outside run)."
    return method


def run_once(
    call: Callable[[torch.nn.Module], Any],
    replicas: Sequence[torch.nn.Module],
    mirror: Any,
    buffers: Any,
    shared: bool,
) -> Any:
    """`call(replicas[0])` once, then every replica takes what it changed (`follow`).

    Args:
        call: the call, on replica 0's module.
        replicas: every local replica's module.
        mirror: the module's `ReplicaMirror`.
        buffers: the module's `BufferSync` to copy every value afterwards (`apply`,
            `load_state_dict`), or None to follow only what torch's version counters
            saw change.
        shared: whether the replicas' parameters share storage.

    Returns:
        What `call` returned. Every replica follows also when it raised.
    """
    mirror.sync_now()  # every replica at replica 0's state first (hooks included)
    before = Snapshot(replicas[0])
    values = None
    if buffers is not None:

        def values() -> None:
            _copy_parameters(replicas, shared)
            buffers.follow_first()

    try:
        result = call(replicas[0])
    except BaseException as error:  # its error reaches the caller; the replicas still agree
        try:
            follow(replicas, before, mirror, values)
        except Exception as also:
            error.add_note(f"giving every replica replica 0's state failed too: {also!r}")
        raise
    follow(replicas, before, mirror, values)
    return result


def follow(
    replicas: Sequence[torch.nn.Module],
    before: Snapshot,
    mirror: Any,
    values: Callable[[], None] | None = None,
) -> None:
    """Give every replica what a cross-replica call changed on replica 0's copy.

    Args:
        replicas: every local replica's module.
        before: replica 0's attributes before the call.
        mirror: the module's `ReplicaMirror` (memory, flags, versions, buffers, hooks).
        values: copies every value from replica 0 (`apply`, `load_state_dict`), if given.

    Raises:
        RuntimeError: the call changed the model's structure (`Snapshot`), or replaced
            a parameter object (`ParameterCheck`).
    """
    if len(replicas) == 1:
        return
    modules = [list(r.modules()) for r in replicas]
    for k, set_, deleted in before.changed_attributes():
        for r in range(1, len(replicas)):
            target = modules[r][k]
            for name, value in set_.items():
                own = value  # a tensor: its own copy, on its replica's device
                if isinstance(value, torch.Tensor):
                    own = value.detach().to(_device(replicas[r], value), copy=True)
                object.__setattr__(target, name, own)
            for name in deleted:
                vars(target).pop(name, None)
    mirror.sync_now()
    if values is not None:
        values()
        mirror.settled()  # the copies were made alike: the mirror's record starts here


def _copy_parameters(replicas: Sequence[torch.nn.Module], shared: bool) -> None:
    """Copy replica 0's parameter values to every other replica (none to copy if shared)."""
    if shared or len(replicas) == 1:
        return
    sources = list(replicas[0].parameters())
    with torch.no_grad():
        for replica in replicas[1:]:
            for param, source in zip(replica.parameters(), sources, strict=True):
                param.copy_(source)


def _device(replica: torch.nn.Module, like: torch.Tensor) -> torch.device:
    for tensor in (*replica.parameters(), *replica.buffers()):
        return tensor.device
    return like.device


def conversion(
    fn: Callable[[torch.Tensor], Any], shared: bool
) -> tuple[Callable[[torch.Tensor], Any], Callable[[], None]]:
    """`_apply`'s function for the replicas' passes, and what to call after each pass.

    With `shared` (every replica's pass, in cross-replica context) and torch's default
    conversion (`param.data = fn(param)`, not swapping objects), `once_per_storage`.
    """
    future = torch.__future__
    swaps = (
        future.get_swap_module_params_on_conversion()
        or future.get_overwrite_module_params_on_conversion()
    )
    if not shared or swaps:
        return fn, _nothing
    return once_per_storage(fn)


def _nothing() -> None:
    pass


def once_per_storage(fn: Callable[[torch.Tensor], Any]) -> tuple[Any, Callable[[], None]]:
    """`fn` for every replica's `_apply` where the replicas' parameters share storage.

    Returns the function to pass and `next_replica()`, to call after replica 0's pass.
    Replica 0's pass records each tensor `fn` converts; in the later replicas' passes a
    tensor over the same memory (a shared parameter, its shared gradient) takes replica
    0's result, so an in-place `fn` changes the one storage once, and a conversion
    allocates once; other tensors (each replica's buffers) are converted as usual.
    """
    done: dict[tuple[Any, ...], tuple[torch.Tensor, Any]] = {}
    first = [True]

    def converted(tensor: torch.Tensor) -> Any:
        key = _memory(tensor)
        if key is None:
            return fn(tensor)
        if not first[0] and key in done:
            return done[key][1]
        result = fn(tensor)
        if first[0]:
            done[key] = (tensor, result)  # the tensor kept alive: its address stays its own
        return result

    def next_replica() -> None:
        first[0] = False

    return converted, next_replica


def _memory(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Where `tensor`'s elements lie, or None where that cannot tell tensors apart."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return (
        storage.data_ptr(),
        tensor.device,
        tensor.dtype,
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )
