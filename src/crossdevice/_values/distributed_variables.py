"""Distributed variables: `MirroredVariable`, `SyncOnReadVariable`, `AggregatingVariable`.

Each holds one plain `Variable` per local replica (`AggregatingVariable`: one on the
parameter device) and applies TF's synchronisation and aggregation rules (values_util.py).
The strategy they belong to provides `extended.update`, `extended.reduce_to` and the
replica context's `merge_call`; this layer only calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from crossdevice._arrays import backend_for
from crossdevice._core import context
from crossdevice._core.purpose import purpose
from crossdevice._core.reduce_op import ReduceOp, VariableAggregation, VariableSynchronization
from crossdevice._values.operators import ArrayOperators
from crossdevice._values.regroup import regroup
from crossdevice._values.values import DistributedValues, Mirrored, PerReplica
from crossdevice._values.variables import AssignMethods, Variable

__all__ = [
    "AggregatingVariable",
    "DistributedVariable",
    "MirroredVariable",
    "SyncOnReadVariable",
    "split_sum",
]


def split_sum(value: Any, count: int) -> list[np.ndarray]:
    """`count` parts that add up to `value`: TF's `value / count`, exact for integers.

    Integers give the first `value % count` parts one more (TF truncates `value / count`
    and loses the remainder: 7 over 3 replicas reads back as 6).

    Example:
        >>> [int(p) for p in split_sum(7, 3)]
        [3, 2, 2]
    """
    array = np.asarray(backend_for(value).to_numpy(value))
    if np.issubdtype(array.dtype, np.integer):
        base, extra = np.divmod(array, count)
        parts = [base + (i < extra) for i in range(count)]
    else:
        parts = [array / count] * count
    return [np.asarray(part, dtype=array.dtype) for part in parts]


def _is_real_floating(x: Any) -> bool:
    """TF's `dtype.is_floating`: float16/32/64 and bfloat16, not complex."""
    return backend_for(x).dtype_name(x).startswith(("float", "bfloat"))


def _is_integer(x: Any) -> bool:
    return backend_for(x).dtype_name(x).startswith(("int", "uint"))


def _mode(strategy: Any) -> tuple[str, int | None]:
    """("update", i), ("replica", i) or ("cross", None) for a variable of `strategy`.

    Outside any scope a distributed variable behaves as in its strategy's cross-replica
    context (TF enters the variable's strategy implicitly).
    """
    frame = context.current_frame()
    if frame is None or frame.strategy is not strategy:
        return "cross", None
    if frame.update_replica_id is not None:
        return "update", frame.update_replica_id
    if frame.replica_context is not None:
        return "replica", frame.local_replica_id
    return "cross", None


def _refuse_other_replicas(variable: Any, method: str) -> None:
    """Raise if `variable` is updated inside the replicas of another strategy.

    It took the cross-replica path of its own strategy there and failed deep inside
    with "requires being in cross-replica context" (the bug hunt of session 57).
    """
    frame = context.current_frame()
    if frame is not None and frame.replica_context is not None:
        raise RuntimeError(
            f"{type(variable).__name__} {variable.name!r} belongs to "
            f"{variable._strategy!r} and was updated ({method}) inside strategy.run of "
            f"{frame.strategy!r}: mixing different crossdevice.Strategy objects. Update it "
            "inside its own strategy's run, or create it under this strategy's scope"
        )


