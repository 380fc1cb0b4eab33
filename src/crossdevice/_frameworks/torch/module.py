"""`MirroredModule`: one copy of a `torch.nn.Module` per replica, used like the module.

TF mirrors a Keras model built under `strategy.scope()`: each variable has one component
per replica device. Here the module is copied once per local replica (replica 0 keeps
the original object, moved to its device); every worker starts from the chief's values.

The mirrored module behaves as the running replica's module for the whole `nn.Module`
surface: calling it, its parameters, buffers and submodules (`modules()`,
`named_modules()`, `children()`, indexing, iteration, `len`, attribute access), its
`state_dict`; in cross-replica context (outside `strategy.run`, in a `merge_fn`) it reads
as replica 0's, like a `MirroredVariable`, and what cross-replica code changes there
reaches every replica before they run again (`mirroring.py`). Gradients are all-reduced
during backward (`gradients.py`), buffers combine after each forward as declared
(`buffers.py`), and random draws use the replica's own generator (`torch_random`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from crossdevice._arrays import torch_guard, torch_patches
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op
from crossdevice._frameworks.torch import (  # noqa: F401 - backward, embedding, once: patches
    backward,
    embedding,
    nested,
    once,
    once_gradients,
    replica_zero,
    sparse,
    step_state,
)
from crossdevice._frameworks.torch.buffers import BufferSync, no_examples, resolve_aggregations
from crossdevice._frameworks.torch.gradients import (
    DEFAULT_BUCKET_CAP_BYTES,
    SHARED_BUCKET_CAP_BYTES,
    GradientSync,
)
from crossdevice._frameworks.torch.mirroring import (
    ReplicaMirror,
    compile_replicas,
    compiled_context,
    copy_replicas,
    make_replicas,
)
from crossdevice._frameworks.torch.replicas import (
    local_replica_index,
    strategy_or_current,
    torch_devices,
)
from crossdevice._frameworks.torch.setup import (
    broadcast_from_chief,
    check_mirrorable,
    sharing,
    unwrap_compiled,
)
from crossdevice._frameworks.torch.threads import apply_thread_policy
from crossdevice._strategies.base import Strategy

__all__ = ["MirroredModule"]


class MirroredModule(torch.nn.Module):
    """A torch module mirrored on every replica of a strategy (TF's mirrored Keras model).

    Inside `strategy.run`, calling it runs the running replica's copy; gradients are
    all-reduced across replicas (and workers) during backward, in replica order, so every
    replica gets bitwise the same gradients; a `MirroredOptimizer` then applies the same
    update on every replica, and the copies stay identical. Everything else reads as
    the running replica's module (replica 0's outside `run`); `module` is that copy.

    Args:
        module: the module to mirror (a `torch.compile`d one is compiled on every
            replica). It becomes replica 0's copy (moved to replica 0's device); the
            others are deep copies. Every worker starts from the chief's parameters and
            buffers.
        strategy: the strategy; default: the current one (`strategy.scope()`).
        gradient_reduction: `"sum"` (TF's rule, the default: scale each replica's loss by
            the global batch size, e.g. with `compute_average_loss`) or `"mean"` (DDP's
            rule: each replica's mean loss).
        bucket_cap_bytes: gradients are reduced in buckets of about this many bytes, as
            backward produces them; None: `SHARED_BUCKET_CAP_BYTES` (8 MiB) where the
            replicas share storage, else `DEFAULT_BUCKET_CAP_BYTES` (25 MiB).
        sync_buffers: combine buffers across replicas after every training-mode forward
            (False: every buffer is `"none"`).
        buffer_aggregation: `{buffer name or fnmatch pattern: "mean" | "sum" | "max" |
            "first_replica" | "none"}` for buffers a forward pass changes; BatchNorm's
            running statistics default to `"mean"` (see `crossdevice.torch.prepare`).
        threads_per_replica: torch intra-op threads while replicas run in parallel:
            None for cores // local replicas, 0 to leave torch's setting alone.
        autocast: run every forward pass under `torch.autocast` with this dtype
            (`prepare`'s `mixed_precision`).
        share_storage: store the parameters once for all replicas (each replica keeps
            its own `Parameter` objects over that storage, its own autograd and
            `.grad`); None: when every local replica is on the CPU. See `prepare`.

    Raises:
        TypeError: `module` is not a torch module, or is mirrored already.
        ValueError: `module` is a replica copy of a mirrored module, or a bad
            `bucket_cap_bytes` or `buffer_aggregation`.

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
        bucket_cap_bytes: int | None = None,
        sync_buffers: bool = True,
        buffer_aggregation: Mapping[str, str] | None = None,
        threads_per_replica: int | None = None,
        autocast: torch.dtype | None = None,
        share_storage: bool | None = None,
    ) -> None:
        module, compiled = unwrap_compiled(module)
        if isinstance(module, MirroredModule):
            raise TypeError(
                f"the module is mirrored already: {module!r}. Prepare a model once and use "
                "the MirroredModule prepare returned"
            )
        check_mirrorable(module)
        if bucket_cap_bytes is not None and (
            isinstance(bucket_cap_bytes, bool) or not isinstance(bucket_cap_bytes, int)
        ):
            raise TypeError(f"bucket_cap_bytes must be an int or None, got {bucket_cap_bytes!r}")
        if bucket_cap_bytes is not None and bucket_cap_bytes <= 0:
            raise ValueError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}")
        strategy = strategy_or_current(strategy, "MirroredModule")
        op = as_reduce_op(gradient_reduction)
        aggregations = resolve_aggregations(module, buffer_aggregation, sync_buffers)
        super().__init__()
        devices = torch_devices(strategy)
        shared = sharing(share_storage, devices)
        if bucket_cap_bytes is None:
            bucket_cap_bytes = SHARED_BUCKET_CAP_BYTES if shared else DEFAULT_BUCKET_CAP_BYTES
        replicas = make_replicas(module, devices, shared)
        if compiled is not None:
            compile_replicas(replicas, compiled)
        broadcast_from_chief(strategy, replicas)
        self._setup(strategy, replicas, op, bucket_cap_bytes, aggregations, autocast, shared)
        strategy._patch_torch()  # its replicas run in parallel: the patches (and threads)
        apply_thread_policy(len(replicas), threads_per_replica)

    def _setup(
        self,
        strategy: Strategy,
        replicas: list[torch.nn.Module],
        op: ReduceOp,
        bucket_cap_bytes: int,
        aggregations: dict[str, str | None],
        autocast: torch.dtype | None,
        shared: bool,
    ) -> None:
        # Plain attributes, not submodules (nn.Module would list every replica's parameters).
        state = self.__dict__
        state["_strategy"] = strategy
        state["_replicas"] = replicas
        state["_options"] = (op, bucket_cap_bytes, aggregations, autocast, shared)
        state["_shared"] = shared
        state["_autocast"] = None if autocast is None else (torch_devices(strategy), autocast)
        names = [name for name, _ in replicas[0].named_parameters()]
        sparse.mark(replicas[0])  # its sparse gradients (a deep copy's parameters are new)
        sync = GradientSync(
            [list(r.parameters()) for r in replicas],
            names,
            op,
            bucket_cap_bytes,
            functools.partial(local_replica_index, strategy),
            strategy.num_replicas_in_sync,
            shared,
        )
        state["_gradients"] = sync
        buffers = BufferSync(replicas, aggregations, strategy.num_replicas_in_sync)
        state["_buffer_sync"] = buffers
        mirror = ReplicaMirror(replicas, buffers, shared, functools.partial(_own_hooks, sync))
        state["_mirror"] = mirror
        backward.register(strategy, sync)
        once_gradients.register(strategy, sync)  # call_once's gradient writes reach all
        step_state.watch(sync, replicas, strategy)  # (after the chief's values: all alike)
        if strategy.num_replicas_in_sync > 1:  # alone, nothing to keep in step: no per-run calls
            strategy.extended._sections.add(mirror)
        torch_guard.mark(self, strategy, None)
        for index, replica in enumerate(replicas):
            for submodule in replica.modules():
                torch_guard.mark(submodule, strategy, index)

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
        """The running replica's copy (replica 0's in cross-replica context), as DDP's."""
        return self._current()

    def _index(self) -> int:
        index = local_replica_index(self.__dict__["_strategy"])
        return 0 if index is None else index

    def _current(self) -> torch.nn.Module:
        return self.__dict__["_replicas"][self._index()]

    # --- use ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the running replica's copy (replica 0's in cross-replica context).

        A training-mode forward in cross-replica context (outside `strategy.run`:
        `torch.optim.swa_utils.update_bn`) changes replica 0's buffers, on the whole
        batch, and every local replica takes them (TF: an assignment in cross-replica
        context sets every component of a mirrored variable).

        Under `torch.compile` this dispatch runs eagerly and the replica's module is
        compiled (`_ready_for_dynamo`).
        """
        index, in_replica = _before(self)
        autocast = self.__dict__["_autocast"]
        if autocast is None:
            output = self.__dict__["_replicas"][index](*args, **kwargs)
        else:
            devices, dtype = autocast
            with torch.autocast(devices[index].type, dtype=dtype):
                output = self.__dict__["_replicas"][index](*args, **kwargs)
        if in_replica:
            _after(self, index, no_examples(args, kwargs))
        elif self.training:  # cross-replica code (`update_bn`): every replica follows
            self.__dict__["_buffer_sync"].follow_first()
        return output

    def no_sync(self) -> Any:
        """Context manager: backward passes inside accumulate gradients without reducing.

        As DDP's `no_sync`: run the first micro-batches of a step under it (inside
        `strategy.run`); the last backward outside it reduces the accumulated gradients.
        """
        index = local_replica_index(self.__dict__["_strategy"])
        if index is None:
            raise RuntimeError(
                "MirroredModule.no_sync() is per replica: use it inside strategy.run, "
                "around the backward passes that only accumulate"
            )
        return self.__dict__["_gradients"].no_sync(index)

    @property
    def shares_storage(self) -> bool:
        """Whether the replicas' parameters are stored once (see `prepare`)."""
        return self.__dict__["_shared"]

    @property
    def gradient_buckets(self) -> list[int]:
        """The number of parameters in each gradient bucket, in reduction order."""
        return self.__dict__["_gradients"].bucket_sizes()

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compile every replica's module in place (`torch.nn.Module.compile`'s arguments).

        `torch.compile(model)` of a mirrored module compiles the same way: the replicas'
        modules, never the dispatch to the running replica.
        """
        replicas = self.__dict__["_replicas"]
        replicas[0].compile(*args, **kwargs)
        context = compiled_context(replicas[0]._compiled_call_impl)
        compile_replicas(replicas[1:], context)

    # --- nn.Module's surface: the running replica's module ---------------------------------
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

    def named_modules(
        self,
        memo: set[torch.nn.Module] | None = None,
        prefix: str = "",
        remove_duplicate: bool = True,
    ) -> Iterator[tuple[str, torch.nn.Module]]:
        """The running replica's `named_modules`: its module first, then every submodule."""
        return self._current().named_modules(memo, prefix, remove_duplicate)

    def named_children(self) -> Iterator[tuple[str, torch.nn.Module]]:
        """The running replica's module's children (so `children()` is theirs too)."""
        return self._current().named_children()

    def get_submodule(self, target: str) -> torch.nn.Module:
        """The running replica's submodule at `target` ("" for its module)."""
        return self._current().get_submodule(target)

    def get_parameter(self, target: str) -> torch.nn.Parameter:
        """The running replica's parameter at `target`."""
        return self._current().get_parameter(target)

    def get_buffer(self, target: str) -> torch.Tensor:
        """The running replica's buffer at `target`."""
        return self._current().get_buffer(target)

    def __getitem__(self, key: Any) -> Any:
        current = self._current()
        if not hasattr(type(current), "__getitem__"):
            raise TypeError(f"'{type(current).__name__}' object is not subscriptable")
        return current[key]  # type: ignore[index]

    def __len__(self) -> int:
        return len(self._current())  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._current())  # type: ignore[call-overload]

    def __contains__(self, key: Any) -> bool:
        return key in self._current()  # type: ignore[operator]

    def __bool__(self) -> bool:
        return True  # __len__ must not decide: most modules have no length

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The running replica's `state_dict` (keys as in the original module)."""
        return self._current().state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load `state_dict` once, into replica 0's copy; every replica takes its values.

        Cross-replica context only; its hooks run once (`replica_zero.py`). `assign=True`
        is refused: it replaces the parameters that the gradient reduction and the
        optimizer hold (load values in place, the default).
        """
        self._require_cross_replica("load_state_dict")
        if assign:
            raise RuntimeError(
                "load_state_dict(assign=True) replaces a mirrored module's parameters, but "
                "its gradient reduction and optimizer hold the prepared ones: the new ones "
                "would never train. Load in place (assign=False, the default), or load "
                "with assign=True before crossdevice.torch.prepare"
            )
        return self._once(lambda first: first.load_state_dict(state_dict, strict=strict), True)

    def train(self, mode: bool = True) -> MirroredModule:
        """Set training mode: every copy's outside `strategy.run`, the running replica's inside.

        Inside `run` each replica sets its own copy's mode (a validation pass in the
        step), as each would on its own device, and reads its own.
        """
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        replicas = self.__dict__.get("_replicas")
        if replicas is None:
            self.__dict__["_training"] = mode
            return self
        index = local_replica_index(self.__dict__["_strategy"])
        if index is None:  # once, on replica 0's: a submodule's own train() may write
            self._once(lambda first: first.train(mode), False)
        else:
            replicas[index].train(mode)
        return self

    @property
    def training(self) -> bool:
        """The running replica's copy's training flag (replica 0's outside `run`)."""
        if "_replicas" not in self.__dict__:
            return self.__dict__.get("_training", True)
        return self._current().training

    @training.setter
    def training(self, mode: bool) -> None:
        replicas = self.__dict__.get("_replicas")
        if replicas is None:  # torch.nn.Module.__init__
            self.__dict__["_training"] = mode
            return
        index = local_replica_index(self.__dict__["_strategy"])
        for replica in replicas if index is None else [replicas[index]]:
            replica.training = mode

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: the running replica's, or every replica's in cross-replica context."""
        index = local_replica_index(self.__dict__["_strategy"])
        replicas = self.__dict__["_replicas"]
        sync: GradientSync = self.__dict__["_gradients"]
        for r in range(len(replicas)) if index is None else [index]:
            replicas[r].zero_grad(set_to_none)
            sync.new_step(r, range(len(sync.params(r))))
        if index is not None:
            step_state.zeroed(sync, index)  # compared across workers (`step_state.py`)
        for check in self.__dict__.get("_step_checks", ()) if index is not None else ():
            check.zeroed(index)  # counted as its optimizers' own (`step_check.py`)

    def requires_grad_(self, requires_grad: bool = True) -> MirroredModule:
        """Set `requires_grad` on the running replica's copy (every copy outside `run`).

        The gradient buckets follow from the next backward pass on.
        """
        index = local_replica_index(self.__dict__["_strategy"])
        replicas = self.__dict__["_replicas"]
        for replica in replicas if index is None else [replicas[index]]:
            replica.requires_grad_(requires_grad)
        return self

    def apply(self, fn: Any) -> MirroredModule:
        """Apply `fn` as plain torch does, to replica 0's modules; every replica follows.

        Cross-replica context only. An in-place or random `fn` acts as on the original
        module; every replica (every worker's, from the chief's) then takes the result.
        """
        self._require_cross_replica("apply")
        self._once(lambda first: first.apply(fn), True)
        broadcast_from_chief(self.__dict__["_strategy"], self.__dict__["_replicas"])
        return self

    def _once(self, call: Any, values: bool) -> Any:
        s = self.__dict__  # `call(replica 0's module)`, then every replica follows it
        buffers = s["_buffer_sync"] if values else None
        return replica_zero.run_once(call, s["_replicas"], s["_mirror"], buffers, s["_shared"])

    def _apply(self, fn: Any, recurse: bool = True) -> MirroredModule:
        replicas = self.__dict__.get("_replicas")
        if replicas is None:
            return super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        devices = torch_devices(self.__dict__["_strategy"])
        index = local_replica_index(self.__dict__["_strategy"])
        if index is not None:  # the running replica's copy (`model.to(device)` in a step)
            replicas, devices = [replicas[index]], [devices[index]]
        mirror: ReplicaMirror = self.__dict__["_mirror"]
        if index is None:
            mirror.sync_now()  # replica 0's changes so far reach every replica first
        each, next_replica = replica_zero.conversion(fn, index is None and self.shares_storage)
        try:
            for replica, device in zip(replicas, devices, strict=True):
                replica._apply(each, recurse)
                next_replica()
                for tensor in (*replica.parameters(), *replica.buffers()):
                    if tensor.device != device:
                        raise RuntimeError(
                            f"a mirrored module's replicas stay on the strategy's devices "
                            f"({[str(d) for d in devices]}), but this call moved one to "
                            f"{tensor.device}; move the module before mirroring it"
                        )
        finally:
            if index is None:
                # torch gives each parameter new memory (`param.data = fn(param)`): with
                # shared storage each replica views replica 0's again; the parameters must
                # stay the prepared objects (torch.__future__'s overwrite option: an error).
                mirror.settled()
        return self

    def __getattr__(self, name: str) -> Any:
        # torch.compile(model) looks up attributes the wrapper lacks (forwarded here)
        # before it traces anything: the dispatch must be ready for it by then.
        torch_patches.check_dynamo()
        try:
            return super().__getattr__(name)
        except AttributeError:
            replicas = self.__dict__.get("_replicas")
            if replicas is None:
                raise
        return getattr(self._current(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        replicas = self.__dict__.get("_replicas")
        if (
            replicas is None
            or name.startswith("_")
            or name == "training"
            or hasattr(type(self), name)
        ):
            super().__setattr__(name, value)
            return
        if isinstance(value, torch.nn.Module | torch.Tensor):
            raise AttributeError(
                f"cannot set {name!r} to a {type(value).__name__} on a mirrored module: the "
                "replicas were copied at prepare and would not see it. Add or replace "
                "layers, parameters and buffers before crossdevice.torch.prepare"
            )
        # A plain attribute (a flag, a temperature): every replica's copy gets it.
        self._require_cross_replica(f"setting attribute {name!r}")
        for replica in replicas:
            setattr(replica, name, value)

    def _refuse_registration(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "a mirrored module cannot take new parameters, buffers or submodules: the "
            "replicas were copied at prepare. Register them on the module before "
            "crossdevice.torch.prepare"
        )

    register_parameter = register_buffer = add_module = register_module = _refuse_registration

    def _require_cross_replica(self, what: str) -> None:
        if local_replica_index(self.__dict__["_strategy"]) is not None:
            raise RuntimeError(
                f"MirroredModule.{what} changes every replica's copy: call it outside strategy.run"
            )

    # --- copies ---------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> MirroredModule:
        """A mirrored module on the same strategy over deep copies of every replica."""
        self._require_cross_replica("deep copy")
        copies = copy_replicas(self.__dict__["_replicas"], memo, self.__dict__["_shared"])
        new = MirroredModule.__new__(MirroredModule)
        torch.nn.Module.__init__(new)
        new._setup(self.__dict__["_strategy"], copies, *self.__dict__["_options"])
        new.train(self.training)
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A strategy (threads, a process group) cannot be pickled: a pickled mirrored
        # module (torch.save(model)) loads as its replica 0's module, a plain torch module.
        return _as_itself, (self._current(),)

    def __repr__(self) -> str:
        replicas = self.__dict__.get("_replicas", ())
        inner = repr(replicas[0]).replace("\n", "\n  ") if replicas else ""
        return (
            f"MirroredModule({len(replicas)} replicas on {self.__dict__['_strategy']!r}):\n"
            f"  {inner}"
        )


def _as_itself(module: torch.nn.Module) -> torch.nn.Module:
    """What a pickled `MirroredModule` loads as: the replica module it was pickled with."""
    return module


# --- forward: the dispatch stays out of torch.compile, the replica's module goes in ---------
def _before(self: MirroredModule) -> tuple[int, bool]:
    """The replica to run (0 in cross-replica context) and whether a replica runs it."""
    state = self.__dict__
    strategy: Strategy = state["_strategy"]
    index = local_replica_index(strategy)
    if index is not None:
        return index, True
    return 0, False


def _after(self: MirroredModule, index: int, empty: bool) -> None:
    # The replica's own mode: another replica may be in eval mode meanwhile.
    replica = self.__dict__["_replicas"][index]
    self.__dict__["_buffer_sync"].after_forward(index, replica.training, empty)


def _own_hooks(sync: GradientSync) -> list[int]:
    """The handle ids of the gradient reduction's hooks on the replicas' parameters."""
    handles = getattr(sync, "_handles", ())
    return [h.id for per_replica in handles for h in per_replica if h is not None]


def _ready_for_dynamo() -> None:
    """Keep `MirroredModule.forward`'s dispatch out of torch.compile's graphs.

    Dynamo skips `forward`'s own frame (it reads this thread's replica context), runs
    `_before` / `_after` (context, collectives) eagerly, and compiles the replica's module
    that `forward` calls. Run once torch's compiler is loaded (`on_dynamo`).
    """
    global _before, _after
    import torch._dynamo

    torch._dynamo.decorators.skip(MirroredModule.forward)
    _before = torch._dynamo.disable(_before)  # type: ignore[no-untyped-call]
    _after = torch._dynamo.disable(_after)  # type: ignore[no-untyped-call]


torch_patches.on_dynamo(_ready_for_dynamo)
for _name in replica_zero.STATE_DICT_HOOKS:  # on the module whose state_dict() runs them
    setattr(MirroredModule, _name, replica_zero.on_running_replica(_name))
nested.install(MirroredModule)  # its parts of a parent's load and of a checkpoint
