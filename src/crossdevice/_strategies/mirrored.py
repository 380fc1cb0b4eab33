"""`MirroredStrategy`: synchronous data parallelism over the devices of one machine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

from crossdevice._core import context
from crossdevice._core.devices import list_logical_devices
from crossdevice._core.reduce_op import VariableSynchronization
from crossdevice._strategies.base import Strategy
from crossdevice._strategies.replicated import ReplicatedExtended, canonical_devices
from crossdevice._strategies.variable_creation import create_in_replica_context
from crossdevice._values.distributed_variables import MirroredVariable, SyncOnReadVariable
from crossdevice._values.variables import (
    Variable,
    as_aggregation,
    as_synchronization,
    make_initial_value,
    unique_name,
)

__all__ = ["MirroredExtended", "MirroredStrategy", "create_mirrored_variable"]


def create_mirrored_variable(
    extended: ReplicatedExtended,
    frame: context.Frame,
    initial_value: Any = None,
    trainable: bool | None = None,
    name: str | None = None,
    dtype: Any = None,
    synchronization: Any = VariableSynchronization.AUTO,
    aggregation: Any = "NONE",
    *,
    device: str | None = None,
) -> Any:
    """Create one component per local device and wrap them.

    ON_WRITE/AUTO gives a MirroredVariable (reporting ON_WRITE, as TF's), ON_READ a
    SyncOnReadVariable. Replica 0's
    initial value is copied to the other components. Inside `run`, replica 0's
    arguments create one variable that every replica gets.
    """
    del device  # mirrored variables live on every replica device
    sync = as_synchronization(synchronization)
    agg = as_aggregation(aggregation)
    if sync == VariableSynchronization.NONE:
        raise ValueError(
            "NONE variable synchronization mode is not supported under MirroredStrategy: "
            f"variable {name or 'Variable'!r} was created with synchronization=NONE. Use "
            "ON_WRITE (mirrored), ON_READ (sync on read) or AUTO, or create the variable "
            "outside the strategy's scope"
        )
    if sync == VariableSynchronization.AUTO:
        sync = VariableSynchronization.ON_WRITE  # what TF's mirrored variables report
    strategy = extended._container_strategy_ref
    if frame.replica_context is not None:
        # Created inside strategy.run: replica 0 creates, the others reuse (TF).
        return create_in_replica_context(
            frame, initial_value, trainable, name, dtype, synchronization, aggregation
        )
    primary = make_initial_value(initial_value, dtype)
    base = unique_name(name)
    components = []
    for i, device in enumerate(extended._local_devices):
        component_name = base if i == 0 else f"{base}/replica_{i}"
        components.append(
            type.__call__(
                Variable,
                primary,
                trainable,
                component_name,
                None,
                sync,
                agg,
                device=device,
            )
        )
    cls = SyncOnReadVariable if sync == VariableSynchronization.ON_READ else MirroredVariable
    return cls(strategy, components, agg, sync)


@final
class MirroredExtended(ReplicatedExtended):
    """`MirroredStrategy.extended`."""

    def _create_variable(self, frame: context.Frame, *args: Any, **kwargs: Any) -> Any:
        return create_mirrored_variable(self, frame, *args, **kwargs)


def default_devices() -> list[str]:
    """All logical GPUs, else all logical CPUs (TF's `all_local_devices`)."""
    gpus = list_logical_devices("GPU")
    return [d.name for d in (gpus or list_logical_devices("CPU"))]


@final
class MirroredStrategy(Strategy):
    """Synchronous training on the devices of one machine (`tf.distribute.MirroredStrategy`).

    One replica per device, each on its own long-lived thread; variables are mirrored on
    every device and kept in sync by all-reduce.

    Args:
        devices: device strings (`["CPU:0", "CPU:1"]`, `["GPU:0", "GPU:1"]`); None or an
            empty list means all GPUs, else all logical CPU devices.
        cross_device_ops: a `CrossDeviceOps` for reductions; None picks one that can run
            on the devices.

    Example (the TF docs' `batch_reduce_to` example, ported)::

        strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
        with strategy.scope():
            v = crossdevice.Variable(0.0)

        def step_fn(var):
            def merge_fn(strategy, value, var):
                reduced = strategy.extended.batch_reduce_to("sum", [(value, var)])[0]
                strategy.extended.update(var, lambda var, value: var.assign(value),
                                         args=(reduced,))
            value = np.array(1.0, dtype=np.float32)
            crossdevice.get_replica_context().merge_call(merge_fn, args=(value, var))

        strategy.run(step_fn, args=(v,))   # v is MirroredVariable {0: 2.0, 1: 2.0}
    """

    def __init__(self, devices: Sequence[Any] | None = None, cross_device_ops: Any = None) -> None:
        if not devices:
            devices = default_devices()
        canonical = canonical_devices(devices, "devices")
        if cross_device_ops is None:
            from crossdevice._cross_device import select_cross_device_ops

            cross_device_ops = select_cross_device_ops(canonical)
        else:
            _check_cross_device_ops(cross_device_ops)
        super().__init__(MirroredExtended(self, canonical, cross_device_ops))


def _check_cross_device_ops(cross_device_ops: Any) -> None:
    from crossdevice._cross_device import CrossDeviceOps

    if not isinstance(cross_device_ops, CrossDeviceOps):
        raise ValueError(
            "cross_device_ops must be a crossdevice.CrossDeviceOps instance such as "
            f"ReductionToOneDevice() or HierarchicalCopyAllReduce(), got {cross_device_ops!r}"
        )
