"""`ReduceOp`, `VariableAggregation` and `VariableSynchronization`."""

from __future__ import annotations

import enum

from crossdevice._core.coerce import coerce_enum

__all__ = ["ReduceOp", "VariableAggregation", "VariableSynchronization", "as_reduce_op"]


class ReduceOp(enum.Enum):
    """How values are combined across replicas: `SUM` or `MEAN` (TF's `tf.distribute.ReduceOp`).

    Strings (`"sum"`, `"MEAN"`, any case) are accepted wherever a `ReduceOp` is.
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_variable_aggregation(aggregation: VariableAggregation) -> ReduceOp:
        """SUM for `VariableAggregation.SUM`, MEAN for `MEAN`; ValueError for the others."""
        mapping = {VariableAggregation.SUM: ReduceOp.SUM, VariableAggregation.MEAN: ReduceOp.MEAN}
        if aggregation not in mapping:
            raise ValueError(
                f"Could not convert from VariableAggregation {aggregation!r} to ReduceOp; "
                "only VariableAggregation.SUM and VariableAggregation.MEAN have one"
            )
        return mapping[aggregation]


class VariableAggregation(enum.Enum):
    """How replica-context updates of a distributed variable are combined."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


class VariableSynchronization(enum.Enum):
    """When a distributed variable's components are synchronised."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


#: The common spellings, looked up before the enum's case-insensitive conversion.
_BY_NAME: dict[str, ReduceOp] = {
    spelling: op for op in ReduceOp for spelling in (op.value, op.value.lower(), op.name)
}


def as_reduce_op(reduce_op: object) -> ReduceOp:
    """Convert `reduce_op` (a `ReduceOp` or a string in any case) to a `ReduceOp`.

    TF converts strings in `Strategy.reduce` and friends but not in `CrossDeviceOps`
    methods (there ReductionToOneDevice raises and NcclAllReduce silently sums); we accept
    strings everywhere.

    Raises:
        ValueError: a string that names no reduce op.
        TypeError: anything else (a `VariableAggregation`, a number, ...).
    """
    if type(reduce_op) is ReduceOp:  # the per-step path
        return reduce_op
    if type(reduce_op) is str:  # the per-step path of `all_reduce("sum", x)`
        op = _BY_NAME.get(reduce_op)
        if op is not None:
            return op
    if not isinstance(reduce_op, str | ReduceOp):
        raise TypeError(
            f"Expected reduce_op to be a crossdevice.ReduceOp (or 'sum'/'mean'), not: {reduce_op!r}"
        )
    return coerce_enum(
        reduce_op,
        ReduceOp,
        spellings=_BY_NAME,
        message="unknown reduce op {value}; expected ReduceOp.SUM, ReduceOp.MEAN, 'sum' or 'mean'",
    )
