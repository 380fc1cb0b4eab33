"""The seed pages' examples, as tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from tests.helpers import to_numpy


def _step_fn(var: Any) -> None:
    def merge_fn(strategy: Any, value: Any, var: Any) -> None:
        # All-reduce the value. Note that `value` here is a DistributedValues.
        reduced = strategy.extended.batch_reduce_to(cd.ReduceOp.SUM, [(value, var)])[0]
        strategy.extended.update(var, lambda var, value: var.assign(value), args=(reduced,))

    value = np.array(1.0, dtype=np.float32)  # tf.identity(1.)
    cd.get_replica_context().merge_call(merge_fn, args=(value, var))


def _run(strategy: Any) -> Any:
    with strategy.scope():
        v = cd.Variable(0.0)
    strategy.run(_step_fn, args=(v,))
    return v


def test_batch_reduce_to_example_mirrored() -> None:
    v = _run(cd.MirroredStrategy(["CPU:0", "CPU:1"]))
    assert isinstance(v, cd.MirroredVariable)
    assert [float(c.numpy()) for c in v.values] == [2.0, 2.0]
    assert repr(v) == (
        "MirroredVariable:{\n"
        "  0: <crossdevice.Variable 'Variable:0' shape=() dtype=float32, numpy=2.0>,\n"
        "  1: <crossdevice.Variable 'Variable/replica_1:0' shape=() dtype=float32, numpy=2.0>\n"
        "}"
    )


def test_batch_reduce_to_example_central_storage() -> None:
    v = _run(
        cd.experimental.CentralStorageStrategy(
            compute_devices=["CPU:0", "CPU:1"], parameter_device="CPU:0"
        )
    )
    assert repr(v) == "<crossdevice.Variable 'Variable:0' shape=() dtype=float32, numpy=2.0>"


def test_batch_reduce_to_example_one_device() -> None:
    v = _run(cd.OneDeviceStrategy("CPU:0"))
    assert repr(v) == "<crossdevice.Variable 'Variable:0' shape=() dtype=float32, numpy=1.0>"


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("sum", {"a": 4, "b": [42, 99]}),
        ("mean", {"a": 2, "b": [21, 49.5]}),
    ],
)
def test_replica_context_all_reduce_example(op: str, expected: dict[str, Any]) -> None:
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    inputs = [{"a": 1, "b": [40, 1]}, {"a": 3, "b": [2, 98]}]

    def fn() -> Any:
        ctx = cd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce(op, inputs[ctx.replica_id_in_sync_group])

    for result in strategy.experimental_local_results(strategy.run(fn)):
        assert float(result["a"]) == expected["a"]
        assert [float(x) for x in result["b"]] == expected["b"]


def test_strategy_reduce_axis_example(backend: Any) -> None:
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    value = cd.PerReplica([backend.make(np.arange(4.0)), backend.make(np.arange(4.0, 8.0))])
    np.testing.assert_array_equal(
        to_numpy(strategy.reduce("sum", value, axis=None)), [0 + 4, 1 + 5, 2 + 6, 3 + 7]
    )
    assert float(to_numpy(strategy.reduce("sum", value, axis=0))) == 28.0
    assert float(to_numpy(strategy.reduce("mean", value, axis=0))) == 3.5


def test_partial_batch_mean_uses_global_denominator(backend: Any) -> None:
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    # A last batch of 6 split [0, 1, 2, 3] / [4, 5]: MEAN with axis=0 divides by 6.
    value = cd.PerReplica([backend.make(np.arange(4.0)), backend.make(np.arange(4.0, 6.0))])
    assert float(to_numpy(strategy.reduce("mean", value, axis=0))) == pytest.approx(15 / 6)
    # Averaging per-replica means would weigh some elements 1/8 and others 1/4: 2.75.
    assert float(to_numpy(strategy.reduce("mean", value, axis=0))) != pytest.approx(2.75)
