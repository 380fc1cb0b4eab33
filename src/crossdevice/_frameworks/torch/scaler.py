"""Loss scaling that every replica agrees on: a `torch.amp.GradScaler` for mirrored models.

A `GradScaler` keeps per-optimizer state (has `unscale_` run, which device found an inf)
and one scale. Shared by N replicas, its `unscale_` would refuse the second replica and
its `update` would back the scale off N times; each replica with its own scaler, an
inf found on one replica only (a gradient changed after it was reduced, say) would make
that replica skip the step and back off while the others step: they silently diverge
(pytorch#136009, #90057).

`prepare(..., scaler=scaler)` turns the user's scaler, in place, into a
`MirroredGradScaler`: one inner `GradScaler` per replica, all starting from the user's
state. `unscale_` (which `step` calls when the user has not) all-reduces the inf flags
across replicas and workers before anything uses them, so an inf on one replica makes
every replica skip the step, and every replica's `update` backs off identically: the
scales, the skipped steps and the parameters stay the same everywhere.

A `GradScaler` not given to `prepare` and used inside `strategy.run` by several local
replicas failed inside torch, in whichever way the replicas' timing took ("No inf checks
were recorded prior to update", "unscale_() has already been called on this optimizer"),
naming nothing of the fix (the bug hunt of session 53): its `unscale_`, `step` and
`update` there now raise an error that does (`_refuse_shared`). A disabled scaler
(`GradScaler(enabled=False)`) does nothing and passes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from crossdevice._arrays import torch_guard, torch_patches
from crossdevice._core import context
from crossdevice._frameworks.torch import step_state
from crossdevice._frameworks.torch.once import call_once
from crossdevice._frameworks.torch.optimizer import MirroredOptimizer
from crossdevice._frameworks.torch.replicas import local_replica_index, local_replicas
from crossdevice._strategies.base import Strategy
from crossdevice._strategies.context import get_replica_context

__all__ = ["MirroredGradScaler", "mirror_scaler"]


class MirroredGradScaler(torch.amp.GradScaler):
    """A `GradScaler` whose replicas agree on infs and scales (made by `prepare`).

    Use it as a `GradScaler`, inside `strategy.run`: `scaler.scale(loss).backward()`,
    `scaler.unscale_(optimizer)` (before clipping), `scaler.step(optimizer)`,
    `scaler.update()`. `optimizer` is the `MirroredOptimizer`. Outside `run` it reads
    as replica 0's scaler; `state_dict()` is replica 0's, `load_state_dict()` loads
    every replica's.
    """

    # No __init__: `mirror_scaler` converts a GradScaler in place (the user keeps it).

    def _inner(self) -> torch.amp.GradScaler:
        index = local_replica_index(self.__dict__["_crossdevice_strategy"])
        return self.__dict__["_crossdevice_replicas"][0 if index is None else index]

    def _replica_optimizer(self, optimizer: Any) -> Any:
        if not isinstance(optimizer, MirroredOptimizer):
            raise TypeError(
                "a mirrored GradScaler steps the MirroredOptimizer that prepare returned, got "
                f"{type(optimizer).__name__}: {optimizer!r}"
            )
        index = local_replica_index(self.__dict__["_crossdevice_strategy"])
        return optimizer.gradients_of(0 if index is None else index)

    def scale(self, outputs: Any) -> Any:
        """The running replica's `GradScaler.scale(outputs)`."""
        return self._inner().scale(outputs)

    def unscale_(self, optimizer: Any) -> None:
        """Unscale the running replica's gradients; the replicas agree on the inf flags.

        Where the replicas store parameters once (one optimizer step, which reads replica
        0's gradients), the gradients are unscaled once, replica 0's, for every replica.
        """
        inner = self._inner()
        replica_optimizer = self._replica_optimizer(optimizer)
        if optimizer.shares_storage and get_replica_context() is not None:
            self._unscale_once(inner, optimizer, replica_optimizer)
            return
        inner.unscale_(replica_optimizer)
        if not inner.is_enabled():
            return
        found = inner._per_optimizer_states[id(replica_optimizer)]["found_inf_per_device"]
        ctx = get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return
        local = sum(float(v.item()) for v in found.values())
        agreed = float(ctx.all_reduce("sum", torch.tensor(local, dtype=torch.float64)))
        for flag in found.values():
            flag.fill_(1.0 if agreed > 0 else 0.0)

    def _unscale_once(self, inner: Any, optimizer: Any, replica_optimizer: Any) -> None:
        state = inner._per_optimizer_states[id(replica_optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        if not inner.is_enabled():
            return
        found = call_once(self._unscale_replica_zero, optimizer)
        ctx = get_replica_context()
        assert ctx is not None
        if ctx.num_replicas_in_sync > len(self.__dict__["_crossdevice_replicas"]):
            found = float(ctx.all_reduce("sum", torch.tensor(found, dtype=torch.float64)))
        device = torch.device("cpu")
        flag = torch.full((), float(found > 0), dtype=torch.float32)  # torch asserts float32
        state["found_inf_per_device"] = {device: flag}
        state["stage"] = OptState.UNSCALED

    def _unscale_replica_zero(self, optimizer: Any) -> float:
        """Unscale replica 0's gradients (what the one step reads); the infs found."""
        inner = self.__dict__["_crossdevice_replicas"][0]
        scale = inner._scale
        assert scale is not None  # replica 0 scaled its loss before backward
        inv_scale = scale.double().reciprocal().float()
        found = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        per_device = inner._unscale_grads_(optimizer.gradients_of(0), inv_scale, found, False)
        return sum(float(v.item()) for v in per_device.values())

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale (agreed) unless done, then step the optimizer unless any replica found an inf."""
        inner = self._inner()
        if not inner.is_enabled():
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        replica_optimizer = self._replica_optimizer(optimizer)
        state = inner._per_optimizer_states[id(replica_optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                f"scaler.step() was called on {self._where()} a second time since its last "
                "scaler.update() (torch: 'step() has already been called since the last "
                "update()'): every replica must call scaler.step(optimizer) and then "
                "scaler.update() at every step; one that skipped update() is a step behind"
            )
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        result = None
        if not sum(float(v.item()) for v in state["found_inf_per_device"].values()):
            result = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """The running replica's `update` (the same on every replica: the infs agree)."""
        inner = self._inner()
        states = inner._per_optimizer_states.values()
        if (
            new_scale is None
            and inner.is_enabled()
            and not any(st["found_inf_per_device"] for st in states)
        ):  # what torch asserts, named
            raise RuntimeError(
                f"scaler.update() was called on {self._where()} with no scaler.step(optimizer) "
                "since the last update (torch: 'No inf checks were recorded prior to "
                "update'): every replica must call scaler.step(optimizer) and then "
                "scaler.update() at every step. To skip a step on a condition, decide it on a "
                "value every replica agrees on (all-reduce the flag first)"
            )
        inner.update(new_scale)

    def _where(self) -> str:
        index = local_replica_index(self.__dict__["_crossdevice_strategy"])
        return "the scaler outside strategy.run" if index is None else f"replica {index}"

    def get_scale(self) -> float:
        """The current scale (replica 0's outside `run`)."""
        return self._inner().get_scale()

    def is_enabled(self) -> bool:
        """Whether scaling is on."""
        return self._inner().is_enabled()

    def state_dict(self) -> dict[str, Any]:
        """Replica 0's state (every replica's is the same)."""
        return self._inner().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load `state_dict` into every replica's scaler (outside `strategy.run`)."""
        if local_replica_index(self.__dict__["_crossdevice_strategy"]) is not None:
            raise RuntimeError("load the scaler's state outside strategy.run")
        for inner in self.__dict__["_crossdevice_replicas"]:
            inner.load_state_dict(copy.deepcopy(state_dict))

    def __repr__(self) -> str:
        replicas = self.__dict__["_crossdevice_replicas"]
        return f"MirroredGradScaler({len(replicas)} replicas, scale={replicas[0].get_scale()})"


def mirror_scaler(scaler: Any, strategy: Strategy, replicas: int) -> MirroredGradScaler:
    """Turn `scaler` into a `MirroredGradScaler` in place (one inner scaler per replica).

    Raises:
        TypeError: `scaler` is not a `torch.amp.GradScaler`.
        RuntimeError: it is in the middle of a step (between `scale` and `update`).
    """
    if isinstance(scaler, MirroredGradScaler):
        return scaler
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}: {scaler!r}"
        )
    if scaler._per_optimizer_states:
        raise RuntimeError(
            "prepare the GradScaler before training with it (or after scaler.update()): "
            "it is in the middle of a step"
        )
    inners = [copy.deepcopy(scaler) for _ in range(replicas)]
    for i, inner in enumerate(inners):
        torch_guard.mark(inner, strategy, i)  # each replica's own (`_refuse_shared`)
    scaler.__class__ = MirroredGradScaler
    scaler.__dict__["_crossdevice_strategy"] = strategy
    scaler.__dict__["_crossdevice_replicas"] = inners
    return scaler  # type: ignore[return-value]


