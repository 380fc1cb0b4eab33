"""Keep every replica's parameters the objects, and the storage, they were prepared with.

A mirrored module's gradient reduction and optimizer hold each replica's `Parameter`
objects; with shared storage (`alias`) every replica's parameters also view replica 0's
memory, and the optimizer steps once, on replica 0's. Several torch calls break that
silently: `model.float()` / `.to(dtype)` / `.half()` give each parameter new memory
(`param.data = fn(param)`), and so do `param.data = ...` and `param.set_(...)`;
`load_state_dict(assign=True)`, `torch.nn.utils.prune` and `module.weight =
Parameter(...)` replace the `Parameter` object. Replica 1 would then never train, or
its gradients would never be reduced.

`ParameterCheck` compares, before every `strategy.run` (and at the end of each), what
each replica holds with what it was prepared with, by one pointer per parameter:

* a replaced `Parameter` object is an error naming it (what replaced it is in no
  gradient bucket and no optimizer);
* with shared storage, a replica whose parameter no longer views replica 0's memory is
  given replica 0's again (`realias`): cross-replica code changes replica 0's copy, and
  the replicas follow it, as `ReplicaMirror` does for values. Inside `strategy.run` such
  a change is an error, as an in-place write is;
* with copies per replica, new memory given to replica 0's parameter outside `run`
  (`param.data = t`) is copied to every replica.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ParameterCheck", "own_view", "realias"]


def realias(param: torch.Tensor, source: torch.Tensor) -> None:
    """Make `param` view `source`'s memory (its own object, version counter, `.grad`).

    `mirroring.alias` makes a replica's parameter this way at prepare; `ParameterCheck`
    points it back after a cast or `param.data = ...` gave it memory of its own.
    """
    with torch.no_grad():
        if param.dtype != source.dtype:  # set_ reads the memory as `param`'s dtype
            param.data = torch.empty(0, dtype=source.dtype, device=source.device)
        param.set_(
            source.untyped_storage(), source.storage_offset(), source.size(), source.stride()
        )


def own_view(source: torch.Tensor) -> torch.Tensor:
    """A tensor of its own over `source`'s memory: one buffer, a version counter each."""
    own = torch.empty(0, dtype=source.dtype, device=source.device)
    realias(own, source)
    return own


class ParameterCheck:
    """Each replica's parameters, checked against their prepared objects and storage.

    Args:
        replicas: every local replica's module.
        names: the parameters' names, in `parameters()` order.
        shared: the replicas' parameters view replica 0's memory.
    """

    def __init__(self, replicas: Sequence[torch.nn.Module], names: Sequence[str], shared: bool):
        self._names = list(names)
        self._shared = shared and len(replicas) > 1
        self._params = [list(r.parameters()) for r in replicas]
        # Where each parameter sits (tied weights sit in several places): the object must stay.
        self._slots = [
            [
                (module._parameters, name, param)
                for module in replica.modules()
                for name, param in module._parameters.items()
                if param is not None
            ]
            for replica in replicas
        ]
        self._devices = [
            params[0].device if params else torch.device("cpu") for params in self._params
        ]
        self._first = self._layout(0)

    def _layout(self, replica: int) -> list[int]:
        # The address each parameter views: a cast, `.data =` and `set_` all move it (a
        # view of the same address with another shape or dtype goes unseen: cheap first).
        return [p.data_ptr() for p in self._params[replica]]

    def check_objects(self) -> None:
        """Raise if a replica's parameter object was replaced since prepare.

        Raises:
            RuntimeError: naming the parameter and what to do instead.
        """
        for replica, slots in enumerate(self._slots):
            for owner, name, param in slots:
                if owner.get(name) is not param:
                    self._replaced(replica, param)

    def _replaced(self, replica: int, param: torch.nn.Parameter) -> None:
        index = next(k for k, p in enumerate(self._params[replica]) if p is param)
        raise RuntimeError(
            f"parameter {self._names[index]!r} of replica {replica}'s copy of a mirrored "
            "module is no longer the Parameter it was prepared with (load_state_dict("
            "assign=True), torch.nn.utils.prune, or setting a module's parameter "
            "attribute replaces it): its gradients would not be all-reduced and the "
            "optimizer would not update it. Change values in place instead "
            "(load_state_dict without assign, or param.copy_(value) under "
            "torch.no_grad()), or make the change before crossdevice.torch.prepare"
        )

    def follow_first(self, in_run: bool = False) -> bool:
        """Give every replica replica 0's parameter memory where replica 0's has changed.

        Args:
            in_run: the change happened inside `strategy.run`: an error (shared storage).

        Returns:
            Whether anything was changed.

        Raises:
            RuntimeError: a parameter object was replaced, or (with `in_run` and shared
                storage) a replica's parameter stopped viewing replica 0's memory.
        """
        if len(self._params) == 1:
            return False
        self.check_objects()
        first = self._layout(0)
        if self._shared:
            broken = [r for r in range(1, len(self._params)) if self._layout(r) != first]
            if not broken:
                self._first = first
                return False
            if in_run:
                k = next(
                    k
                    for k, (a, b) in enumerate(zip(first, self._layout(broken[0]), strict=True))
                    if a != b
                )
                raise RuntimeError(
                    f"parameter {self._names[k]!r} of a mirrored module stopped sharing "
                    f"replica 0's memory inside strategy.run (replica {broken[0]}'s copy: "
                    "param.data = ..., param.set_(...) or a dtype cast): the replicas store "
                    "parameters once and the optimizer steps replica 0's. Change parameters "
                    "outside strategy.run (the replicas follow replica 0's), or prepare the "
                    "model with share_storage=False"
                )
            for r in broken:
                for param, source in zip(self._params[r], self._params[0], strict=True):
                    if (param.data_ptr(), param.dtype, param.shape) != (
                        source.data_ptr(),
                        source.dtype,
                        source.shape,
                    ):
                        realias(param, source)
            self._first = first
            return True
        if first == self._first:
            return False
        with torch.no_grad():
            for k, (now, before) in enumerate(zip(first, self._first, strict=True)):
                if now != before:
                    source = self._params[0][k]
                    for r in range(1, len(self._params)):
                        self._params[r][k].data = source.detach().clone().to(self._devices[r])
        self._first = first
        return True

    def record(self) -> None:
        """Every replica holds what it should now (they were all changed alike)."""
        self._first = self._layout(0)
