"""Bad input gets TF's exception types with messages that say what was expected."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import crossdevice as cd


@pytest.fixture
def strategy() -> Any:
    return cd.MirroredStrategy(["CPU:0", "CPU:1"])


@pytest.mark.parametrize(
    "args",
    [np.float32(1), np.zeros(3), np.zeros(0), np.zeros((2, 2)), {"x": 1}],
    ids=["scalar", "array", "empty", "matrix", "dict"],
)
def test_run_args_must_be_a_tuple_or_list(strategy: Any, args: Any) -> None:
    # An array's truth value is ambiguous: NumPy's error came first (the TF bug hunt).
    with pytest.raises(ValueError, match="positional args must be a list or tuple, got"):
        strategy.run(lambda x: x, args=args)


def test_run_args_as_a_tensor_is_refused_clearly(strategy: Any, torch_module: Any) -> None:
    with pytest.raises(ValueError, match="positional args must be a list or tuple, got"):
        strategy.run(lambda x: x, args=torch_module.ones(3))


def test_gather_in_replica_context(strategy: Any) -> None:
    def fn() -> None:
        strategy.gather(np.zeros(2), axis=0)

    with pytest.raises(RuntimeError, match="requires cross-replica context, use"):
        strategy.run(fn)


def test_cross_replica_api_in_replica_context(strategy: Any) -> None:
    def fn() -> None:
        strategy.reduce("sum", np.float32(1), axis=None)

    with pytest.raises(RuntimeError, match="requires being in cross-replica context"):
        strategy.run(fn)


def test_sum_of_a_non_distributed_value(strategy: Any) -> None:
    with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
        strategy.reduce("sum", np.float32(5.0), axis=None)
    # MEAN of a plain value is the value itself (TF).
    assert float(strategy.reduce("mean", np.float32(5.0), axis=None)) == 5.0


def test_duplicate_devices() -> None:
    with pytest.raises(AssertionError, match="No duplicates allowed"):
        cd.MirroredStrategy(["CPU:0", "/cpu:0"])
    with pytest.raises(ValueError, match="No duplicates allowed"):
        cd.MirroredStrategy(["CPU:1", "CPU:1"])


def test_unknown_devices() -> None:
    with pytest.raises(ValueError, match=r"device '.*CPU:99' does not exist; the devices"):
        cd.MirroredStrategy(["CPU:0", "CPU:99"])
    with pytest.raises(ValueError, match="could not parse device string"):
        cd.OneDeviceStrategy("TPU")


@pytest.mark.parametrize(
    ("axis", "exc"), [(1, ValueError), (-2, ValueError), ("0", TypeError), (0.5, TypeError)]
)
def test_bad_axis(strategy: Any, axis: Any, exc: type[Exception]) -> None:
    value = cd.PerReplica([np.zeros(3), np.zeros(3)])
    with pytest.raises(exc, match="axis"):
        strategy.reduce("sum", value, axis=axis)


def test_bad_reduce_op(strategy: Any) -> None:
    value = cd.PerReplica([np.zeros(3), np.zeros(3)])
    with pytest.raises(ValueError, match="unknown reduce op 'max'"):
        strategy.reduce("max", value, axis=None)
    with pytest.raises(TypeError, match="Expected reduce_op to be"):
        strategy.reduce(cd.VariableAggregation.SUM, value, axis=None)

    def fn() -> None:
        cd.get_replica_context().all_reduce("prod", np.float32(1))

    with pytest.raises(ValueError, match="unknown reduce op 'prod'"):
        strategy.run(fn)


def test_variable_with_synchronization_none(strategy: Any) -> None:
    with strategy.scope(), pytest.raises(ValueError, match="NONE variable synchronization"):
        cd.Variable(1.0, synchronization=cd.VariableSynchronization.NONE)
    with strategy.scope(), pytest.raises(ValueError, match="Invalid variable aggregation"):
        cd.Variable(1.0, aggregation="median")


def test_mixing_strategies(strategy: Any) -> None:
    other = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope(), pytest.raises(RuntimeError, match="Mixing different"), other.scope():
        pass


def test_nested_run(strategy: Any) -> None:
    def fn() -> None:
        strategy.run(lambda: None)

    with pytest.raises(RuntimeError, match="inside a replica context"):
        strategy.run(fn)


def test_reduce_to_list_destinations(strategy: Any) -> None:
    value = cd.PerReplica([np.zeros(3), np.zeros(3)])
    with pytest.raises(AssertionError, match="can not be a list or tuple"):
        strategy.extended.reduce_to("sum", value, destinations=["CPU:0"])


def test_integer_variable_with_mean_aggregation_is_refused_at_creation(strategy: Any) -> None:
    # TF refuses it when it creates the distributed variable (values.py), not at the
    # first replica-context update as we did.
    with strategy.scope(), pytest.raises(ValueError, match="aggregation=MEAN and a non-floating"):
        cd.Variable(np.zeros(2, np.int32), aggregation="mean")


def test_all_gather_shape_mismatch(strategy: Any) -> None:
    def fn() -> Any:
        r = cd.get_replica_context().replica_id_in_sync_group
        return cd.get_replica_context().all_gather(np.zeros((2, r + 1)), axis=0)

    with pytest.raises(ValueError, match="shape"):
        strategy.run(fn)


def test_all_reduce_shape_mismatch(strategy: Any) -> None:
    def fn() -> Any:
        r = cd.get_replica_context().replica_id_in_sync_group
        return cd.get_replica_context().all_reduce("sum", np.zeros(r + 1))

    with pytest.raises(ValueError, match="shape"):
        strategy.run(fn)
