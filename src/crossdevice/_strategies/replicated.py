"""The machinery shared by strategies with several local replicas (Mirrored, CentralStorage).

One `ReplicaRunner` (long-lived replica threads) per strategy, a `CrossDeviceOps` for the
reductions, and TF's reduce/update rules for distributed values.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from crossdevice._arrays.handout import hand_out, is_shared
from crossdevice._core import context, nest, validate
from crossdevice._core.devices import DeviceSpec, canonicalize, check_device_exists, device_scope
from crossdevice._core.errors import ArgumentAssertionError
from crossdevice._core.options import CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._replica.runner import ReplicaRunner
from crossdevice._strategies.base import Strategy, StrategyExtended, as_reducible_leaf
from crossdevice._strategies.replica import ReplicaContext
from crossdevice._sync.call import CallSignature
from crossdevice._values.distributed_variables import DistributedVariable
from crossdevice._values.regroup import regroup, select_replica
from crossdevice._values.values import DistributedValues, Mirrored, PerReplica
from crossdevice._values.variables import Variable

__all__ = ["ReplicatedExtended", "canonical_devices"]


#: Marks a cache not filled yet (None is a valid timeout).
_UNSET: Any = object()


def canonical_devices(devices: Sequence[Any], what: str) -> tuple[str, ...]:
    """Canonicalise a device list; duplicates, mixed jobs and unknown devices are errors."""
    if isinstance(devices, str):
        raise ValueError(f"{what} must be a list of device strings, got the string {devices!r}")
    canonical = []
    for device in devices:
        name = getattr(device, "name", device)  # LogicalDevice objects are accepted
        canonical.append(canonicalize(name))
    if len(set(canonical)) != len(canonical):
        duplicates = sorted({d for d in canonical if canonical.count(d) > 1})
        raise ArgumentAssertionError(
            f"No duplicates allowed in `{what}` argument: {list(devices)!r} repeats {duplicates}"
        )
    jobs = {DeviceSpec.from_string(d).job for d in canonical}
    if len(jobs) > 1:
        raise ValueError(
            f"{what} mixes devices of jobs {sorted(map(str, jobs))}: {canonical}; local "
            "strategies take devices of one worker (use MultiWorkerMirroredStrategy across "
            "workers)"
        )
    for device in canonical:
        check_device_exists(device)
    return tuple(canonical)


class ReplicatedExtended(StrategyExtended):
    """Base for strategies that run several local replicas on threads."""

    _reads_distributed_only = True  # TF's MirroredExtended.read_var
    _closed = False  # close() came: a runner made later is closed at once (runs raise)

    def __init__(
        self, container_strategy: Strategy, devices: tuple[str, ...], cross_device_ops: Any
    ) -> None:
        super().__init__(container_strategy)
        self._devices = devices
        self._cross_device_ops = cross_device_ops
        offset = self._replica_id_offset
        self._frames = [
            context.Frame(container_strategy, ReplicaContext(container_strategy, offset + i), i)
            for i in range(len(devices))
        ]
        self._runner: ReplicaRunner | None = None
        self._runner_lock = threading.Lock()
        self._thread_communicator: Any = None
        self._default_timeout: object = _UNSET

    @property
    def _local_devices(self) -> tuple[str, ...]:
        return self._devices

    def _communication_options(self) -> CommunicationOptions | None:
        return None

    def _get_runner(self) -> ReplicaRunner:
        runner = self._runner
        if runner is not None:
            return runner
        with self._runner_lock:
            return self._make_runner()

    def _make_runner(self) -> ReplicaRunner:
        if self._runner is None:
            # The threads hold the runner, the runner holds only a weak reference to this
            # object: a strategy nobody uses any more is collected and its threads end.
            ref = weakref.ref(self)

            def make_frame(i: int) -> context.Frame:
                extended = ref()
                if extended is None:
                    raise RuntimeError("the strategy of these replica threads was collected")
                return extended._frames[i]

            runner = ReplicaRunner(
                len(self._devices),
                make_frame,
                self._devices,
                name=type(self._container_strategy_ref).__name__,
                cooperative=self._cooperative_replicas(),
            )
            weakref.finalize(self, _close_collected, runner)
            if not _EXIT_HOOK:  # after weakref's own exit hook: so it runs before it
                _EXIT_HOOK.append(atexit.register(_EXITING.append, True))
            communicator = self._cross_device_ops._replica_communicator(
                self._devices, runner.rendezvous
            )
            if len(self._devices) > 1:
                self._thread_communicator = communicator
            self._runner = runner
            if self._closed:  # closed before its first run: that run, and any, raises
                runner.close()
        return self._runner

    def _close(self) -> None:
        with self._runner_lock:
            self._closed = True
            runner = self._runner
        if runner is not None:
            runner.close()

    def _replica_execution(self) -> str:
        return self._get_runner().mode

    def _replica_execution_choices(self) -> dict[str, str]:
        return self._get_runner().execution_choices()

    def _cooperative_replicas(self) -> bool:
        """Whether replicas may run as greenlets on the caller's thread (`set_replica_execution`).

        Only on CPU devices: every rendezvous is then in this process and every collective
        a replica waits in can be completed by its peers on the same thread.
        """
        return all(DeviceSpec.from_string(d).device_type == "CPU" for d in self._devices)

    def _replica_all_reduce(
        self, replica_id: int, op: ReduceOp, value: Any, options: CommunicationOptions | None
    ) -> Any:
        communicator = self._thread_communicator
        if communicator is None:
            return super()._replica_all_reduce(replica_id, op, value, options)
        local_id = replica_id - self._replica_id_offset
        if type(value) is np.ndarray or isinstance(value, np.generic):
            # One NumPy leaf (a loss, a flat gradient buffer): no nest to walk.
            result = communicator._all_reduce_one(
                local_id, np.asarray(value), op, self._timeout(options)
            )
            return hand_out(result, copy=True)  # one buffer for every replica
        leaves, structure = nest.flatten(value)
        if not leaves:
            return value
        # Every replica takes this path whatever its values (the communicator reduces CUDA
        # and bfloat16 tensors with torch): a per-replica choice could split the replicas
        # between two rendezvous that never meet.
        arrays = [as_reducible_leaf(x) for x in leaves]
        reduced = communicator.all_reduce(
            local_id, arrays, op, timeout=self._timeout(options), structure=_compared(structure)
        )
        # The results are views of one buffer every replica sees: NumPy shared read-only,
        # torch copied by each replica (its peers may read the buffer still).
        reduced = [hand_out(x, copy=True) for x in reduced]
        return nest.unflatten(structure, reduced)

    def _replica_all_reduce_shared(
        self, replica_id: int, op: ReduceOp, tensors: list[Any]
    ) -> tuple[list[Any], bool]:
        communicator = self._thread_communicator
        if communicator is None:
            return super()._replica_all_reduce_shared(replica_id, op, tensors)
        local_id = replica_id - self._replica_id_offset
        arrays = [as_reducible_leaf(x) for x in tensors]
        reduced = communicator.all_reduce(local_id, arrays, op, timeout=self._timeout(None))
        # No hand_out: the caller keeps the one set of results for every replica.
        return list(reduced), True

    def _replica_all_gather(
        self, replica_id: int, value: Any, axis: int, options: CommunicationOptions | None
    ) -> Any:
        communicator = self._thread_communicator
        if communicator is None:
            return super()._replica_all_gather(replica_id, value, axis, options)
        leaves, structure = nest.flatten(value)
        # Every replica takes this path whatever its values (the communicator reduces CUDA
        # and bfloat16 tensors with torch): a per-replica choice could split the replicas
        # between two rendezvous that never meet.
        arrays = [as_reducible_leaf(x) for x in leaves]
        local_id = replica_id - self._replica_id_offset
        timeout = self._timeout(options)
        compared = _compared(structure)
        gathered = [
            communicator.all_gather(local_id, x, axis, timeout=timeout, structure=compared)
            for x in arrays
        ]
        gathered = [hand_out(x, copy=True) for x in gathered]
        return nest.unflatten(structure, gathered)

    def _timeout(self, options: CommunicationOptions | None) -> float | None:
        if options is None:
            # The per-step case: the strategy's own options, fixed at construction.
            cached = self._default_timeout
            if cached is _UNSET:
                defaults = self._merged_options(None)
                cached = self._default_timeout = (
                    None if defaults is None else defaults.timeout_seconds
                )
            return cached  # type: ignore[return-value]
        merged = self._merged_options(options)
        return None if merged is None else merged.timeout_seconds

    # --- replica execution ---------------------------------------------------------------
    def _call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        n = len(self._devices)
        if (
            (args or kwargs)
            and (kwargs or not nest.plain_leaves(args))
            and any(isinstance(x, DistributedValues) for x in nest.flatten((args, kwargs))[0])
        ):
            per_replica = [(select_replica(i, args), select_replica(i, kwargs)) for i in range(n)]
        else:
            per_replica = [(args, kwargs)] * n
        results = self._get_runner().run(fn, per_replica, merge_timeout=self._merge_timeout())
        for result in results:
            validate.lazy_result(result, "the function given to strategy.run")
        if n == 1:
            return results[0]  # regroup unwraps one replica's result, as TF's does
        plain = _regroup_numpy(results, self._devices)
        if plain is not None:
            return plain
        return regroup(results, PerReplica, False, self._devices)

    def _merge_timeout(self) -> float | None:
        """How long local replicas wait at a merge: the strategy's timeout_seconds."""
        options = self._communication_options()
        return options.timeout_seconds if options is not None else None

    def _merge_call(
        self,
        replica_id: int,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        always_wrap: bool,
    ) -> Any:
        n = len(self._devices)
        if n == 1:
            # No rendezvous round, but still this runner's merge: a `run` inside
            # merge_fn must be nested, not a wait for the run lock its own run holds.
            single = super()._merge_call
            return self._get_runner().run_merge_fn(
                single, replica_id, merge_fn, args, kwargs, always_wrap
            )
        strategy = self._container_strategy_ref
        devices = self._devices

        def merge(inputs: list[Any]) -> list[Any]:
            margs = regroup([i[0] for i in inputs], PerReplica, always_wrap, devices)
            mkwargs = regroup([i[1] for i in inputs], PerReplica, always_wrap, devices)
            with context.entered(context.Frame(strategy)):
                result = merge_fn(strategy, *margs, **mkwargs)
            validate.fits_strategy(result, strategy, "the merge_fn's result", whole_worker=False)
            return [select_replica(i, result) for i in range(n)]

        local_id = replica_id - self._replica_id_offset
        return self._get_runner().merge_call(local_id, merge, (args, kwargs))

    def _merge_call_checked(
        self,
        replica_id: int,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...],
        call: CallSignature,
    ) -> Any:
        n = len(self._devices)
        if n == 1:
            return super()._merge_call_checked(replica_id, merge_fn, args, call)
        strategy = self._container_strategy_ref
        devices = self._devices

        def merge(inputs: list[Any]) -> list[Any]:
            margs = regroup(inputs, PerReplica, True, devices)
            with context.entered(context.Frame(strategy)):
                result = merge_fn(strategy, *margs)
            return [select_replica(i, result) for i in range(n)]

        local_id = replica_id - self._replica_id_offset
        return self._get_runner().merge_call(local_id, merge, args, call)

    # --- reductions ----------------------------------------------------------------------
    def _merged_options(self, options: CommunicationOptions | None) -> CommunicationOptions | None:
        defaults = self._communication_options()
        if defaults is None:
            return options
        return defaults.merge(options)

    def _reduce_to(
        self, op: ReduceOp, value: Any, destinations: Any, options: CommunicationOptions | None
    ) -> Any:
        from crossdevice._cross_device import reduce_non_distributed_value

        options = self._merged_options(options)
        n = self._num_replicas_in_sync

        def reduce_leaf(leaf: Any) -> Any:
            leaf = _readable(leaf, op)
            if isinstance(leaf, Mirrored):  # MEAN of a mirrored value is itself (TF)
                return leaf
            if not isinstance(leaf, DistributedValues):
                return reduce_non_distributed_value(op, leaf, destinations, n)
            return self._cross_device_ops.reduce(op, leaf, destinations, options)

        return nest.map_structure(reduce_leaf, value)

    def _batch_reduce_to(
        self, op: ReduceOp, pairs: list[tuple[Any, Any]], options: CommunicationOptions | None
    ) -> list[Any]:
        from crossdevice._cross_device import reduce_non_distributed_value

        options = self._merged_options(options)
        n = self._num_replicas_in_sync
        results: list[Any] = [None] * len(pairs)
        batch: list[tuple[int, Any, Any]] = []
        for index, (given, destinations) in enumerate(pairs):
            value = _readable(given, op)
            if isinstance(value, Mirrored):
                results[index] = value
            elif isinstance(value, DistributedValues):
                batch.append((index, value, destinations))
            else:
                results[index] = reduce_non_distributed_value(op, value, destinations, n)
        if batch:
            reduced = self._cross_device_ops.batch_reduce(
                op, [(v, d) for _, v, d in batch], options
            )
            for (index, _, _), result in zip(batch, reduced, strict=True):
                results[index] = result
        return results

    def _gather_to(
        self, value: Any, destinations: Any, axis: int, options: CommunicationOptions | None
    ) -> Any:
        if not isinstance(value, DistributedValues):
            return value
        return self._cross_device_ops._gather(
            value, destinations, axis, self._merged_options(options)
        )

    # --- updates -------------------------------------------------------------------------
    def _update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group: bool,
    ) -> Any:
        if not isinstance(var, DistributedVariable) or var._strategy is not (
            self._container_strategy_ref
        ):
            raise ValueError(
                "extended.update expects a variable created in this strategy's scope, got "
                f"{var!r}; create it inside `with strategy.scope():`"
            )
        components = var.values
        results = self._each_device(
            range(len(components)),
            lambda i: fn(components[i], *select_replica(i, args), **select_replica(i, kwargs)),
        )
        return self._regroup_update(results, var._devices, group)

    def _non_slot_devices(self, var_list: list[Any]) -> Any:
        del var_list
        return self._devices  # TF's MirroredStrategy: every replica device

    def _update_non_slot(
        self,
        colocate_with: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group: bool,
    ) -> Any:
        indices = self._device_indices(colocate_with)
        results = self._each_device(
            indices, lambda i: fn(*select_replica(i, args), **select_replica(i, kwargs))
        )
        return self._regroup_update(results, tuple(self._devices[i] for i in indices), group)

    def _device_indices(self, colocate_with: Any) -> list[int]:
        """The replica index of each device of `colocate_with` (`non_slot_devices`'s tuple)."""
        error = ArgumentAssertionError(
            "update_non_slot: colocate_with must be what non_slot_devices() returned, a "
            f"tuple of this strategy's devices {list(self._devices)}; got {colocate_with!r}"
        )
        if isinstance(colocate_with, str) or not isinstance(colocate_with, tuple | list):
            raise error
        names = [getattr(d, "name", d) for d in colocate_with]
        if not all(isinstance(name, str) for name in names):
            raise error
        try:
            canonical = [canonicalize(str(name)) for name in names]
        except ValueError as err:
            raise error from err
        if not canonical or any(d not in self._devices for d in canonical):
            raise error
        return [self._devices.index(d) for d in canonical]

    def _each_device(self, indices: Any, call: Callable[[int], Any]) -> list[Any]:
        """`call(i)` for each replica index, in update context `i` on that replica's device."""
        strategy = self._container_strategy_ref
        results = []
        for i in indices:
            update = context.Frame(strategy, None, None, i)
            with context.entered(update), device_scope(self._devices[i]):
                results.append(call(i))
        return results

    def _regroup_update(self, results: list[Any], devices: Any, group: bool) -> Any:
        """TF's `update_regroup`: Mirrored where devices differ; a tuple each without `group`.

        With `group`, a variable `fn` returned (`lambda v, d: v.assign_add(d)` returns the
        component) is read at once: TF's `identity` makes the Mirrored a snapshot, which
        a later assign does not change. Without `group`, TF returns the live components.
        """
        if group:
            results = [_read_variables(result) for result in results]
        regrouped = regroup(results, Mirrored, False, devices)
        if group:
            return regrouped
        return nest.map_structure(self._local_results, regrouped)