class DistributedVariable(AssignMethods, ArrayOperators, DistributedValues):
    """Base of variables with one component per replica; `isinstance(v, Variable)` holds."""

    __slots__ = ("_aggregation", "_strategy", "_synchronization")
    _is_distributed_variable = True
    #: TF refuses MEAN of a non-floating dtype when it creates this kind (values.py).
    _mean_needs_floats = True

    def __init__(
        self,
        strategy: Any,
        components: Sequence[Variable],
        aggregation: VariableAggregation,
        synchronization: VariableSynchronization,
    ) -> None:
        first = components[0]
        if (
            self._mean_needs_floats
            and aggregation == VariableAggregation.MEAN
            and not _is_real_floating(first._value)
        ):
            # TF's `DistributedVariable.__init__` (MirroredStrategy and
            # MultiWorkerMirroredStrategy, ON_WRITE and ON_READ, any replica count).
            raise ValueError(
                "creating distributed Variable with aggregation=MEAN and a non-floating "
                "dtype is not supported, please use a different aggregation or dtype: "
                f"variable {first.name!r} has dtype {first.dtype}. Use aggregation SUM or "
                "ONLY_FIRST_REPLICA, or a floating dtype (e.g. float32)"
            )
        super().__init__(components, devices=[c.device for c in components])
        self._strategy = strategy
        self._aggregation = aggregation
        self._synchronization = synchronization
        for component in components:
            component._distributed_container = self
            component._distribute_strategy = strategy

    # --- attributes of the primary ----------------------------------------------------
    @property
    def _distribute_strategy(self) -> Any:
        return self._strategy

    @property
    def distribute_strategy(self) -> Any:
        """The strategy this variable was created under (TF's `distribute_strategy`)."""
        return self._strategy

    @property
    def name(self) -> str:
        """The primary component's name."""
        return self._primary.name

    def _first_purpose(self) -> str:
        """What taking replica 0's value across workers is for, in its errors."""
        return (
            f"the first replica's value of ONLY_FIRST_REPLICA variable {self.name!r}, sent "
            "from worker 0 to every worker: a collective every worker must make at the same "
            "point (read or update it on every worker)"
        )

    @property
    def dtype(self) -> Any:
        """The dtype of the components."""
        return self._primary.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the components."""
        return self._primary.shape

    @property
    def device(self) -> str:
        """The device of the current replica's component (the primary's outside replicas)."""
        return self._get_on_device_or_primary().device

    @property
    def trainable(self) -> bool:
        """Whether optimisers should update it."""
        return self._primary.trainable

    @property
    def aggregation(self) -> VariableAggregation:
        """How replica-context updates combine."""
        return self._aggregation

    @property
    def synchronization(self) -> VariableSynchronization:
        """When components are synchronised."""
        return self._synchronization

    def _local_id(self) -> int | None:
        mode, replica = _mode(self._strategy)
        return None if mode == "cross" else replica

    # --- reads ----------------------------------------------------------------------------
    def _read_array(self) -> Any:
        """The array a read sees in the current context (not copied)."""
        return self._get()._value

    def read_value(self) -> Any:
        """A snapshot of the value seen in the current context."""
        array = self._read_array()
        return backend_for(array).copy(array)

    def value(self) -> Any:
        """Same as `read_value()`."""
        return self.read_value()

    def numpy(self) -> Any:
        """The value seen in the current context, as NumPy."""
        arr = np.array(backend_for(self._read_array()).to_numpy(self._read_array()), copy=True)
        return arr[()] if arr.ndim == 0 else arr

    def _operand(self) -> Any:
        return self._read_array()

    # --- writes: the subclasses' rules ----------------------------------------------------
    def _update_all(self, method: str, value: Any) -> None:
        """Cross-replica: apply `method` to every component through `extended.update`."""
        self._strategy.extended.update(
            self,
            lambda v, x: getattr(v, method)(x, read_value=False),
            args=(value,),
            group=False,
        )


def _snapshot(variable: DistributedVariable) -> Any:
    """A `Mirrored` of copies of the components' values (the copy alone for one)."""
    copies = [backend_for(c._value).copy(c._value) for c in variable._values]
    return regroup(copies, Mirrored, False, variable._devices)


