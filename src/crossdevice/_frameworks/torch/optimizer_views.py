"""A mirrored optimizer's groups and state as one replica sees them inside `strategy.run`.

Every local replica runs the step function, so a write to what the replicas share is
made once per replica: plain torch's `for g in opt.param_groups: g["lr"] *= 0.5` in the
step halved the rate N times a step where the replicas share one optimizer (parameters
stored once), and where each has its own copy, left them with different rates and
different parameters (each copy takes replica 0's hyperparameters when it steps, before
or after replica 0's own write, as the threads happen to run). Both silently. Reading
the shared optimizer's `state` with a replica's own parameter found nothing and, torch's
`state` being a defaultdict, added a key that `state_dict()` then failed on. TF refuses
such writes in a replica context (assigning a mirrored variable there needs an
aggregation).

So inside a replica of a strategy with several local replicas, `param_groups` and (where
the replicas share one optimizer) `state` are read-only views in the running replica's
terms (its own parameters, live values); a write is a RuntimeError saying where to make
it: outside `strategy.run`, with an LR scheduler, or in `crossdevice.torch.call_once`
(once a step, in cross-replica context, where they are the optimizer's own). With one
replica per process the step function runs once, and they are the optimizer's own.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Final

import torch

__all__ = ["ReplicaGroup", "ReplicaState"]

_WHERE: Final = (
    "inside strategy.run every local replica runs this, so the change would be made once "
    "per replica ({replicas} times a step) on what they share. Make it outside "
    "strategy.run (between steps), with a torch.optim.lr_scheduler (stepped once for all "
    "replicas), or inside crossdevice.torch.call_once(fn) (fn runs once a step, in "
    "cross-replica context, where the optimizer's own {what} can be changed)"
)


def _refused(what: str, change: str, replicas: int) -> RuntimeError:
    return RuntimeError(
        f"a mirrored optimizer's {what} are read-only inside strategy.run (got {change}): "
        + _WHERE.format(replicas=replicas, what=what)
    )


class ReplicaGroup(MutableMapping[str, Any]):
    """One parameter group read by a replica: live values, its own `params`, no writes.

    Args:
        group: the optimizer's group (replica 0's, or the one shared optimizer's).
        params: the running replica's parameters of the group, in order.
        replicas: how many local replicas run the step function (for the message).
    """

    __slots__ = ("_group", "_params", "_replicas")

    def __init__(self, group: dict[str, Any], params: list[torch.Tensor], replicas: int) -> None:
        self._group = group
        self._params = params
        self._replicas = replicas

    def __getitem__(self, key: str) -> Any:
        return self._params if key == "params" else self._group[key]

    def __setitem__(self, key: str, value: Any) -> None:
        raise _refused("param_groups", f"param_groups[...][{key!r}] = {value!r}", self._replicas)

    def __delitem__(self, key: str) -> None:
        raise _refused("param_groups", f"del param_groups[...][{key!r}]", self._replicas)

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)

    def __repr__(self) -> str:
        shown = {k: v for k, v in self._group.items() if k != "params"}
        return f"ReplicaGroup({len(self._params)} params, {shown!r})"


class ReplicaState(Mapping[torch.Tensor, Mapping[str, Any]]):
    """The one optimizer's `state` read with a replica's own parameters, no writes.

    `state[p]` is parameter `p`'s entry, read-only (empty where it has none yet, as
    torch's defaultdict gives, without adding one); iterating gives the replica's
    parameters.

    Args:
        state: the optimizer's state (keyed by replica 0's parameters).
        pairs: (replica's parameter, replica 0's) for every parameter it updates.
        replicas: how many local replicas run the step function (for the message).
    """

    __slots__ = ("_replicas", "_state", "_to_own", "_to_shared")

    def __init__(
        self,
        state: Mapping[torch.Tensor, Any],
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        replicas: int,
    ) -> None:
        self._state = state
        self._to_shared = {id(mine): shared for mine, shared in pairs}
        self._to_own = {id(shared): mine for mine, shared in pairs}
        self._replicas = replicas

    def _entry(self, param: Any) -> Any:
        shared = self._to_shared.get(id(param), param)
        return self._state.get(shared)  # not [shared]: a defaultdict would add it

    def __getitem__(self, param: Any) -> Mapping[str, Any]:
        entry = self._entry(param)
        return types.MappingProxyType({} if entry is None else entry)

    def get(self, param: Any, default: Any = None) -> Any:
        """`state[param]` where it has an entry, else `default` (as torch's `get`)."""
        entry = self._entry(param)
        return default if entry is None else types.MappingProxyType(entry)

    def __contains__(self, param: object) -> bool:
        return self._entry(param) is not None

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self._to_own.get(id(p), p) for p in self._state)

    def __len__(self) -> int:
        return len(self._state)

    def __setitem__(self, param: Any, value: Any) -> None:
        raise _refused("state", "state[param] = ...", self._replicas)

    def __delitem__(self, param: Any) -> None:
        raise _refused("state", "del state[param]", self._replicas)

    def clear(self) -> None:
        """Refused inside `strategy.run` (see the module doc)."""
        raise _refused("state", "state.clear()", self._replicas)

    def __repr__(self) -> str:
        return f"ReplicaState({len(self._state)} entries)"
