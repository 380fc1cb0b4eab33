"""`non_slot_devices` and `update_non_slot`: TF 1.x's non-slot variables, in TF 2's API.

Part of `StrategyExtended` (a base class of it): the public methods validate and call a
hook; each strategy gives TF's answer (`_non_slot_devices`, `_update_non_slot`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from crossdevice._core import context, nest
from crossdevice._core.devices import device_scope

__all__ = ["NonSlotMethods"]


class NonSlotMethods:
    """`StrategyExtended`'s non-slot methods; the default hooks are the one-device rules."""

    _container_strategy_ref: Any

    @property
    def _local_devices(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _local_results(self, value: Any) -> tuple[Any, ...]:
        raise NotImplementedError

    def non_slot_devices(self, var_list: Sequence[Any]) -> Any:
        """Where variables that belong to no one variable live (TF 1.x's non-slot variables).

        Args:
            var_list: the variables being optimized (the default and CentralStorage
                strategies pick one of them).

        Returns:
            What `update_non_slot` takes as `colocate_with`, as TF gives it: this
            strategy's devices (Mirrored, MultiWorkerMirrored: a tuple), its one device
            (OneDevice: a 1-tuple), or the variable of `var_list` whose name sorts first
            (the default strategy, CentralStorage).

        Example:
            >>> import crossdevice
            >>> s = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> s.extended.update_non_slot(s.extended.non_slot_devices([]), lambda: 5)
            5
        """
        return self._non_slot_devices(list(var_list))

    def update_non_slot(
        self,
        colocate_with: Any,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Run `fn(*args, **kwargs)` on each device of `colocate_with` (cross-replica context).

        Each call runs in an update context on its device, as `update` runs its `fn`;
        per-replica arguments are split across the devices.

        Args:
            colocate_with: what `non_slot_devices` returned.
            fn: the function to run.
            args: positional arguments (a list or tuple).
            kwargs: keyword arguments.
            group: False returns a tuple of per-device results for each output.

        Returns:
            `fn`'s results regrouped: one value where every device returned the same
            object, else a `Mirrored`.
        """
        if not isinstance(args, list | tuple):
            raise ValueError(
                f"update_non_slot args must be a list or tuple, got {type(args).__name__}"
            )
        context.require_cross_replica(self._container_strategy_ref)
        with self._container_strategy_ref.scope():
            return self._update_non_slot(colocate_with, fn, tuple(args), dict(kwargs or {}), group)

    def _non_slot_devices(self, var_list: list[Any]) -> Any:
        """The default strategy's and CentralStorage's rule (TF): the first by name."""
        if not var_list:
            raise ValueError(
                f"{type(self._container_strategy_ref).__name__}.extended.non_slot_devices "
                "picks one of the variables of var_list, got an empty list; pass the "
                "variables being optimized"
            )
        return min(var_list, key=lambda v: v.name)

    def _update_non_slot(
        self,
        colocate_with: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group: bool,
    ) -> Any:
        """One call of `fn`, in an update context on `_non_slot_device` (TF's one-call rule)."""
        del colocate_with
        update = context.Frame(self._container_strategy_ref, None, None, 0)
        with context.entered(update), device_scope(self._non_slot_device()):
            result = fn(*args, **kwargs)
        return result if group else nest.map_structure(self._local_results, result)

    def _non_slot_device(self) -> str:
        """Where the one call of `_update_non_slot` runs: the first replica device."""
        return self._local_devices[0]
