"""`Strategy`: the public template methods of every strategy.

`StrategyExtended`'s are in `extended.py` (re-exported here).

Template methods validate their arguments and context, then call a hook that the
concrete strategy implements (`_call_for_each_replica`, `_reduce_to`, `_batch_reduce_to`,
`_update`, `_gather_to`, `_create_variable`, ...). Concrete strategies override hooks only.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from crossdevice._arrays import backend_for, torch_patches
from crossdevice._core import context, nest, validate
from crossdevice._core.errors import CROSS_REPLICA_REQUIRED
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op
from crossdevice._input.distributed import DistributedDataset, DistributedDatasetsFromFunction
from crossdevice._replica import refusals
from crossdevice._strategies.extended import (
    SingleReplicaExtended as SingleReplicaExtended,
)
from crossdevice._strategies.extended import StrategyExtended as StrategyExtended
from crossdevice._strategies.leaves import as_reducible_leaf as as_reducible_leaf
from crossdevice._values.distributed_variables import DistributedVariable
from crossdevice._values.values import DistributedValues, PerReplica
from crossdevice._values.variables import set_variable_creator

__all__ = ["SingleReplicaExtended", "Strategy", "StrategyExtended", "as_reducible_leaf"]

GATHER_REQUIRES_CROSS_REPLICA = (
    "`tf.distribute.Strategy.gather` method requires cross-replica context, use "
    "`get_replica_context().all_gather()` instead"
)


def _check_can_enter(strategy: Strategy, frame: context.Frame | None) -> None:
    """Entering `strategy`'s cross-replica context from `frame` (the current one) is OK."""
    if frame is None:
        return
    if frame.strategy is not strategy and not frame.strategy.extended._is_default:
        raise RuntimeError(
            f"Mixing different crossdevice.Strategy objects: {strategy!r} is not "
            f"{frame.strategy!r}; leave the other strategy's scope first"
        )
    if frame.replica_context is not None:
        raise RuntimeError(CROSS_REPLICA_REQUIRED)


