"""`MirroredModule`: one copy of a `torch.nn.Module` per replica, used like the module.

TF mirrors a Keras model built under `strategy.scope()`: each variable has one component
per replica device, and the model used inside `strategy.run` reads the running replica's
components. Here the module is copied once per local replica (replica 0 keeps the
original object, moved to its device); every worker starts from the chief's values.
Inside `strategy.run`, calling the mirrored module, or reading its parameters,
buffers and submodules, uses the running replica's copy; in cross-replica context it
reads replica 0's, like a `MirroredVariable`. Gradients are all-reduced during backward
(`GradientSync`), floating buffers (BatchNorm statistics) are averaged across replicas
after each training-mode forward (TF aggregates moving statistics with MEAN), and random
draws use the replica's own generator (`random.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from crossdevice._arrays import torch_guard, torch_random
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op
from crossdevice._frameworks.torch.gradients import DEFAULT_BUCKET_CAP_BYTES, GradientSync
from crossdevice._frameworks.torch.replicas import (
    local_replica_index,
    strategy_or_current,
    torch_devices,
)
from crossdevice._frameworks.torch.threads import apply_thread_policy
from crossdevice._strategies.base import Strategy
from crossdevice._strategies.context import get_replica_context

__all__ = ["MirroredModule"]


class MirroredModule(torch.nn.Module):
    """A torch module mirrored on every replica of a strategy (TF's mirrored Keras model).

    Inside `strategy.run`, calling it runs the running replica's copy; gradients are
    all-reduced across replicas (and workers) during backward, in replica order, so every
    replica gets bitwise the same gradients; a `MirroredOptimizer` then applies the same
    update on every replica, and the copies stay identical.

    Args:
        module: the module to mirror. It becomes replica 0's copy (moved to replica 0's
            device); the others are deep copies. Every worker starts from the chief's
            parameters and buffers.
        strategy: the strategy; default: the current one (`strategy.scope()`).
        gradient_reduction: `"sum"` (TF's rule, the default: scale each replica's loss by
            the global batch size, e.g. with `compute_average_loss`) or `"mean"` (DDP's
            rule: each replica's mean loss).
        bucket_cap_bytes: gradients are reduced in buckets of about this many bytes, as
            backward produces them.
        sync_buffers: average floating buffers (BatchNorm running statistics) across
            replicas after every training-mode forward (TF's MEAN rule), so they stay
            equal on every replica.
        threads_per_replica: torch intra-op threads while replicas run in parallel:
            None for cores // local replicas, 0 to leave torch's setting alone.

    Example:
        >>> import crossdevice, crossdevice.torch, torch
        >>> strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with strategy.scope():
        ...     model = crossdevice.torch.MirroredModule(torch.nn.Linear(3, 1))
        >>> def step(x):
        ...     return model(x).sum()
        >>> len(strategy.experimental_local_results(strategy.run(step, (torch.ones(2, 3),))))
        2
    """

    def __init__(
        self,
        module: torch.nn.Module,
        strategy: Strategy | None = None,
        *,
        gradient_reduction: ReduceOp | str = ReduceOp.SUM,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
        sync_buffers: bool = True,
        threads_per_replica: int | None = None,
    ) -> None:
        if isinstance(module, MirroredModule):
            raise TypeError(f"the module is mirrored already: {module!r}")
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"MirroredModule expects a torch.nn.Module, got {type(module).__name__}: {module!r}"
            )
        if isinstance(bucket_cap_bytes, bool) or not isinstance(bucket_cap_bytes, int):
            raise TypeError(f"bucket_cap_bytes must be an int, got {bucket_cap_bytes!r}")
        if bucket_cap_bytes <= 0:
            raise ValueError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}")
        strategy = strategy_or_current(strategy, "MirroredModule")
        op = as_reduce_op(gradient_reduction)
        super().__init__()
        devices = torch_devices(strategy)
        replicas = [module.to(devices[0])]
        replicas += [copy.deepcopy(module).to(device) for device in devices[1:]]
        _broadcast_from_chief(strategy, replicas)
        for index, replica in enumerate(replicas):
            for submodule in replica.modules():
                torch_guard.mark(submodule, strategy, index)
        # Plain attributes, not submodules: nn.Module's own traversal would otherwise
        # list every replica's parameters.
        self.__dict__["_strategy"] = strategy
        self.__dict__["_replicas"] = replicas
        self.__dict__["_sync_buffers"] = sync_buffers
        self.__dict__["_gradients"] = GradientSync(
            [[p for p in r.parameters() if p.requires_grad] for r in replicas],
            op,
            bucket_cap_bytes,
            lambda: local_replica_index(strategy),
            strategy.num_replicas_in_sync,
        )
        self.__dict__["_synced_buffers"] = [_averaged_buffers(r) for r in replicas]
        self.training = module.training
        torch_guard.mark(self, strategy, None)
        torch_guard.install()
        torch_random.install()
        apply_thread_policy(len(replicas), threads_per_replica)

    # --- which copy -----------------------------------------------------------------------
    @property
    def strategy(self) -> Strategy:
        """The strategy this module is mirrored on."""
        return self.__dict__["_strategy"]

    @property
    def replicas(self) -> tuple[torch.nn.Module, ...]:
        """Every local replica's copy, in replica order (replica 0's is the original)."""
        return tuple(self.__dict__["_replicas"])

    @property
    def module(self) -> torch.nn.Module:
        """The running replica's copy (replica 0's in cross-replica context)."""
        return self._current()

    def _index(self) -> int:
        index = local_replica_index(self.__dict__["_strategy"])
        return 0 if index is None else index

    def _current(self) -> torch.nn.Module:
        return self.__dict__["_replicas"][self._index()]

    # --- use ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the running replica's copy (replica 0's in cross-replica context)."""
        strategy: Strategy = self.__dict__["_strategy"]
        index = local_replica_index(strategy)
        replicas = self.__dict__["_replicas"]
        if index is None:
            stateful = bool(self.__dict__["_synced_buffers"][0])
            if self.training and stateful and strategy.num_replicas_in_sync > 1:
                raise RuntimeError(
                    "a mirrored module with BatchNorm-style buffers was called in "
                    "training mode outside strategy.run: only replica 0's statistics "
                    "would change. Call model.eval() before evaluating outside "
                    "strategy.run, or call the model inside strategy.run"
                )
            return replicas[0](*args, **kwargs)
        output = replicas[index](*args, **kwargs)
        if self.training and self.__dict__["_sync_buffers"]:
            self._average_buffers(index)
        return output

    def _average_buffers(self, index: int) -> None:
        slots = self.__dict__["_synced_buffers"][index]
        if not slots or self.__dict__["_strategy"].num_replicas_in_sync == 1:
            return
        ctx = get_replica_context()
        assert ctx is not None
        averaged = ctx.all_reduce(ReduceOp.MEAN, [m._buffers[name] for m, name in slots])
        # New tensors rather than copy_: the forward just run saved the old ones for its
        # backward, and an in-place write would fail that backward's version check.
        for (module, name), value in zip(slots, averaged, strict=True):
            module._buffers[name] = value

    def no_sync(self) -> Any:
        """Context manager: backward passes inside accumulate gradients without reducing.

        As DDP's `no_sync`: run the first micro-batches of a step under it, and the last
        backward outside it reduces the accumulated gradients. Call it inside
        `strategy.run`.
        """
        index = local_replica_index(self.__dict__["_strategy"])
        if index is None:
            raise RuntimeError(
                "MirroredModule.no_sync() is per replica: use it inside strategy.run, "
                "around the backward passes that only accumulate"
            )
        return self.__dict__["_gradients"].no_sync(index)

    @property
    def gradient_buckets(self) -> list[int]:
        """The number of parameters in each gradient bucket, in reduction order."""
        return self.__dict__["_gradients"].bucket_sizes()

    # --- nn.Module's traversal: the running replica's copy --------------------------------
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The running replica's `named_parameters` (no `module.` prefix)."""
        return self._current().named_parameters(prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """The running replica's parameters (replica 0's in cross-replica context)."""
        return self._current().parameters(recurse)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The running replica's `named_buffers`."""
        return self._current().named_buffers(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        """The running replica's buffers."""
        return self._current().buffers(recurse)

    def children(self) -> Iterator[torch.nn.Module]:
        """The running replica's copy, the only child."""
        yield self._current()

    def named_children(self) -> Iterator[tuple[str, torch.nn.Module]]:
        """`("module", running replica's copy)`."""
        yield "module", self._current()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The running replica's `state_dict` (keys as in the original module)."""
        return self._current().state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load `state_dict` into every replica's copy (cross-replica context only)."""
        self._require_cross_replica("load_state_dict")
        result = None
        for replica in self.__dict__["_replicas"]:
            result = replica.load_state_dict(state_dict, strict=strict, assign=assign)
        return result

    def train(self, mode: bool = True) -> MirroredModule:
        """Set training mode on every replica's copy."""
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        self.training = mode
        for replica in self.__dict__.get("_replicas", ()):
            replica.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: the running replica's, or every replica's in cross-replica context."""
        index = local_replica_index(self.__dict__["_strategy"])
        replicas = self.__dict__["_replicas"] if index is None else [self._current()]
        for replica in replicas:
            replica.zero_grad(set_to_none)

    def requires_grad_(self, requires_grad: bool = True) -> MirroredModule:
        """Not supported after mirroring: the gradient buckets are fixed."""
        raise RuntimeError(
            "freeze or unfreeze parameters before mirroring the module (the gradient "
            "buckets are built from the parameters that require grad)"
        )

    def apply(self, fn: Any) -> MirroredModule:
        """Apply `fn` to every replica's modules (cross-replica context only)."""
        self._require_cross_replica("apply")
        for replica in self.__dict__["_replicas"]:
            replica.apply(fn)
        # `fn` may draw random numbers (initialisers): start every replica from replica
        # 0's values again, and every worker from the chief's.
        replicas = self.__dict__["_replicas"]
        with torch.no_grad():
            source = replicas[0].state_dict()
            for replica in replicas[1:]:
                for name, value in replica.state_dict().items():
                    value.copy_(source[name])
        _broadcast_from_chief(self.__dict__["_strategy"], replicas)
        fn(self)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> MirroredModule:
        replicas = self.__dict__.get("_replicas")
        if replicas is None:
            return super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        devices = torch_devices(self.__dict__["_strategy"])
        for replica, device in zip(replicas, devices, strict=True):
            replica._apply(fn, recurse)
            for tensor in (*replica.parameters(), *replica.buffers()):
                if tensor.device != device:
                    raise RuntimeError(
                        f"a mirrored module's replicas stay on the strategy's devices "
                        f"({[str(d) for d in devices]}), but this call moved one to "
                        f"{tensor.device}; move the module before mirroring it"
                    )
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            replicas = self.__dict__.get("_replicas")
            if replicas is None:
                raise
        return getattr(self._current(), name)

    def _require_cross_replica(self, what: str) -> None:
        if local_replica_index(self.__dict__["_strategy"]) is not None:
            raise RuntimeError(
                f"MirroredModule.{what} changes every replica's copy: call it outside strategy.run"
            )

    def __repr__(self) -> str:
        replicas = self.__dict__.get("_replicas", ())
        inner = repr(replicas[0]).replace("\n", "\n  ") if replicas else ""
        return (
            f"MirroredModule({len(replicas)} replicas on {self.__dict__['_strategy']!r}):\n"
            f"  {inner}"
        )


def _averaged_buffers(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """`(module, name)` of each floating buffer averaged across replicas after a forward.

    Buffers of `SyncBatchNorm` are equal already (global statistics) and are skipped.
    """
    from crossdevice._frameworks.torch.batchnorm import SyncBatchNorm

    slots = []
    for submodule in module.modules():
        if isinstance(submodule, SyncBatchNorm):
            continue
        for name, buffer in submodule._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                slots.append((submodule, name))
    return slots


def _broadcast_from_chief(strategy: Strategy, replicas: list[torch.nn.Module]) -> None:
    """Give every replica of every worker the chief's parameters and buffers.

    Local replicas are deep copies already; across workers, one broadcast per dtype.
    """
    communicator = getattr(strategy.extended, "_worker_communicator", None)
    tensors = [*replicas[0].parameters(), *replicas[0].buffers()]
    if communicator is not None and tensors:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for k, tensor in enumerate(tensors):
            by_dtype.setdefault(tensor.dtype, []).append(k)
        with torch.no_grad():
            for indices in by_dtype.values():
                flat = torch.cat([tensors[k].detach().reshape(-1).cpu() for k in indices])
                chief = torch.as_tensor(communicator.broadcast(flat, root=0))
                offset = 0
                for k in indices:
                    n = tensors[k].numel()
                    tensors[k].copy_(chief[offset : offset + n].view_as(tensors[k]))
                    offset += n
    if len(replicas) > 1:
        with torch.no_grad():
            for replica in replicas[1:]:
                others = [*replica.parameters(), *replica.buffers()]
                for target, source in zip(others, tensors, strict=True):
                    target.copy_(source)
