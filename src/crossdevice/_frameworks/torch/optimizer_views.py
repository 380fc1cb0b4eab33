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

A view cannot stop an in-place write to a state tensor it hands out (`st["exp_avg"].mul_
(0.5)` after the step): with one optimizer for all replicas that write landed once per
replica (the bug hunt of session 57: 0.25 where plain torch has 0.5, silently). So the
tensors of every entry read through the view are watched (`StateWrites`, their version
counters): a write between a replica's read and the step, or after the step until the
run ends, is a RuntimeError there (the step's own writes, and those made outside
`strategy.run`, do not count).

So inside a replica of a strategy with several local replicas, `param_groups` and (where
the replicas share one optimizer) `state` are read-only views in the running replica's
terms (its own parameters, live values); a write is a RuntimeError saying where to make
it: outside `strategy.run`, with an LR scheduler, or in `crossdevice.torch.call_once`
(once a step, in cross-replica context, where they are the optimizer's own). With one
replica per process the step function runs once, and they are the optimizer's own.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Final

import torch

__all__ = ["ReplicaGroup", "ReplicaState", "StateWrites"]

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


class StateWrites:
    """The one optimizer's state tensors read inside `strategy.run`, and their versions.

    `seen` records an entry's tensors when a replica reads it; `check` (where a section
    starts: the step's meeting, the run's end) raises if one was written since it was
    recorded or last stamped; `stamp` takes their versions as they are (after the step,
    and when a run starts: writes there are the step's own, or made outside the run).
    Tensors are held weakly (a state replaced between runs is not kept alive).
    """

    __slots__ = ("_replicas", "_tensors")

    def __init__(self, replicas: int) -> None:
        self._replicas = replicas
        self._tensors: dict[int, tuple[weakref.ref[torch.Tensor], int, str]] = {}

    def seen(self, entry: Mapping[str, Any]) -> None:
        """A replica read `entry` (one parameter's state): watch its tensors from now on."""
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and id(value) not in self._tensors:
                self._tensors[id(value)] = (weakref.ref(value), value._version, name)

    def __bool__(self) -> bool:
        return bool(self._tensors)

    def check(self) -> None:
        """Raise if a watched tensor was written since it was recorded (see the class doc).

        Not while an exception is on its way to the caller (the run's own): the versions
        are taken as they are instead.

        Raises:
            RuntimeError: a state tensor was written in place inside `strategy.run`.
        """
        written = sorted(
            {name for ref, version, name in self._tensors.values() if _moved(ref, version)}
        )
        if written and sys.exception() is None:
            self.stamp()
            raise RuntimeError(
                f"optimizer state {written} was written in place inside strategy.run, where "
                "the local replicas share one optimizer (parameters stored once, "
                "share_storage, the default on the host): every replica's write landed on the "
                f"one tensor, {self._replicas} times. Write it outside strategy.run (between "
                "steps), inside crossdevice.torch.call_once(fn) (once a step, in cross-replica "
                "context), or prepare with share_storage=False (a copy per replica)"
            )
        self.stamp()

    def stamp(self) -> None:
        """Take every watched tensor's version as it is now; forget the tensors gone."""
        kept = {}
        for key, (ref, _, name) in self._tensors.items():
            tensor = ref()
            if tensor is not None:
                kept[key] = (ref, tensor._version, name)
        self._tensors = kept


def _moved(ref: weakref.ref[torch.Tensor], version: int) -> bool:
    tensor = ref()
    return tensor is not None and tensor._version != version


class ReplicaState(Mapping[torch.Tensor, Mapping[str, Any]]):
    """The one optimizer's `state` read with a replica's own parameters, no writes.

    `state[p]` is parameter `p`'s entry, read-only (empty where it has none yet, as
    torch's defaultdict gives, without adding one); iterating gives the replica's
    parameters.

    Args:
        state: the optimizer's state (keyed by replica 0's parameters).
        pairs: (replica's parameter, replica 0's) for every parameter it updates.
        replicas: how many local replicas run the step function (for the message).
        writes: where the tensors of every entry read are watched (`StateWrites`).
    """

    __slots__ = ("_replicas", "_state", "_to_own", "_to_shared", "_writes")

    def __init__(
        self,
        state: Mapping[torch.Tensor, Any],
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        replicas: int,
        writes: StateWrites | None = None,
    ) -> None:
        self._state = state
        self._to_shared = {id(mine): shared for mine, shared in pairs}
        self._to_own = {id(shared): mine for mine, shared in pairs}
        self._replicas = replicas
        self._writes = writes

    def _entry(self, param: Any) -> Any:
        shared = self._to_shared.get(id(param), param)
        entry = self._state.get(shared)  # not [shared]: a defaultdict would add it
        if entry is not None and self._writes is not None:
            self._writes.seen(entry)
        return entry

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