def _refuse_shared(original: Any) -> Any:
    """`GradScaler.<method>`, refused for a scaler shared by several local replicas.

    Across workers each call of a scaler not prepared is counted into the pass's state
    (`step_state.unprepared_scaler`): a scaler used on one worker only is an error.
    """
    refused = original.__name__ != "scale"  # (scaling alone changes no state)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if type(self) is not MirroredGradScaler and self.is_enabled():
            frame = context.current_frame()
            local = 0
            if frame is not None and frame.replica_context is not None:
                local = local_replicas(frame.strategy)
                if torch_guard.mark_of(self) is None:  # across workers: compared
                    step_state.unprepared_scaler(frame.strategy, frame.local_replica_id)
            if refused and local > 1 and torch_guard.mark_of(self) is None:
                raise RuntimeError(
                    f"GradScaler.{original.__name__}() was called inside strategy.run on a "
                    f"scaler that was not prepared, which the {local} replicas of this "
                    "process would share: its per-step state takes one replica's unscale_ "
                    "and inf checks for another's, and update() backs the scale off once "
                    "per replica. Prepare it with the model and optimizer, "
                    "`model, optimizer = crossdevice.torch.prepare(model, optimizer, "
                    "scaler=scaler)`, and keep using it as before"
                )
        return original(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = original.__name__
    method.__doc__ = original.__doc__
    method.__wrapped__ = original  # type: ignore[attr-defined]
    return method


torch_patches.register(
    *(
        torch_patches.Patch(lambda: torch.amp.GradScaler, name, _refuse_shared)
        for name in ("scale", "unscale_", "step", "update")
    )
)
