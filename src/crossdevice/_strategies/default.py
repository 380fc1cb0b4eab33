"""The default strategy: what is current outside any `strategy.scope()`.

One replica, no distribution: `run` calls the function directly in a replica context
(replica 0), reductions return their value, `update` calls the function.

As in TF (`distribute_lib._DefaultDistributionContext`), the default strategy's `scope()`
pushes no cross-replica context: inside it the thread stays in the default replica
context, so `get_replica_context()` and its `all_reduce`, `all_gather` and `merge_call`
work there, and `run` gives `fn` a `ReplicaContext(strategy, 0)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, final

from crossdevice._core import context
from crossdevice._core.devices import canonicalize
from crossdevice._input.input_context import ValueContext
from crossdevice._strategies.base import SingleReplicaExtended, Strategy, _Scope
from crossdevice._strategies.replica import ReplicaContext
from crossdevice._values.variables import Variable

__all__ = ["default_strategy"]


@final
class _DefaultExtended(SingleReplicaExtended):
    _is_default = True

    def __init__(self, container_strategy: Strategy) -> None:
        super().__init__(container_strategy)
        # TF `_DefaultDistributionExtended._call_for_each_replica`: fn runs under
        # `ReplicaContext(strategy, replica_id_in_sync_group=0)`.
        self._replica_frame = context.Frame(
            container_strategy, ReplicaContext(container_strategy, 0), 0
        )

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
        with context.entered(self._replica_frame):
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

    def _update_non_slot(
        self,
        colocate_with: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group: bool,
    ) -> Any:
        del colocate_with  # as `_update`: the plain call
        result = fn(*args, **kwargs)
        return result if group else self._local_results(result)

    def _create_variable(self, frame: context.Frame, *args: Any, **kwargs: Any) -> Any:
        return type.__call__(Variable, *args, **kwargs)

    def _distribute_values_from_function(self, value_fn: Callable[..., Any]) -> Any:
        return value_fn(ValueContext())


@final
class _DefaultScope(_Scope):
    """`with default_strategy.scope():` stays in the default replica context (TF).

    Entering it inside another strategy's scope or replica is TF's RuntimeError. Another
    strategy's scope may be entered inside it, but creating a variable there (in that
    scope, or in a `run` started there) is TF's "Mixing different ... Strategy objects".
    """

    def __enter__(self) -> Strategy:
        frame = context.current_frame()
        if frame is not None and frame.strategy is not self._strategy:
            raise RuntimeError(
                "Must not nest tf.distribute.Strategy scopes: the default strategy's scope "
                "was entered inside another strategy's scope or replica; leave that first"
            )
        context.enter_default_scope(True)
        return self._strategy

    def __exit__(self, *exc: object) -> None:
        context.enter_default_scope(False)


@final
class _DefaultStrategy(Strategy):
    """The strategy in effect outside any scope (a singleton)."""

    def __init__(self) -> None:
        super().__init__(_DefaultExtended(self))

    def scope(self) -> _Scope:
        """A no-op context: the default strategy is current in its default replica context."""
        return _DefaultScope(self)

    def __repr__(self) -> str:
        return "<crossdevice default strategy>"


_SINGLETON: list[_DefaultStrategy] = []


def default_strategy() -> Strategy:
    """The default strategy singleton."""
    if not _SINGLETON:
        _SINGLETON.append(_DefaultStrategy())
    return _SINGLETON[0]