class _Scope:
    """`with strategy.scope():` — enter the strategy's cross-replica context."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._frames: list[context.Frame] = []

    def __enter__(self) -> Strategy:
        _check_can_enter(self._strategy, context.current_frame())
        new = context.Frame(self._strategy)
        context.push_frame(new)
        self._frames.append(new)
        return self._strategy

    def __exit__(self, *exc: object) -> None:
        context.pop_frame(self._frames.pop())


class Strategy:
    """A way to distribute computation across devices (`tf.distribute.Strategy`).

    Use a concrete strategy: `MirroredStrategy`, `OneDeviceStrategy`,
    `experimental.CentralStorageStrategy` or `MultiWorkerMirroredStrategy`.
    """

    def __init__(self, extended: StrategyExtended) -> None:
        self._extended = extended
        self._run_frame: context.Frame | None = None
        #: `run` calls so far (per-replica random streams are reseeded once per run).
        self._runs = 0
        #: Whether this strategy holds torch's replica patches in force (`torch_patches`).
        self._torch_patched = False

    @property
    def extended(self) -> StrategyExtended:
        """The lower-level API (`StrategyExtended`)."""
        return self._extended

    def close(self) -> None:
        """End this strategy's replica threads now; a later `run` raises RuntimeError.

        A strategy nobody references is closed when it is collected; `close()` (or a
        `with` block) ends its threads at a known point. Idempotent. A `run` in flight on
        another thread finishes on every replica first (close waits for it a little);
        inside a run of this strategy (a replica function, a merge_fn) close raises
        RuntimeError: the run waits for the replicas it would end.

        Example:
            >>> import crossdevice
            >>> with crossdevice.MirroredStrategy(["CPU:0", "CPU:1"]) as strategy:
            ...     _ = strategy.run(lambda: 1)
        """
        frame = context.current_frame()
        if frame is not None and frame.strategy is self and frame.replica_context is not None:
            # Strategies without replica threads too (their runner refuses it in a merge_fn).
            raise RuntimeError(refusals.close_inside_run(type(self).__name__))
        self._extended._close()
        if self._torch_patched:
            torch_patches.release(self)

    def __enter__(self) -> Strategy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas over which values are aggregated."""
        return self._extended._num_replicas_in_sync

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver of a multi-worker strategy; None for this one (TF).

        Strategies that run on one worker have no cluster; `MultiWorkerMirroredStrategy`
        returns a resolver (`cluster_spec()`, `task_type`, `task_id`, ...).
        """
        return None

    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        """Context manager making this strategy current (cross-replica context).

        Variables created inside are distributed variables of this strategy.
        """
        return _Scope(self)

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        """Run `fn` once on each replica, concurrently, with the replica's arguments.

        Distributed values in `args`/`kwargs` are split: replica i gets component i.

        Args:
            fn: the function to run on each replica.
            args: positional arguments (a list or tuple).
            kwargs: keyword arguments.
            options: accepted for compatibility (`tf.distribute.RunOptions`); unused.

        Returns:
            The results regrouped: a value identical on all replicas stays plain,
            differing values become `PerReplica`, variables come back as themselves.

        Example:
            >>> import crossdevice, numpy as np
            >>> strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> def step():
            ...     ctx = crossdevice.get_replica_context()
            ...     return ctx.all_reduce("sum", np.float32(ctx.replica_id_in_sync_group + 1))
            >>> float(strategy.experimental_local_results(strategy.run(step))[0])
            3.0
        """
        del options
        validate.function(fn, "Strategy.run")
        # Before any truth test: an array's or a tensor's is ambiguous (the bug hunt).
        if type(args) is not tuple and not isinstance(args, list | tuple):
            raise ValueError(
                f"positional args must be a list or tuple, got {type(args)}; wrap a single "
                "argument as args=(x,)"
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"kwargs must be a dict or None, got {type(kwargs)}")
        # The per-step case, `args=(batch,)` of plain arrays: no distributed value to fit.
        if (args or kwargs) and (kwargs or type(args) is not tuple or not nest.plain_leaves(args)):
            validate.fits_strategy((args, kwargs), self, "Strategy.run")
        frame = context.current_frame()
        if frame is not None and frame.replica_context is not None:
            raise RuntimeError(
                "strategy.run was called inside a replica context (from inside another "
                "strategy.run); call it from cross-replica context"
            )
        extended = self._extended
        args = args if type(args) is tuple else tuple(args)
        kwargs = dict(kwargs) if kwargs else {}
        if extended._is_default:
            # TF: the default strategy's scope pushes no cross-replica context; entering
            # it only checks that no other strategy is current.
            with self.scope():
                return extended._call_for_each_replica(fn, args, kwargs)
        # `with self.scope():` without building a scope object per step: frames are
        # immutable, so one cross-replica frame serves every run.
        if frame is not None:
            _check_can_enter(self, frame)
        cross = self._run_frame
        if cross is None:
            cross = self._run_frame = context.Frame(self)
        self._runs += 1
        if not self._torch_patched and "torch" in sys.modules:
            self._patch_torch()
        sections = extended._sections
        # Replicas inherit the caller's open default scope, whatever thread they run on.
        in_default_scope = context.default_scope_open()
        if in_default_scope:
            extended._runs_in_default_scope += 1
        context.push_frame(cross)
        try:
            if sections:
                sections.leave()  # replicas start from replica 0's state (`sections`)
            try:
                return extended._call_for_each_replica(fn, args, kwargs)
            finally:
                if sections:
                    sections.enter()
        finally:
            context.pop_frame(cross)
            if in_default_scope:
                extended._runs_in_default_scope -= 1

    def _patch_torch(self) -> None:
        """Put torch's replica patches in force while this strategy lives (`torch_patches`).

        With several replicas in sync: refuse modules and optimizers the replicas would
        share, and give each replica its own random stream (torch has one per process).
        """
        if self._extended._num_replicas_in_sync <= 1:
            return
        from crossdevice._arrays import torch_guard, torch_random  # noqa: F401 - registers

        torch_patches.require(self)
        self._torch_patched = True

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: Any = None) -> Any:
        """Reduce `value` across replicas to this worker's host (cross-replica context).

        With `axis=None` the replicas' values are combined element-wise. With an axis
        (usually the batch axis 0), each replica first sums over it, so SUM gives the
        total over the global batch and MEAN the true mean: per-replica sums and element
        counts are reduced, then divided, which is right for a partial last batch too.

        Args:
            reduce_op: `ReduceOp.SUM`/`MEAN` or `"sum"`/`"mean"`.
            value: a `PerReplica`/`Mirrored` value, a plain array, or a nest of them.
            axis: None, an int, or a tuple/list of ints.

        Returns:
            The reduced value (a nest if `value` is one).
        """
        context.require_cross_replica(self)
        op = as_reduce_op(reduce_op)
        validate.reducible(value, "Strategy.reduce")
        validate.fits_strategy(value, self, "Strategy.reduce")
        extended = self._extended
        if axis is None:
            reduced = extended.reduce_to(op, value, destinations=extended._host_device)
            return nest.map_structure(lambda x: extended._local_results(x)[0], reduced)
        # Every leaf's axes are checked before the first leaf is reduced.
        leaves, structure = nest.flatten(value)
        parts = [_components(leaf) for leaf in leaves]
        axes = [_check_axes(axis, components, "Strategy.reduce", True) for _, components in parts]
        return nest.unflatten(
            structure,
            [
                self._reduce_with_axis(op, leaf, components, leaf_axes)
                for (leaf, components), leaf_axes in zip(parts, axes, strict=True)
            ],
        )

    def _reduce_with_axis(
        self, op: ReduceOp, value: Any, components: tuple[Any, ...], axes: tuple[int, ...]
    ) -> Any:
        extended = self._extended
        sums = [backend_for(c).reduce_sum(c, axes) for c in components]
        if isinstance(value, DistributedValues):
            numer: Any = PerReplica(sums, devices=value._devices)
        elif op == ReduceOp.SUM:
            # TF runs the per-axis sum in every replica (`self.run(reduce_sum, (value,))`),
            # which gives each replica a tensor of its own, then sums those: a plain value
            # counts once per replica in sync.
            devices = extended._local_devices
            numer = PerReplica([sums[0]] * len(devices), devices=devices)
        else:
            numer = sums[0]
        if op == ReduceOp.SUM:
            reduced = extended.reduce_to(op, numer, destinations=extended._host_device)
            return extended._local_results(reduced)[0]
        counts = [
            np.asarray(math.prod(backend_for(c).shape(c)[a] for a in axes), dtype=np.int64)
            for c in components
        ]
        if isinstance(value, DistributedValues):
            denom: Any = PerReplica(counts, devices=value._devices)
            numer_total, denom_total = extended.batch_reduce_to(
                ReduceOp.SUM, [(numer, extended._host_device), (denom, extended._host_device)]
            )
        else:
            # A plain value is the same on every replica: its mean is its own mean.
            numer_total, denom_total = numer, counts[0]
        numer_total = extended._local_results(numer_total)[0]
        count = int(np.asarray(extended._local_results(denom_total)[0]))
        return backend_for(numer_total).divide(numer_total, count)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate the replicas' values along `axis` on this worker's host.

        Sizes may differ along `axis` only. Cross-replica context only; in a replica use
        `get_replica_context().all_gather()`.
        """
        frame = context.current_frame()
        if frame is not None and frame.replica_context is not None:
            raise RuntimeError(GATHER_REQUIRES_CROSS_REPLICA)
        context.require_cross_replica(self)
        validate.fits_strategy(value, self, "Strategy.gather")
        extended = self._extended
        # Every leaf's axis is checked before the first leaf is gathered.
        leaves, structure = nest.flatten(value)
        parts = [_components(leaf) for leaf in leaves]
        for leaf, components in parts:
            if isinstance(leaf, DistributedValues):
                # (A plain value comes back as it is, whatever its rank: TF.)
                _check_axes(axis, components, "Strategy.gather", False)

        def gather_leaf(x: Any) -> Any:
            if isinstance(x, DistributedVariable):
                x = PerReplica([c._value for c in x.values], devices=x._devices)
            gathered = extended._gather_to(x, extended._host_device, int(axis), None)
            return extended._local_results(gathered)[0]

        return nest.unflatten(structure, [gather_leaf(leaf) for leaf, _ in parts])

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of `value` on this worker's replicas, as a tuple."""
        return self._extended._local_results(value)

    def experimental_distribute_values_from_function(self, value_fn: Callable[..., Any]) -> Any:
        """Call `value_fn(ValueContext)` once per replica and make a `PerReplica` of the results.

        Args:
            value_fn: takes a `crossdevice.experimental.ValueContext` (replica id and
                count) and returns that replica's value.
        """
        return self._extended._distribute_values_from_function(value_fn)

    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> Any:
        """Split each global batch of `dataset` across the replicas.

        Args:
            dataset: any iterable of global batches (nests of arrays or tensors).
            options: a `crossdevice.InputOptions`.

        Returns:
            An iterable of per-replica batches (`PerReplica` leaves).
        """
        workers, index = self._extended._input_workers()
        return DistributedDataset(
            dataset,
            devices=self._extended._local_devices,
            num_workers=workers,
            worker_index=index,
            options=options,
        )

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[..., Any], options: Any = None
    ) -> Any:
        """Call `dataset_fn(InputContext)` once per input pipeline.

        Each replica takes the next element of its worker's pipeline each step.
        """
        workers, index = self._extended._input_workers()
        return DistributedDatasetsFromFunction(
            dataset_fn,
            devices=self._extended._local_devices,
            num_workers=workers,
            worker_index=index,
            num_replicas_in_sync=self.num_replicas_in_sync,
            options=options,
        )

    def __repr__(self) -> str:
        return f"<crossdevice.{type(self).__name__} devices={list(self._extended.worker_devices)}>"