class MirroredVariable(DistributedVariable):
    """A variable kept identical on every replica (synchronisation ON_WRITE).

    In cross-replica context an assign updates every component. In a replica, with
    aggregation NONE only the local component changes (components may then diverge, as
    in TF 2); otherwise the replicas' values are combined (SUM, MEAN, or replica 0's for
    ONLY_FIRST_REPLICA) through a `merge_call` and every component gets the result.
    """

    __slots__ = ()

    def _get_cross_replica(self) -> Any:
        return self._get_on_device_or_primary()

    def _assigned(self) -> Any:
        """What an update returns with `read_value=True`: TF's result in each context.

        Cross-replica: a `Mirrored` snapshot of the components (TF's `update_regroup`
        reads each one through `identity`), so `y = m.assign(5.); m.assign(7.)` leaves
        `y` at 5. In a replica with an aggregation: a snapshot of the replica's component
        after the merged update (`run` regroups them into a `PerReplica`), so a counter's
        history `[run(lambda: step.assign_add(1.)) for _ in range(3)]` reads 1, 2, 3. In a
        replica with aggregation NONE, and in an update context: the variable (TF: the
        component's unread view), live, as a plain variable's assign.

        TF returns the live variable when the strategy has one replica (its regroup skips
        the `identity` for one value); here the snapshot does not depend on the count.
        """
        mode, replica = _mode(self._strategy)
        if mode == "cross":
            return _snapshot(self)
        assert replica is not None
        if mode == "update":
            return self._values[replica]
        if self._aggregation == VariableAggregation.NONE:
            return self
        array = self._values[replica]._value
        return backend_for(array).copy(array)

    def _update(self, method: str, value: Any) -> None:
        mode, replica = _mode(self._strategy)
        if mode == "update":
            assert replica is not None
            getattr(self._values[replica], method)(value, read_value=False)
            return
        if mode == "cross":
            _refuse_other_replicas(self, method)
            self._update_all(method, value)
            return
        assert replica is not None
        if self._aggregation == VariableAggregation.NONE:
            getattr(self._values[replica], method)(value, read_value=False)
            return
        aggregation = self._aggregation

        def merge_fn(strategy: Any, value: Any) -> None:
            if aggregation == VariableAggregation.ONLY_FIRST_REPLICA:
                first = value.values[0] if isinstance(value, PerReplica) else value
                first = strategy.extended._from_first_replica(first, self._first_purpose())
                self._update_all(method, first)
                return
            # (MEAN of a non-floating variable cannot happen: refused at creation, TF.)
            op = ReduceOp.from_variable_aggregation(aggregation)
            reduced = strategy.extended.reduce_to(op, value, destinations=self)
            self._update_all(method, reduced)

        context.current_frame().replica_context.merge_call(merge_fn, args=(value,))  # type: ignore[union-attr]


class SyncOnReadVariable(DistributedVariable):
    """A variable written locally by each replica and aggregated when read (ON_READ).

    Used for metrics and batch-norm statistics.

    In a replica, reads and writes see the local component. A cross-replica read
    combines the components with the aggregation (SUM, MEAN, or replica 0's value for
    ONLY_FIRST_REPLICA; NONE is an error).
    """

    __slots__ = ()

    def _get_cross_replica(self) -> Any:
        raise AssertionError("SyncOnReadVariable reads go through _read_array")

    def _assigned(self) -> Any:
        """What an update returns with `read_value=True`: TF's result in each context.

        Cross-replica: a snapshot of the value a cross-replica read gives (the SUM, MEAN
        or first replica's value; TF's `assign_on_each_device` returns `read_value()`).
        In a replica or an update context: the variable (TF: the local component's
        unread view), live, as a plain variable's assign.
        """
        mode, replica = _mode(self._strategy)
        if mode == "cross":
            return self.read_value()
        if mode == "update":
            assert replica is not None
            return self._values[replica]
        return self

    def _read_array(self) -> Any:
        mode, replica = _mode(self._strategy)
        if mode != "cross":
            assert replica is not None
            return self._values[replica]._value
        if self._aggregation == VariableAggregation.ONLY_FIRST_REPLICA:
            return self._strategy.extended._from_first_replica(
                self._primary._value, self._first_purpose()
            )
        if self._aggregation == VariableAggregation.NONE:
            raise ValueError(
                f"Could not convert from VariableAggregation.NONE to a reduce op: reading "
                f"SyncOnReadVariable {self.name!r} in cross-replica context needs an "
                "aggregation (SUM, MEAN or ONLY_FIRST_REPLICA); read it inside strategy.run "
                "to get the local value"
            )
        op = ReduceOp.from_variable_aggregation(self._aggregation)
        per_replica = PerReplica([c._value for c in self._values], devices=self._devices)
        # Across workers this read is an all-reduce: say so if the workers disagree.
        with purpose(
            f"reading SyncOnReadVariable {self.name!r} in cross-replica context, which "
            "reduces it across the workers: a collective every worker must make at the "
            "same point (read it on every worker, not on the chief only)"
        ):
            return self._strategy.reduce(op, per_replica, axis=None)

    def _update(self, method: str, value: Any) -> None:
        mode, replica = _mode(self._strategy)
        if mode != "cross":
            assert replica is not None
            getattr(self._values[replica], method)(value, read_value=False)
            return
        if self._aggregation == VariableAggregation.NONE:
            # TF 2.21 raises here for assign, assign_add and assign_sub alike, with any
            # number of replicas ("Could not convert from `tf.VariableAggregation`
            # VariableAggregationV2.NONE to `tf.distribute.ReduceOp` type"). The
            # reference notes on TF's semantics (§9 "Values and variables": "otherwise
            # `x`", "otherwise they apply per device") were wrong for NONE, and so were we.
            raise ValueError(
                f"Could not convert from VariableAggregation.NONE to a reduce op: `{method}` "
                f"of SyncOnReadVariable {self.name!r} in cross-replica context needs an "
                "aggregation (TF refuses it too). Update it inside strategy.run (each "
                "replica its own component), set the components with "
                "strategy.extended.update(v, fn), or create it with aggregation SUM, MEAN "
                "or ONLY_FIRST_REPLICA"
            )
        if self._aggregation == VariableAggregation.SUM:
            if method != "assign":
                raise ValueError(
                    f"SyncOnReadVariable does not support `{method}` in cross-replica "
                    "context when aggregation is set to VariableAggregation.SUM; assign "
                    "the new total with `assign` instead"
                )
            self._assign_total(value)
            return
        for component in self._values:
            getattr(component, method)(value, read_value=False)

    def _assign_total(self, value: Any) -> None:
        """Cross-replica `assign` of a SUM variable: components that add up to `value`.

        Each of the `num_replicas_in_sync` replicas (across every worker) gets its share,
        so that a read (a SUM over every worker) gives `value` back. Where we differ from
        TF (values_util.on_read_assign_cross_replica), deliberately:

        * integers are split exactly, the first `value % N` replicas one more (7 over 3:
          2/2/2... is TF's, which reads back as 6 and loses the remainder; 3/2/2 here,
          as a restored checkpoint splits it too); with one replica nothing is divided
          (TF: 7; here it raised a TypeError, the true division's float being refused);
        * TF divides by this worker's replicas only, so with several workers the read
          gives the value times the number of workers; here the share is of every
          replica in sync.
        """
        strategy = self._strategy
        total = strategy.num_replicas_in_sync
        first = strategy.extended._replica_id_offset
        if total == 1:
            parts: list[Any] = [value]
        elif _is_integer(self._primary._value):
            parts = split_sum(value, total)[first : first + len(self._values)]
        else:
            array = backend_for(value).asarray(value)
            parts = [backend_for(array).divide(array, total)] * len(self._values)
        for component, part in zip(self._values, parts, strict=True):
            component.assign(part, read_value=False)


