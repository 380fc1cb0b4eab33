"""`prepare`: mirror a model and its optimizer in one call (Accelerate's `prepare`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from crossdevice._arrays import heap, torch_guard
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op
from crossdevice._frameworks.torch.agreement import check_workers_agree, failing_together
from crossdevice._frameworks.torch.module import MirroredModule
from crossdevice._frameworks.torch.optimizer import MirroredOptimizer, needs_closure
from crossdevice._frameworks.torch.replicas import strategy_or_current
from crossdevice._frameworks.torch.scaler import mirror_scaler
from crossdevice._strategies.base import Strategy

__all__ = ["mark_replica_copy", "prepare"]


def prepare(
    *objects: Any,
    strategy: Strategy | None = None,
    gradient_reduction: ReduceOp | str = ReduceOp.SUM,
    bucket_cap_bytes: int | None = None,
    sync_buffers: bool = True,
    buffer_aggregation: Mapping[str, str] | None = None,
    threads_per_replica: int | None = None,
    scaler: Any = None,
    mixed_precision: str | None = None,
    share_storage: bool | None = None,
    gradient_dtype: torch.dtype | None = None,
) -> Any:
    """Mirror modules and optimizers on a strategy; returns them in the order given.

    Modules become `MirroredModule`s, optimizers `MirroredOptimizer`s over those modules'
    parameters. Call it once, in cross-replica context (under `strategy.scope()`, or pass
    `strategy`), then use the returned objects inside `strategy.run`.

    Args:
        *objects: `torch.nn.Module`s (also `torch.compile`d ones: every replica is
            compiled), `torch.optim.Optimizer`s and `torch.amp.GradScaler`s. A module
            prepared already may be passed with a new optimizer over its parameters, to
            prepare that optimizer.
        strategy: the strategy; default: the current one.
        gradient_reduction: `"sum"` (TF: per-example loss / global batch size) or
            `"mean"` (DDP: each replica's mean loss).
        bucket_cap_bytes: gradient bucket size (see `MirroredModule`; None: its default).
        sync_buffers: combine buffers across replicas after each training-mode forward
            (False: leave every buffer per replica).
        buffer_aggregation: how replicas combine buffers that a forward pass changes,
            `{name or fnmatch pattern: "mean" | "sum" | "max" | "first_replica" |
            "none"}` (TF's `VariableAggregation`; `"sum"` adds the replicas' changes, for
            counters). BatchNorm's running statistics default to `"mean"`; any other
            buffer a forward pass changes must be declared.
        threads_per_replica: torch intra-op threads per parallel replica (None: cores //
            replicas; 0: leave torch's setting).
        scaler: a `torch.amp.GradScaler` to use inside `strategy.run` (converted in
            place: keep using it): every replica agrees on its inf checks and scale.
        mixed_precision: `"bf16"` or `"fp16"`: the modules' forward passes run under
            `torch.autocast` with that dtype; `"fp16"` needs a `scaler`.
        share_storage: store parameters and optimizer state once for all replicas, and
            step the optimizer once per step (replicas wait for it). Each replica keeps
            its own `Parameter` objects over that storage, so autograd, `.grad` and hooks
            stay per replica. None (the default): when every local replica is on the
            CPU, unless an optimizer's step needs a closure (LBFGS evaluates the model
            on every replica). In-place writes to parameters inside `strategy.run`
            (outside a `merge_fn`) are then errors: every replica would make them.
        gradient_dtype: the dtype gradients travel in between workers, e.g.
            `torch.bfloat16` (half the bytes; DDP's bf16 compression hook): each
            worker's gradients are rounded to it once and added in float32, in rank
            order (docs/guides/gradient-compression.md gives the error bound). Needs a
            `MultiWorkerMirroredStrategy` with one replica per worker; replicas in one
            process are always added in full precision. None: their own dtype.

    Once per process it also fixes glibc's malloc thresholds, so that the memory one
    training step frees stays in the heap for the next instead of being handed back and
    faulted in again page by page (`crossdevice._arrays.heap`: 10-19% of an epoch of the
    TF tutorial CNN at 32-128 examples per worker on 2 cores). `CROSSDEVICE_KEEP_HEAP=0`
    in the environment leaves malloc alone.

    Returns:
        The mirrored object for one argument, else a tuple in argument order.

    Raises:
        TypeError: an argument is neither a module nor an optimizer, or a prepared
            module is passed without a new optimizer.
        ValueError: a module is a replica copy of a prepared model, or
            `gradient_dtype` is not a floating dtype or several replicas share a worker.

    Example:
        >>> import crossdevice, crossdevice.torch, torch
        >>> strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with strategy.scope():
        ...     model = torch.nn.Linear(4, 2)
        ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     model, optimizer = crossdevice.torch.prepare(model, optimizer)
        >>> type(model).__name__, type(optimizer).__name__
        ('MirroredModule', 'MirroredOptimizer')
    """
    strategy = strategy_or_current(strategy, "crossdevice.torch.prepare")
    with failing_together(strategy):  # a worker's error reaches its waiting peers
        heap.wanted()  # a bad CROSSDEVICE_KEEP_HEAP raises here, before anything is wrapped
        autocast = _autocast_dtype(mixed_precision)
        _check_gradient_dtype(gradient_dtype, strategy)
        # Buckets cut, or gradients sent, differently on one worker failed later as a
        # call of other shapes: compare the options first (threads are the host's own).
        aggregation: Any = buffer_aggregation
        if isinstance(aggregation, Mapping):  # (anything else: MirroredModule's error)
            aggregation = sorted(aggregation.items(), key=repr)
        check_workers_agree(
            strategy,
            "prepare() options",
            [
                f"gradient_reduction: {as_reduce_op(gradient_reduction).value}",
                f"bucket_cap_bytes: {bucket_cap_bytes}",
                f"sync_buffers: {sync_buffers}",
                f"buffer_aggregation: {aggregation}",
                f"mixed_precision: {mixed_precision}",
                f"share_storage: {share_storage}",
                f"gradient_dtype: {gradient_dtype}",
            ],
        )
        scalers = [o for o in objects if isinstance(o, torch.amp.GradScaler)]
        if scaler is not None:
            scalers.append(scaler)
        if mixed_precision == "fp16" and not scalers:
            raise ValueError(
                "mixed_precision='fp16' needs loss scaling, or small gradients underflow to "
                "zero: pass scaler=torch.amp.GradScaler() and use it in the step function "
                "(or use mixed_precision='bf16', which needs none)"
            )
        for each in scalers:
            mirror_scaler(each, strategy, len(strategy.extended.worker_devices))
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        if share_storage is None and any(needs_closure(o) for o in optimizers):
            share_storage = False
        if not any(not isinstance(o, MirroredOptimizer) for o in optimizers):
            for obj in objects:
                if isinstance(obj, MirroredModule):
                    raise TypeError(
                        f"the model is prepared already: {obj!r}. Prepare a model once and "
                        "use the returned MirroredModule (pass it again only together with a "
                        "new optimizer over its parameters)"
                    )
        modules: list[MirroredModule] = []
        out: list[Any] = []
        for obj in objects:
            if isinstance(obj, MirroredModule):
                modules.append(obj)
                out.append(obj)
            elif isinstance(obj, torch.jit.ScriptModule):
                raise TypeError(
                    "crossdevice.torch.prepare got a TorchScript module "
                    f"({type(obj).__name__}, from torch.jit.script or torch.jit.trace), whose "
                    "parameters and buffers a replica cannot copy or follow; prepare the eager "
                    "module (for speed, torch.compile the prepared module instead)"
                )
            elif isinstance(obj, torch.nn.Module):
                mirrored = MirroredModule(
                    obj,
                    strategy,
                    gradient_reduction=gradient_reduction,
                    bucket_cap_bytes=bucket_cap_bytes,
                    sync_buffers=sync_buffers,
                    buffer_aggregation=buffer_aggregation,
                    threads_per_replica=threads_per_replica,
                    autocast=autocast,
                    share_storage=share_storage,
                )
                mirrored.__dict__["_gradients"].gradient_dtype = gradient_dtype
                modules.append(mirrored)
                out.append(mirrored)
            elif isinstance(obj, torch.optim.Optimizer | torch.amp.GradScaler):
                out.append(obj)
            else:
                raise TypeError(
                    "crossdevice.torch.prepare takes torch.nn.Module, torch.optim.Optimizer and "
                    "torch.amp.GradScaler "
                    f"objects, got {type(obj).__name__}: {obj!r}"
                )
        for k, obj in enumerate(out):
            if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, MirroredOptimizer):
                if not modules:
                    raise ValueError(
                        "crossdevice.torch.prepare got an optimizer but no module: pass the "
                        "model with its optimizer, prepare(model, optimizer)"
                    )
                out[k] = MirroredOptimizer(obj, modules)
    heap.keep_heap()  # the process's malloc keeps what a step frees for the next one
    return out[0] if len(out) == 1 else tuple(out)


def _autocast_dtype(mixed_precision: str | None) -> torch.dtype | None:
    if mixed_precision is None:
        return None
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if mixed_precision not in dtypes:
        raise ValueError(f"mixed_precision must be None, 'bf16' or 'fp16', got {mixed_precision!r}")
    return dtypes[mixed_precision]


def _check_gradient_dtype(gradient_dtype: Any, strategy: Strategy) -> None:
    if gradient_dtype is None:
        return
    if not isinstance(gradient_dtype, torch.dtype) or not gradient_dtype.is_floating_point:
        raise ValueError(
            "gradient_dtype must be None or a floating torch dtype such as torch.bfloat16, "
            f"got {gradient_dtype!r}"
        )
    local = len(strategy.extended.worker_devices)
    if getattr(strategy.extended, "_num_workers", 1) > 1 and local > 1:
        raise ValueError(
            f"gradient_dtype={gradient_dtype!r} compresses what one replica per worker "
            f"sends, but this worker has {local} replicas: build the "
            "MultiWorkerMirroredStrategy with one device per worker (torchrun one process "
            "per device), or leave gradient_dtype=None"
        )


def mark_replica_copy(obj: Any, replica_id: int, strategy: Strategy | None = None) -> Any:
    """Declare `obj` local replica `replica_id`'s own copy of a module or optimizer.

    Inside `strategy.run`, a module with trainable parameters or an optimizer that
    belongs to no replica is refused (every replica calling it would share it). Copies
    that you make yourself, one per replica, pass once declared: each may then be used
    by its replica only (another replica using it is an error). Gradients of such copies
    are not all-reduced; `prepare` is the way to train one model on every replica.

    Args:
        obj: a `torch.nn.Module` (its submodules are declared with it) or a
            `torch.optim.Optimizer`.
        replica_id: the local replica (0 to the number of this worker's replicas - 1).
        strategy: the strategy; default: the current one.

    Returns:
        `obj`.

    Raises:
        TypeError: `obj` is neither a module nor an optimizer.
        ValueError: `replica_id` is not a local replica.

    Example:
        >>> import copy, crossdevice, crossdevice.torch, torch
        >>> strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> net = torch.nn.Linear(2, 1)
        >>> copies = [crossdevice.torch.mark_replica_copy(copy.deepcopy(net), i, strategy)
        ...           for i in range(2)]
        >>> def step():
        ...     mine = copies[crossdevice.get_replica_context().replica_id_in_sync_group]
        ...     return mine(torch.ones(1, 2)).sum()
        >>> len(strategy.experimental_local_results(strategy.run(step)))
        2
    """
    strategy = strategy_or_current(strategy, "crossdevice.torch.mark_replica_copy")
    local = len(strategy.extended.worker_devices)
    if (
        isinstance(replica_id, bool)
        or not isinstance(replica_id, int)
        or not 0 <= replica_id < local
    ):
        raise ValueError(
            f"replica_id must be a local replica of {strategy!r}, 0 to {local - 1}, got "
            f"{replica_id!r}"
        )
    if isinstance(obj, torch.nn.Module):
        for submodule in obj.modules():
            torch_guard.mark(submodule, strategy, replica_id)
    elif isinstance(obj, torch.optim.Optimizer):
        torch_guard.mark(obj, strategy, replica_id)
    else:
        raise TypeError(
            "mark_replica_copy takes a torch.nn.Module or torch.optim.Optimizer, got "
            f"{type(obj).__name__}: {obj!r}"
        )
    return obj