def _regroup_numpy(results: list[Any], devices: tuple[str, ...]) -> Any:
    """`regroup(results, PerReplica, False, devices)` for NumPy results.

    The per-step case (a loss, a metric, a shared all-reduce result): NumPy arrays and
    scalars are leaves and never variables, so regroup's rule for them is short; its
    general walk (leaf tests, the variable metaclass's isinstance) took about 6 us of a
    4-replica step on the dev VM. The same object from every replica stays plain (TF:
    a captured constant, what one merge_fn returned), unless it is a collective's
    result that every replica shares (`is_shared`: TF gives each replica its own
    tensor). None for anything else (and for one replica, which regroup unwraps).
    """
    if len(results) < 2:
        return None
    for result in results:
        if type(result) is not np.ndarray and not isinstance(result, np.generic):
            return None
    first = results[0]
    if all(r is first for r in results) and not is_shared(first):
        return first
    return PerReplica._from_parts(tuple(results), devices)


def _read_variables(result: Any) -> Any:
    """`result` with each variable in it replaced by a snapshot of its value."""
    if isinstance(result, Variable):
        return result.read_value()
    if type(result) is np.ndarray or result is None:  # the common cases: nothing to walk
        return result
    return nest.map_structure(lambda x: x.read_value() if isinstance(x, Variable) else x, result)


