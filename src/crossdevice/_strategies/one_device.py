"""`OneDeviceStrategy`: everything on one device, through the strategy API."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, final

from crossdevice._core import context, validate
from crossdevice._core.devices import canonicalize, check_device_exists, device_scope
from crossdevice._input.input_context import ValueContext
from crossdevice._strategies.base import SingleReplicaExtended, Strategy
from crossdevice._strategies.replica import ReplicaContext
from crossdevice._values.variables import Variable

__all__ = ["OneDeviceStrategy"]


@final
class _OneDeviceExtended(SingleReplicaExtended):
    def __init__(self, container_strategy: Strategy, device: str) -> None:
        super().__init__(container_strategy)
        self._device = device
        self._frame = context.Frame(container_strategy, ReplicaContext(container_strategy, 0), 0)

    @property
    def _local_devices(self) -> tuple[str, ...]:
        return (self._device,)

    def _call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        with context.entered(self._frame), device_scope(self._device):
            return fn(*args, **kwargs)

    def _update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group: bool,
    ) -> Any:
        update = context.Frame(self._container_strategy_ref, None, None, 0)
        with context.entered(update), device_scope(self._device):
            result = fn(var, *args, **kwargs)
        return result if group else self._local_results(result)

    def _non_slot_devices(self, var_list: list[Any]) -> Any:
        del var_list
        return (self._device,)  # TF's OneDeviceStrategy

    def _create_variable(self, frame: context.Frame, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("device", self._device)
        variable = type.__call__(Variable, *args, **kwargs)
        variable._distribute_strategy = self._container_strategy_ref
        return variable

    def _distribute_values_from_function(self, value_fn: Callable[..., Any]) -> Any:
        # TF returns the plain value here, not a PerReplica (b/137795644).
        with device_scope(self._device):
            return value_fn(ValueContext())


@final
class OneDeviceStrategy(Strategy):
    """Run on one device through the strategy API (`tf.distribute.OneDeviceStrategy`).

    Useful to test code written for distribution on a single device: `run` calls the
    function directly, reductions return their value, variables are plain variables on
    the device.

    Args:
        device: the device string, e.g. `"CPU:0"` or `"GPU:0"`.

    Example:
        >>> strategy = OneDeviceStrategy("CPU:0")
        >>> strategy.run(lambda: 1.0)
        1.0
    """

    def __init__(self, device: str) -> None:
        validate.single_device(device, "OneDeviceStrategy")
        canonical = canonicalize(device)
        check_device_exists(canonical)
        super().__init__(_OneDeviceExtended(self, canonical))
