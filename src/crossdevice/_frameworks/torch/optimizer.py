"""`MirroredOptimizer`: one copy of a `torch.optim` optimizer per replica.

Keras' `optimizer.apply_gradients` in a replica context all-reduces the gradients and
updates the mirrored variables once per step. Here the gradients are all-reduced during
backward (`MirroredModule`), so each replica's own optimizer copy applies the same
update to its own parameters: state (Adam's moments) is per replica and never shared
between threads, and the copies stay bitwise identical.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from crossdevice._arrays import torch_guard
from crossdevice._frameworks.torch.module import MirroredModule
from crossdevice._frameworks.torch.replicas import local_replica_index
from crossdevice._strategies.base import Strategy

__all__ = ["MirroredOptimizer"]


class MirroredOptimizer(torch.optim.Optimizer):
    """A torch optimizer over mirrored modules' parameters, one copy per replica.

    Inside `strategy.run`, `step()` and `zero_grad()` act on the running replica's copy;
    `param_groups` (what learning-rate schedulers change) are replica 0's, and every
    replica takes their hyperparameters at each step. `state_dict()` is replica 0's and
    `load_state_dict()` loads every copy.

    Args:
        optimizer: an optimizer built over parameters of `modules` (replica 0's copies,
            which are the original modules' own parameters). It becomes replica 0's copy.
        modules: the mirrored modules whose parameters it updates.

    Raises:
        ValueError: the optimizer holds a parameter of no mirrored module.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, modules: Sequence[MirroredModule]) -> None:
        # No super().__init__: the wrapped optimizers hold the state (as Accelerate does).
        if isinstance(optimizer, MirroredOptimizer):
            raise TypeError(f"the optimizer is mirrored already: {optimizer!r}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "MirroredOptimizer expects a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}: {optimizer!r}"
            )
        if not modules:
            raise ValueError("MirroredOptimizer needs the mirrored modules it optimizes")
        strategies = {id(m.strategy): m.strategy for m in modules}
        if len(strategies) != 1:
            raise ValueError(
                "the mirrored modules of one optimizer must share one strategy, got "
                f"{list(strategies.values())!r}"
            )
        strategy: Strategy = modules[0].strategy
        num = len(modules[0].replicas)
        # replica 0's parameter -> every replica's
        mapping: dict[int, list[torch.Tensor]] = {}
        for module in modules:
            per_replica = [list(r.parameters()) for r in module.replicas]
            for k, param in enumerate(per_replica[0]):
                mapping[id(param)] = [params[k] for params in per_replica]
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in mapping:
                    raise ValueError(
                        f"the optimizer updates a parameter of shape {tuple(param.shape)} "
                        "that belongs to no mirrored module; build the optimizer over the "
                        "parameters of the modules you mirror (prepare them together)"
                    )
        optimizers = [optimizer]
        state = optimizer.state_dict()
        for i in range(1, num):
            groups = [
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [mapping[id(p)][i] for p in g["params"]],
                }
                for g in optimizer.param_groups
            ]
            replica_optimizer = type(optimizer)(groups, **optimizer.defaults)
            if state["state"]:
                # Deep copy: load_state_dict keeps host tensors as they are, and replicas
                # must never share state tensors.
                replica_optimizer.load_state_dict(copy.deepcopy(state))
            optimizers.append(replica_optimizer)
        for i, replica_optimizer in enumerate(optimizers):
            torch_guard.mark(replica_optimizer, strategy, i)
        self.__dict__["_strategy"] = strategy
        self.__dict__["_optimizers"] = optimizers
        self.defaults = optimizer.defaults
        torch_guard.install()

    @property
    def replicas(self) -> tuple[torch.optim.Optimizer, ...]:
        """Every local replica's optimizer, in replica order."""
        return tuple(self.__dict__["_optimizers"])

    def _index(self) -> int | None:
        return local_replica_index(self.__dict__["_strategy"])

    def _current(self) -> torch.optim.Optimizer:
        index = self._index()
        return self.__dict__["_optimizers"][0 if index is None else index]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Replica 0's parameter groups: change hyperparameters here (schedulers do)."""
        return self.__dict__["_optimizers"][0].param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        raise AttributeError("a MirroredOptimizer's param_groups are its replicas'")

    @property
    def state(self) -> Any:
        """The running replica's state (replica 0's in cross-replica context)."""
        return self._current().state

    @state.setter
    def state(self, value: Any) -> None:
        raise AttributeError("a MirroredOptimizer's state is its replicas'")

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Update the running replica's parameters with its (all-reduced) gradients.

        Raises:
            RuntimeError: called outside `strategy.run` while several replicas are in sync
                (their gradients are reduced only inside `run`).
        """
        index = self._index()
        optimizers = self.__dict__["_optimizers"]
        strategy: Strategy = self.__dict__["_strategy"]
        if index is None:
            if strategy.num_replicas_in_sync > 1:
                raise RuntimeError(
                    "MirroredOptimizer.step() was called outside strategy.run with "
                    f"{strategy.num_replicas_in_sync} replicas in sync; call it inside the "
                    "step function, after backward (gradients are all-reduced there)"
                )
            index = 0
        optimizer = optimizers[index]
        if index:
            # Schedulers change replica 0's groups; every replica follows them.
            for source, target in zip(
                optimizers[0].param_groups, optimizer.param_groups, strict=True
            ):
                for key, value in source.items():
                    if key != "params":
                        target[key] = value
        return optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: the running replica's, or every replica's outside `run`."""
        index = self._index()
        optimizers = self.__dict__["_optimizers"] if index is None else [self._current()]
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The running replica's `state_dict` (replica 0's in cross-replica context)."""
        return self._current().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load `state_dict` into every replica's optimizer (outside `strategy.run`)."""
        if self._index() is not None:
            raise RuntimeError("load the optimizer's state outside strategy.run")
        for optimizer in self.__dict__["_optimizers"]:
            optimizer.load_state_dict(copy.deepcopy(state_dict))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: mirror the parameters with their module, then build the optimizer."""
        raise RuntimeError(
            "add parameter groups before mirroring the optimizer: its replicas map each "
            "parameter to its replica copies when they are made"
        )

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a MirroredOptimizer cannot be pickled; save its state_dict()")

    def __repr__(self) -> str:
        optimizers = self.__dict__["_optimizers"]
        return f"MirroredOptimizer({len(optimizers)} replicas):\n{optimizers[0]!r}"