def _compared(structure: Any) -> Any:
    """What the replicas' structures are compared by: None for one bare leaf.

    One array reaches the communicator without a structure (`_all_reduce_one`), so a
    bare leaf must compare equal to that; a nest (even `[x]`) must not. A nest compares
    as TF's (`nest.Structure`): namedtuple classes by name and fields.
    """
    return None if structure.is_leaf() else nest.Structure(structure)


def _readable(value: Any, op: ReduceOp) -> Any:
    """Distributed variables as values: MirroredVariable → Mirrored, others → PerReplica."""
    from crossdevice._values.distributed_variables import AggregatingVariable, MirroredVariable

    if isinstance(value, MirroredVariable):
        if op == ReduceOp.SUM:
            raise ArgumentAssertionError(
                f"cannot SUM-reduce mirrored variable {value.name!r}: its components are "
                "identical copies, not per-replica values (TF asserts here too); use MEAN, or "
                "reduce the per-replica values that produced it"
            )
        return Mirrored([c._value for c in value.values], devices=value._devices)
    if isinstance(value, AggregatingVariable):
        return value._primary._value
    if isinstance(value, DistributedVariable):
        return PerReplica([c._value for c in value.values], devices=value._devices)
    if isinstance(value, Mirrored) and op == ReduceOp.SUM:
        raise ArgumentAssertionError(
            f"cannot SUM-reduce a Mirrored value (the same value on every replica; TF "
            f"asserts here too): {value!r}; use MEAN to get it back, or reduce the "
            "per-replica values"
        )
    return value


#: Set (True) by an exit hook registered after `weakref.finalize`'s, so it runs first.
_EXITING: list[bool] = []
_EXIT_HOOK: list[object] = []


def _close_collected(runner: ReplicaRunner) -> None:
    """Close the runner of a strategy the garbage collector took (a `weakref.finalize`).

    Without waiting, from a collection (it may run on any thread, inside any lock);
    waiting for the threads at interpreter exit, where a replica thread still ending
    races torch's static destructors (`ReplicaRunner.close`).
    """
    runner.close(wait=bool(_EXITING))
