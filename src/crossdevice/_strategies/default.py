"""The default strategy: what is current outside any `strategy.scope()`.

One replica, no distribution: `run` calls the function directly in the default replica
context (replica 0), reductions return their value, `update` calls the function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, final

from crossdevice._core import context
from crossdevice._core.devices import canonicalize
from crossdevice._input.input_context import ValueContext
from crossdevice._strategies.base import SingleReplicaExtended, Strategy
from crossdevice._values.variables import Variable

__all__ = ["default_strategy"]


@final
class _DefaultExtended(SingleReplicaExtended):
    _is_default = True

    @property
    def _local_devices(self) -> tuple[str, ...]:
        return (canonicalize("CPU:0"),)

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The default strategy has no worker devices (TF raises RuntimeError too)."""
        raise RuntimeError(
            "worker_devices() method unsupported by default tf.distribute.Strategy; use a "
            "concrete strategy such as MirroredStrategy"
        )

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The default strategy has no parameter devices (TF raises RuntimeError too)."""
        raise RuntimeError(
            "parameter_devices() method unsupported by default tf.distribute.Strategy; use a "
            "concrete strategy such as MirroredStrategy"
        )

    def _call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        from crossdevice._strategies.context import get_replica_context

        with context.entered(context.Frame(self._container_strategy_ref, get_replica_context(), 0)):
            return fn(*args, **kwargs)

    def _update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group: bool,
    ) -> Any:
        result = fn(var, *args, **kwargs)
        return result if group else self._local_results(result)

    def _create_variable(self, frame: context.Frame, *args: Any, **kwargs: Any) -> Any:
        return type.__call__(Variable, *args, **kwargs)

    def _distribute_values_from_function(self, value_fn: Callable[..., Any]) -> Any:
        return value_fn(ValueContext())


@final
class _DefaultStrategy(Strategy):
    """The strategy in effect outside any scope (a singleton)."""

    def __init__(self) -> None:
        super().__init__(_DefaultExtended(self))

    def __repr__(self) -> str:
        return "<crossdevice default strategy>"


_SINGLETON: list[_DefaultStrategy] = []


def default_strategy() -> Strategy:
    """The default strategy singleton."""
    if not _SINGLETON:
        _SINGLETON.append(_DefaultStrategy())
    return _SINGLETON[0]