def _components(leaf: Any) -> tuple[Any, tuple[Any, ...]]:
    """`(leaf, its components as arrays)`; a distributed variable becomes a PerReplica."""
    if isinstance(leaf, DistributedVariable):
        leaf = PerReplica([c._value for c in leaf.values], devices=leaf._devices)
    components = leaf.values if isinstance(leaf, DistributedValues) else (leaf,)
    return leaf, tuple(backend_for(c).asarray(c) for c in components)


def _check_axes(
    axis: Any, components: tuple[Any, ...], what: str, several: bool
) -> tuple[int, ...]:
    """`validate.axes` against every component's rank (replicas' ranks may differ)."""
    checked: tuple[int, ...] = ()
    for c in components:
        checked = validate.axes(axis, len(backend_for(c).shape(c)), what, several=several)
    return checked


def _variable_creator(frame: context.Frame, *args: Any, **kwargs: Any) -> Any:
    strategy = frame.strategy
    extended = strategy.extended
    if not extended._is_default and (
        extended._runs_in_default_scope or context.default_scope_open()
    ):
        # TF `testScopeMostlyNoOp`: the default scope's variable creator refuses them.
        raise RuntimeError(
            f"Mixing different crossdevice.Strategy objects: {strategy!r} is not the default "
            "strategy, whose scope (`with crossdevice.get_strategy().scope()`) is open around "
            "this one; create the variable outside the default strategy's scope"
        )
    return extended._create_variable(frame, *args, **kwargs)


set_variable_creator(_variable_creator)