class AggregatingVariable(DistributedVariable):
    """One variable on the parameter device, shared by the replicas (CentralStorageStrategy).

    In a replica, an assign with an aggregation combines the replicas' values through a
    `merge_call` and updates the single variable once; with aggregation NONE it is an
    error, because the replicas would race on one variable. An assign returns the
    variable itself, live, in every context, as TF's (one variable, read by no `identity`).
    """

    __slots__ = ()
    _mean_needs_floats = False  # TF's AggregatingVariable is no DistributedVariable

    def _get(self) -> Any:
        return self._primary

    def _get_cross_replica(self) -> Any:
        return self._primary

    def _update(self, method: str, value: Any) -> None:
        mode, _ = _mode(self._strategy)
        if mode != "replica" or self._strategy.num_replicas_in_sync == 1:
            self._strategy.extended.update(
                self, lambda v, x: getattr(v, method)(x, read_value=False), args=(value,)
            )
            return
        aggregation = self._aggregation
        if aggregation == VariableAggregation.NONE:
            raise ValueError(
                f"You must specify an aggregation method to update variable {self.name!r} "
                "in replica context: create it with aggregation=VariableAggregation.SUM, "
                "MEAN or ONLY_FIRST_REPLICA, or update it in cross-replica context"
            )

        def merge_fn(strategy: Any, value: Any) -> None:
            if aggregation == VariableAggregation.ONLY_FIRST_REPLICA:
                reduced = value.values[0] if isinstance(value, PerReplica) else value
                reduced = strategy.extended._from_first_replica(reduced, self._first_purpose())
            else:
                op = ReduceOp.from_variable_aggregation(aggregation)
                reduced = strategy.extended.reduce_to(op, value, destinations=self)
            strategy.extended.update(
                self, lambda v, x: getattr(v, method)(x, read_value=False), args=(reduced,)
            )

        context.current_frame().replica_context.merge_call(merge_fn, args=(value,))  # type: ignore[union-attr]

    def __repr__(self) -> str:
        return repr(self._primary)
