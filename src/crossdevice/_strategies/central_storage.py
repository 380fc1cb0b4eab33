"""`CentralStorageStrategy`: variables on one parameter device, compute on many."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, final

from crossdevice._core import context, nest
from crossdevice._core.devices import canonicalize, check_device_exists, device_scope
from crossdevice._core.options import CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._strategies.base import Strategy, StrategyExtended
from crossdevice._strategies.replicated import ReplicatedExtended, canonical_devices
from crossdevice._strategies.variable_creation import create_in_replica_context
from crossdevice._values.distributed_variables import AggregatingVariable
from crossdevice._values.values import Mirrored, PerReplica
from crossdevice._values.variables import Variable, as_aggregation, as_synchronization

__all__ = ["CentralStorageStrategy"]


@final
class _CentralStorageExtended(ReplicatedExtended):
    _between_graph = True  # TF's ParameterServerStrategyExtended (even on one machine)
    _reads_distributed_only = False  # TF's `read_var`: any variable (`identity`)

    def __init__(
        self,
        container_strategy: Strategy,
        devices: tuple[str, ...],
        parameter_device: str,
        cross_device_ops: Any,
    ) -> None:
        super().__init__(container_strategy, devices, cross_device_ops)
        self._parameter_device = parameter_device

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The one device holding every variable."""
        return (self._parameter_device,)

    def _create_variable(
        self,
        frame: context.Frame,
        initial_value: Any = None,
        trainable: bool | None = None,
        name: str | None = None,
        dtype: Any = None,
        synchronization: Any = "AUTO",
        aggregation: Any = "NONE",
        *,
        device: str | None = None,
    ) -> Any:
        del device
        if frame.replica_context is not None and len(self._devices) > 1:
            # Created inside strategy.run: replica 0 creates, the others reuse (TF).
            return create_in_replica_context(
                frame, initial_value, trainable, name, dtype, synchronization, aggregation
            )
        sync = as_synchronization(synchronization)
        agg = as_aggregation(aggregation)
        variable = type.__call__(
            Variable,
            initial_value,
            trainable,
            name,
            dtype,
            sync,
            agg,
            device=self._parameter_device,
        )
        variable._distribute_strategy = self._container_strategy_ref
        if len(self._devices) == 1:
            return variable
        return AggregatingVariable(self._container_strategy_ref, [variable], agg, sync)

    def _update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group: bool,
    ) -> Any:
        def check(x: Any) -> Any:
            if isinstance(x, PerReplica):
                raise ValueError(
                    "You cannot update variable with a PerReplica object, please use "
                    "`strategy.extended.reduce_to` (or `batch_reduce_to`) to combine the "
                    f"per-replica values first; got {x!r}"
                )
            if isinstance(x, Mirrored):
                return x._get_on_device_or_primary()
            return x

        args, kwargs = nest.map_structure(check, (args, kwargs))
        target = var._primary if isinstance(var, AggregatingVariable) else var
        if not isinstance(target, Variable):
            raise ValueError(
                f"extended.update expects a variable created in this strategy's scope, got {var!r}"
            )
        update = context.Frame(self._container_strategy_ref, None, None, 0)
        with context.entered(update), device_scope(self._parameter_device):
            result = fn(target, *args, **kwargs)
        if result is target:
            result = var
        return result if group else (result,)

    def _non_slot_devices(self, var_list: list[Any]) -> Any:
        # TF's ParameterServerStrategyExtended: the variable whose name sorts first.
        return StrategyExtended._non_slot_devices(self, var_list)

    def _update_non_slot(
        self,
        colocate_with: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group: bool,
    ) -> Any:
        # TF: one call, not one per replica (ReplicatedExtended's), on the parameter device.
        return StrategyExtended._update_non_slot(self, colocate_with, fn, args, kwargs, group)

    def _non_slot_device(self) -> str:
        return self._parameter_device

    def _reduce_to(
        self, op: ReduceOp, value: Any, destinations: Any, options: CommunicationOptions | None
    ) -> Any:
        return super()._reduce_to(op, value, destinations, options)


@final
class CentralStorageStrategy(Strategy):
    """Variables on one parameter device, replicas on several (TF's CentralStorageStrategy).

    Replica-context variable updates with an aggregation are combined (a `merge_call`
    reduces the replicas' values onto the parameter device) and applied once.

    Args:
        compute_devices: the replica devices; None means all GPUs, else `["CPU:0"]`.
        parameter_device: where variables live; None means the compute device if there is
            one, else `CPU:0`.
    """

    def __init__(
        self, compute_devices: Sequence[Any] | None = None, parameter_device: str | None = None
    ) -> None:
        from crossdevice._core.devices import list_logical_devices

        if not compute_devices:
            gpus = list_logical_devices("GPU")
            compute_devices = [d.name for d in gpus] or ["CPU:0"]
        devices = canonical_devices(compute_devices, "compute_devices")
        if parameter_device is None:
            parameter_device = devices[0] if len(devices) == 1 else "CPU:0"
        parameter = canonicalize(parameter_device)
        check_device_exists(parameter)
        from crossdevice._cross_device import ReductionToOneDevice

        super().__init__(
            _CentralStorageExtended(
                self, devices, parameter, ReductionToOneDevice(reduce_to_device=parameter)
            )
        )
