"""`StrategyExtended`: the lower-level strategy API, and its hooks' defaults.

Template methods (`reduce_to`, `batch_reduce_to`, `update`) validate their arguments and
context, then call a hook the concrete strategy implements (`_reduce_to`,
`_batch_reduce_to`, `_update`, `_gather_to`, `_create_variable`, ...). Replica-context
collectives default to TF's path, one batched `merge_call`, checked at the rendezvous:
every replica must call the same collective with the same op, structure and leaves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from crossdevice._comm.protocol import Done, Pending, Then
from crossdevice._core import context, nest, validate
from crossdevice._core.devices import DeviceSpec, canonicalize, device_scope
from crossdevice._core.errors import ArgumentAssertionError
from crossdevice._core.options import CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op
from crossdevice._input.input_context import ValueContext
from crossdevice._replica.cuda_streams import cuda_device
from crossdevice._strategies.leaves import host_all_reduce, leaf_call, on_host, placed
from crossdevice._strategies.non_slot import NonSlotMethods
from crossdevice._strategies.roles import WorkerRoles
from crossdevice._strategies.sections import CrossReplicaSections
from crossdevice._strategies.variable_methods import VariableMethods
from crossdevice._sync.call import CallSignature
from crossdevice._values.regroup import regroup, select_replica
from crossdevice._values.values import DistributedValues, PerReplica


class ContainerStrategy(Protocol):
    """What a `StrategyExtended` uses of its strategy (`Strategy` is one).

    A protocol, so that this module needs no import of `base` (which imports this one).
    """

    @property
    def extended(self) -> StrategyExtended:
        """The strategy's `StrategyExtended`."""

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """The strategy's cross-replica scope."""


__all__ = ["ContainerStrategy", "SingleReplicaExtended", "StrategyExtended"]


