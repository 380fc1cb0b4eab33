"""`StrategyExtended`'s methods about variables: colocation, containers, `read_var`.

Part of `StrategyExtended` (a base class of it). `read_var` follows TF: the default,
OneDevice and CentralStorage strategies read any variable (`array_ops.identity(v)`);
Mirrored and MultiWorkerMirrored read their own distributed variables only
(`MirroredExtended.read_var`), a sync-on-read one aggregated, in cross-replica context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from crossdevice._core import context
from crossdevice._values.distributed_variables import DistributedVariable, SyncOnReadVariable
from crossdevice._values.variables import Variable

__all__ = ["VariableMethods"]


class VariableMethods:
    """`colocate_vars_with`, `variable_created_in_scope`, `value_container`, `read_var`."""

    _container_strategy_ref: Any
    _is_default: bool
    #: Whether `read_var` takes only this strategy's distributed variables (TF's Mirrored).
    _reads_distributed_only = False

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Create variables inside this block on the same devices as `colocate_with_variable`.

        Raises:
            RuntimeError: not inside this strategy's `scope()` (TF's error; the default
                strategy needs none).
            ValueError: the variable was not created in this strategy's scope.
        """
        frame = context.current_frame()
        current = frame.strategy if frame is not None else None
        if not self._is_default and current is not self._container_strategy_ref:
            raise RuntimeError(
                f'Need to be inside "with strategy.scope()" for '
                f"{self._container_strategy_ref!r}"
                + ("" if current is None else f" (in the scope of {current!r})")
                + ": enter it around colocate_vars_with (`with strategy.scope(), "
                "strategy.extended.colocate_vars_with(v): ...`)"
            )
        if not self._is_default and not self.variable_created_in_scope(colocate_with_variable):
            # (TF's default strategy colocates with any variable: no check.)
            raise ValueError(
                "colocate_vars_with must only be passed a variable created in this "
                f"strategy.scope(), got {colocate_with_variable!r}"
            )
        yield

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether `v` was created while this strategy's scope was active."""
        return getattr(v, "_distribute_strategy", None) is self._container_strategy_ref

    def value_container(self, value: Any) -> Any:
        """The distributed variable `value` is a component of, else `value` itself."""
        if isinstance(value, Variable) and not isinstance(value, DistributedVariable):
            container = value._distributed_container
            if container is not None:
                return container
        return value

    def read_var(self, v: Any) -> Any:
        """The cross-replica value of variable `v`, as a new array (TF's `read_var`).

        A mirrored variable gives its value (in a replica, the replica's component); a
        sync-on-read one the aggregate of its components (SUM: their sum), which needs
        cross-replica context, and under `MultiWorkerMirroredStrategy` every worker's
        call (it reduces across workers); any other variable its value.

        Args:
            v: a variable; under Mirrored and MultiWorkerMirrored strategies, one created
                in this strategy's scope.

        Returns:
            A snapshot of the value: later assigns do not change it.

        Raises:
            ValueError: `v` is not a variable, or (Mirrored, MultiWorkerMirrored) not a
                distributed variable of this strategy.
            RuntimeError: a sync-on-read variable read in a replica context.

        Example:
            >>> import crossdevice
            >>> s = crossdevice.MirroredStrategy(["CPU:0"])
            >>> with s.scope():
            ...     v = crossdevice.Variable(2.0)
            >>> float(s.extended.read_var(v))
            2.0
        """
        ours = getattr(v, "_strategy", None) is self._container_strategy_ref
        if not isinstance(v, Variable) or (
            self._reads_distributed_only and not (isinstance(v, DistributedVariable) and ours)
        ):
            wanted = (
                "a variable created in this strategy's scope (a MirroredVariable or "
                "SyncOnReadVariable)"
                if self._reads_distributed_only
                else "a crossdevice.Variable"
            )
            raise ValueError(
                f"read_var expects {wanted}, got {v!r}; create the variable inside "
                "`with strategy.scope():`, or use the value directly if it is an array"
            )
        if isinstance(v, SyncOnReadVariable) and v._local_id() is not None:
            raise RuntimeError(
                f"read_var of SyncOnReadVariable {v.name!r} aggregates its replicas, so it "
                "needs cross-replica context (TF: 'Method requires being in cross-replica "
                "context'); call it outside strategy.run, or read the variable inside the "
                "step for the replica's own value"
            )
        return v.read_value()