class StrategyExtended(VariableMethods, WorkerRoles, NonSlotMethods):
    """Additional, lower-level strategy API (`tf.distribute.StrategyExtended`).

    Reached as `strategy.extended`. Concrete strategies implement the `_`-hooks.
    """

    _is_default = False

    def __init__(self, container_strategy: ContainerStrategy) -> None:
        self._container_strategy_ref = container_strategy
        #: Told where cross-replica code runs (`sections`), for mirrored torch modules.
        self._sections = CrossReplicaSections()
        # Runs of this strategy started inside the default strategy's scope (TF refuses
        # their variables: `base._variable_creator`).
        self._runs_in_default_scope = 0

    def _on_this_worker(self, destinations: Any) -> Any:
        """A device string with the fields it leaves out taken from this worker's host.

        `"CPU:0"` is this worker's CPU, as TF's `device_util.canonicalize` makes it from
        the worker's own device: under `MultiWorkerMirroredStrategy` it read as
        `/job:localhost/...` and was refused, where ported TF code runs (the bug hunt of
        session 53). One process: the same as before (its host is `/job:localhost`).
        """
        if isinstance(destinations, str) and destinations.strip():
            return canonicalize(destinations, default=self._host_device)
        return destinations

    def _check_destinations_are_local(self, destinations: Any) -> None:
        """A device string must name a device of this worker: results land here."""
        if not isinstance(destinations, str):
            return
        spec = DeviceSpec.from_string(canonicalize(destinations))
        host = DeviceSpec.from_string(self._host_device)
        if (spec.job, spec.task) != (host.job, host.task):
            raise ValueError(
                f"destinations {destinations!r} names job {spec.job!r} task {spec.task}, but "
                f"this worker is job {host.job!r} task {host.task}: reduce_to puts its "
                "results on this worker's devices; pass one of them (e.g. "
                f"{self._host_device!r}) or a distributed value"
            )

    def __repr__(self) -> str:
        strategy = type(self._container_strategy_ref).__name__.lstrip("_")
        return f"<crossdevice.{strategy}.extended devices={list(self._local_devices)}>"

    # --- facts a concrete strategy provides ------------------------------------------------
    @property
    def _local_devices(self) -> tuple[str, ...]:
        raise NotImplementedError

    @property
    def _num_replicas_in_sync(self) -> int:
        return len(self._local_devices)

    @property
    def _replica_id_offset(self) -> int:
        """Global id of this worker's first replica (0 on one worker)."""
        return 0

    @property
    def _host_device(self) -> str:
        return canonicalize("CPU:0")

    def _replica_devices(self, replica_id: int) -> tuple[str, ...]:
        return (self._local_devices[replica_id - self._replica_id_offset],)

    # --- replica execution and lifecycle (ours) ----------------------------------------------
    @property
    def replica_execution(self) -> str:
        """How `run` executes this strategy's replicas: "threads", "cooperative" or "auto".

        One replica runs on the caller's thread ("threads"); MultiWorkerMirroredStrategy
        and GPU replicas always use threads; in-process CPU strategies follow
        `crossdevice.config.set_replica_execution`.
        """
        return self._replica_execution()

    def replica_execution_choices(self) -> dict[str, str]:
        """Under "auto": the mode chosen, once, for each step function run so far.

        Example:
            >>> import crossdevice
            >>> crossdevice.MirroredStrategy(["CPU:0"]).extended.replica_execution_choices()
            {}
        """
        return self._replica_execution_choices()

    def _replica_execution(self) -> str:
        return "threads"

    def _replica_execution_choices(self) -> dict[str, str]:
        return {}

    def _close(self) -> None:
        """End the replica threads (strategies without any have nothing to do)."""

    # --- public properties -----------------------------------------------------------------
    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The devices this worker runs replicas on, in replica order."""
        return self._local_devices

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices variables are placed on."""
        return self._local_devices

    @property
    def experimental_require_static_shapes(self) -> bool:
        """Whether static shapes are required (False: eager values have real shapes)."""
        return False

    # --- template methods ------------------------------------------------------------------
    def reduce_to(
        self,
        reduce_op: ReduceOp | str,
        value: Any,
        destinations: Any,
        options: CommunicationOptions | None = None,
    ) -> Any:
        """Combine `value` across replicas and put the result on `destinations`.

        Args:
            reduce_op: `ReduceOp.SUM`/`MEAN` or `"sum"`/`"mean"`.
            value: a distributed value, a plain array, or a nest of them.
            destinations: a device string, a `DistributedValues`, or a variable (whose
                devices are used; the variable is not updated).
            options: a `CommunicationOptions`.

        Returns:
            A `Mirrored` value on the destinations (the plain value for one device).
        """
        context.require_cross_replica(self._container_strategy_ref)
        if isinstance(destinations, list | tuple):
            raise ArgumentAssertionError(
                "destinations can not be a list or tuple; pass a device string, a "
                f"DistributedValues or a variable, got {destinations!r}"
            )
        op = as_reduce_op(reduce_op)
        validate.reducible(value, "StrategyExtended.reduce_to")
        destinations = self._on_this_worker(destinations)
        self._check_destinations_are_local(destinations)
        validate.fits_strategy(value, self._container_strategy_ref, "StrategyExtended.reduce_to")
        return self._reduce_to(op, value, destinations, _check_options(options))

    def batch_reduce_to(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Sequence[tuple[Any, Any]],
        options: CommunicationOptions | None = None,
    ) -> list[Any]:
        """Reduce several `(value, destinations)` pairs at once; faster than one at a time.

        Args:
            reduce_op: `ReduceOp.SUM`/`MEAN` or `"sum"`/`"mean"`.
            value_destination_pairs: a sequence of `(value, destinations)` pairs.
            options: a `CommunicationOptions`; overrides the strategy's defaults.

        Returns:
            A list of reduced values, one per pair.

        Example (the TF docs' example; `v` is a `MirroredVariable` on two devices)::

            def merge_fn(strategy, value, var):
                reduced = strategy.extended.batch_reduce_to("sum", [(value, var)])[0]
                strategy.extended.update(var, lambda var, value: var.assign(value),
                                         args=(reduced,))
        """
        context.require_cross_replica(self._container_strategy_ref)
        op = as_reduce_op(reduce_op)
        pairs = [(v, self._on_this_worker(d)) for v, d in _check_pairs(value_destination_pairs)]
        values = [v for v, _ in pairs]
        for _, destinations in pairs:
            self._check_destinations_are_local(destinations)
        validate.reducible(values, "StrategyExtended.batch_reduce_to")
        validate.fits_strategy(
            values, self._container_strategy_ref, "StrategyExtended.batch_reduce_to"
        )
        return self._batch_reduce_to(op, pairs, _check_options(options))

    def update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Run `fn(component, *args, **kwargs)` on each component of `var`, on its device.

        In a replica context this goes through `merge_call`, so per-replica arguments
        reach the matching component.

        Args:
            var: a variable created in this strategy's scope.
            fn: the update function.
            args: positional arguments; distributed values are split per component.
            kwargs: keyword arguments, likewise.
            group: False returns a tuple of per-component results for each output.

        Returns:
            The updated variable or `fn`'s results regrouped.
        """
        if not isinstance(args, list | tuple):
            raise ValueError(f"update args must be a list or tuple, got {type(args).__name__}")
        kwargs = dict(kwargs or {})
        frame = context.current_frame()
        replica_context = frame.replica_context if frame is not None else None
        if (
            replica_context is not None
            and frame is not None
            and (frame.strategy is self._container_strategy_ref)
        ):

            def merge_fn(strategy: ContainerStrategy, var: Any, *args: Any, **kwargs: Any) -> Any:
                return strategy.extended.update(var, fn, args, kwargs, group)

            return replica_context.merge_call(merge_fn, args=(var, *args), kwargs=kwargs)
        context.require_cross_replica(self._container_strategy_ref)
        with self._container_strategy_ref.scope():
            return self._update(var, fn, tuple(args), kwargs, group)

    # --- hooks -----------------------------------------------------------------------------
    def _call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        raise NotImplementedError

    def _reduce_to(
        self, op: ReduceOp, value: Any, destinations: Any, options: CommunicationOptions | None
    ) -> Any:
        raise NotImplementedError

    def _batch_reduce_to(
        self, op: ReduceOp, pairs: list[tuple[Any, Any]], options: CommunicationOptions | None
    ) -> list[Any]:
        return [self._reduce_to(op, v, d, options) for v, d in pairs]

    def _update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group: bool,
    ) -> Any:
        raise NotImplementedError

    def _gather_to(
        self, value: Any, destinations: Any, axis: int, options: CommunicationOptions | None
    ) -> Any:
        raise NotImplementedError

    def _create_variable(self, frame: context.Frame, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _merge_call(
        self,
        replica_id: int,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        always_wrap: bool,
    ) -> Any:
        """Single-replica merge_call: run `merge_fn` in cross-replica context."""
        del replica_id
        strategy = self._container_strategy_ref
        if always_wrap:
            args, kwargs = regroup([(args, kwargs)], PerReplica, True, self._local_devices)
        with context.entered(context.Frame(strategy)):
            return merge_fn(strategy, *args, **kwargs)

    def _merge_call_checked(
        self,
        replica_id: int,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...],
        call: CallSignature,
    ) -> Any:
        """`_merge_call(..., always_wrap=True)` for a collective every replica makes alike.

        `call` is what the replicas must agree on (kind, op, structure, leaves) and what
        error messages show. One replica has nobody to disagree with; strategies with
        several override this to compare at the rendezvous.
        """
        del call
        return self._merge_call(replica_id, merge_fn, args, {}, always_wrap=True)

    def _replica_all_reduce(
        self, replica_id: int, op: ReduceOp, value: Any, options: CommunicationOptions | None
    ) -> Any:
        """All-reduce through one batched `merge_call` (TF's path)."""

        def merge_fn(strategy: ContainerStrategy, *per_replica: Any) -> Any:
            extended = strategy.extended
            host = [on_host(v) for v in per_replica] if self._host_leaves_stay() else []
            if not any(host):
                return extended.batch_reduce_to(op, [(v, v) for v in per_replica], options)
            on_devices = [(v, v) for v, h in zip(per_replica, host, strict=True) if not h]
            reduced = iter(extended.batch_reduce_to(op, on_devices, options) if on_devices else [])
            return [
                host_all_reduce(op, v) if h else next(reduced)
                for v, h in zip(per_replica, host, strict=True)
            ]

        return self._merge_leaves(replica_id, value, merge_fn, "all_reduce", op.name, None)

    def _replica_all_reduce_shared(
        self, replica_id: int, op: ReduceOp, tensors: list[Any]
    ) -> tuple[list[Any], bool]:
        """All-reduce `tensors`; `(results, shared)`.

        `shared`: the results are one set of tensors every local replica received, which
        no holder may change in place (a torch layer that stores gradients once uses
        them so); otherwise each replica's own (the default, `_replica_all_reduce`).
        """
        return list(self._replica_all_reduce(replica_id, op, tensors, None)), False

    def _replica_all_reduce_async(
        self, replica_id: int, op: ReduceOp, value: Any, options: CommunicationOptions | None
    ) -> Pending:
        """`_replica_all_reduce` issued now, its result on `wait()` (bitwise the same).

        Here it completes at once: the replicas of one process reduce in the rendezvous
        round they meet in, with nothing to overlap. Strategies whose reductions cross
        processes override it to leave the collective in flight.
        """
        return Done(self._replica_all_reduce(replica_id, op, value, options))

    def _host_leaves_stay(self) -> bool:
        """Whether host leaves of a replica all-reduce are reduced on the host.

        On GPU replicas of one worker a host value (a Python number, a NumPy array, a
        CPU tensor: a loss count, a metric, a flag) is summed in replica order on the
        host and comes back as a host value. TF would turn it into a tensor on each GPU;
        here that would cost an upload per replica and a device-to-host sync wherever
        the step reads the result (`if count == 0`), so host in gives host out. Across
        workers the value must travel, so the cross-device ops take it.
        """
        stay: bool | None = self.__dict__.get("_host_leaves_stay_cached")
        if stay is None:  # the devices never change: decided once
            devices = self._local_devices
            stay = len(devices) == self._num_replicas_in_sync and any(
                DeviceSpec.from_string(d).device_type == "GPU" for d in devices
            )
            self.__dict__["_host_leaves_stay_cached"] = stay
        return stay

    def _replica_all_gather(
        self, replica_id: int, value: Any, axis: int, options: CommunicationOptions | None
    ) -> Any:
        """All-gather through one `merge_call`."""

        def merge_fn(strategy: ContainerStrategy, *per_replica: Any) -> Any:
            return [strategy.extended._gather_to(v, v, axis, options) for v in per_replica]

        return self._merge_leaves(replica_id, value, merge_fn, "all_gather", f"axis={axis}", axis)

    def _merge_leaves(
        self,
        replica_id: int,
        value: Any,
        merge_fn: Callable[..., list[Any]],
        kind: str,
        argument: str,
        axis: int | None,
    ) -> Any:
        """Run `merge_fn(strategy, *per_replica_leaves)` in one merge_call over a nest.

        Each replica gets its component of every result, in the nest's shape. The
        replicas must agree on `kind`, `argument` (the reduce op or the axis), the nest's
        structure and each leaf's dtype and shape (except along a gather's `axis`).
        """
        leaves, structure = nest.flatten(value)
        if not leaves:
            return value
        arrays, call = leaf_call(leaves, structure, kind, argument, axis)
        merged = self._merge_call_checked(replica_id, merge_fn, arrays, call)
        return nest.unflatten(structure, list(merged))

    def _merge_leaves_later(
        self,
        replica_id: int,
        value: Any,
        issue_fn: Callable[..., Pending],
        kind: str,
        argument: str,
    ) -> Pending:
        """`_merge_leaves` of a collective left in flight: `wait()` gives the nest.

        `issue_fn(strategy, *per_replica_leaves)` runs once, in the same merge_call (the
        same checks), and returns a pending collective whose `wait()` gives what
        `_merge_leaves`'s `merge_fn` returns. Each replica waits on it for its own
        component of every result; several replicas' waits are serialised (`Then`).
        """
        leaves, structure = nest.flatten(value)
        if not leaves:
            return Done(value)
        arrays, call = leaf_call(leaves, structure, kind, argument, None)
        n = len(self._local_devices)

        def merge_fn(strategy: ContainerStrategy, *per_replica: Any) -> Any:
            pending = issue_fn(strategy, *per_replica)
            if n == 1:  # a single replica's merge_call returns what merge_fn does
                return pending
            # One wait per replica, each picking that replica's components.
            shared = Then([pending], lambda results: results)
            return PerReplica(
                [Then([shared], lambda r, i=i: select_replica(i, r)) for i in range(n)],
                self._local_devices,
            )

        mine: Pending = self._merge_call_checked(replica_id, merge_fn, arrays, call)
        return Then([mine], lambda merged: nest.unflatten(structure, list(merged)))

    def _from_first_replica(self, value: Any, what: str) -> Any:
        """Global replica 0's `value` (ONLY_FIRST_REPLICA), given this worker's first.

        One process holds replica 0: it is `value`. Across workers, worker 0's
        (`_MultiWorkerExtended` broadcasts it; `what` names the call in its errors).
        """
        del what
        return value

    def _local_results(self, value: Any) -> tuple[Any, ...]:
        if isinstance(value, DistributedValues):
            return value.values
        leaves, _ = nest.flatten(value)
        if len(leaves) > 1 or (leaves and leaves[0] is not value):
            return tuple(select_replica(i, value) for i in range(len(self._local_devices)))
        return (value,)

    def _distribute_values_from_function(self, value_fn: Callable[..., Any]) -> Any:
        n = self._num_replicas_in_sync
        values = []
        for i, device in enumerate(self._local_devices):
            with device_scope(device), cuda_device(device):
                value = value_fn(ValueContext(self._replica_id_offset + i, n))
            # TF creates the values under the replica's device; ours may come from
            # anywhere, so each array is put on its replica's device (GPU replicas: a CUDA
            # tensor there; host devices keep host arrays as they are).
            values.append(nest.map_structure(lambda x, d=device: placed(x, d), value))
        return regroup(values, PerReplica, True, self._local_devices)

    def _input_workers(self) -> tuple[int, int]:
        """(number of input pipelines, this worker's index)."""
        return 1, 0


class SingleReplicaExtended(StrategyExtended):
    """Hooks shared by the one-replica strategies (default, OneDevice): nothing to combine.

    TF returns the value unchanged from `reduce_to` and gathers with one replica.
    """

    def _reduce_to(
        self, op: ReduceOp, value: Any, destinations: Any, options: CommunicationOptions | None
    ) -> Any:
        if isinstance(value, DistributedValues) and len(value.values) == 1:
            return value.values[0]
        return value

    def _gather_to(
        self, value: Any, destinations: Any, axis: int, options: CommunicationOptions | None
    ) -> Any:
        return self._reduce_to(ReduceOp.SUM, value, destinations, options)


def _check_options(options: Any) -> CommunicationOptions | None:
    if options is not None and not isinstance(options, CommunicationOptions):
        raise ValueError(
            f"options must be a crossdevice.experimental.CommunicationOptions or None, got "
            f"{options!r}"
        )
    return options


def _check_pairs(pairs: Any) -> list[tuple[Any, Any]]:
    if isinstance(pairs, DistributedValues) or not isinstance(pairs, Sequence | Iterable):
        raise ValueError(
            f"value_destination_pairs must be a list of (value, destinations) tuples, got {pairs!r}"
        )
    checked = []
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(
                "Each element of value_destination_pairs should be a tuple of size 2 "
                f"(value, destinations), got {pair!r}"
            )
        checked.append(pair)
    return checked
