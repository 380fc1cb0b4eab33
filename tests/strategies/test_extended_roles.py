"""TF 2's `StrategyExtended` role flags and `read_var` (missing before: AttributeError).

Values measured with TF 2.21 (hunt scripts t_attrs.py, t_ext.py) and read in its source:
`should_checkpoint`/`should_save_summary` are the chief's only under
MultiWorkerMirroredStrategy (`CollectiveAllReduceExtended`), True elsewhere;
`experimental_between_graph` is True for MultiWorkerMirrored and CentralStorage.
The multi-worker values across several workers are checked in
tests/multi_worker/test_strategy.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import crossdevice as cd

AGG = cd.VariableAggregation
SYNC = cd.VariableSynchronization


@pytest.mark.parametrize(
    ("make", "flags"),
    [
        (lambda: cd.MirroredStrategy(["CPU:0", "CPU:1"]), (True, True, True, False)),
        (lambda: cd.OneDeviceStrategy("CPU:0"), (True, True, True, False)),
        (
            lambda: cd.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"]),
            (True, True, True, True),
        ),
        (cd.get_strategy, (True, True, True, False)),
        (lambda: cd.MultiWorkerMirroredStrategy(devices=["CPU:0"]), (True, True, True, True)),
    ],
    ids=["mirrored", "one_device", "central_storage", "default", "multi_worker_1"],
)
def test_role_flags_are_tfs(make: Any, flags: tuple[bool, ...]) -> None:
    e = make().extended
    got = (
        e.should_checkpoint,
        e.should_save_summary,
        e.experimental_should_init,
        e.experimental_between_graph,
    )
    assert got == flags


def test_multi_worker_non_chief_neither_checkpoints_nor_writes_summaries() -> None:
    e = cd.MultiWorkerMirroredStrategy(devices=["CPU:0"]).extended
    e._worker_index = 1  # what a second worker's extended holds
    assert (e.should_checkpoint, e.should_save_summary) == (False, False)
    assert (e.experimental_should_init, e.experimental_between_graph) == (True, True)


def _variables(s: Any) -> tuple[Any, Any]:
    with s.scope():
        v = cd.Variable(2.0)
        w = cd.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
    return v, w


def test_mirrored_read_var_gives_the_cross_replica_value() -> None:
    s = cd.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    v, w = _variables(s)
    value = s.extended.read_var(v)
    v.assign(5.0)
    assert float(value) == 2.0  # a snapshot (TF's identity)
    assert float(s.extended.read_var(w)) == 3.0  # SUM of three components of 1.0 (TF)
    inside = s.run(lambda: s.extended.read_var(v))
    assert [float(x) for x in s.experimental_local_results(inside)] == [5.0] * 3


def test_mirrored_read_var_errors() -> None:
    s = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    _, w = _variables(s)
    with pytest.raises(RuntimeError, match="cross-replica context"):
        s.run(lambda: s.extended.read_var(w))  # TF: "requires being in cross-replica context"
    with pytest.raises(ValueError, match=r"created in this strategy's scope.*got"):
        s.extended.read_var(cd.Variable(3.0))  # TF: an AttributeError
    with pytest.raises(ValueError, match=r"got np\.float32"):
        s.extended.read_var(np.float32(1.0))


@pytest.mark.parametrize(
    "make",
    [
        lambda: cd.OneDeviceStrategy("CPU:0"),
        lambda: cd.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"]),
        cd.get_strategy,
    ],
    ids=["one_device", "central_storage", "default"],
)
def test_other_strategies_read_any_variable(make: Any) -> None:
    s = make()
    v, w = _variables(s)
    assert float(s.extended.read_var(v)) == 2.0
    assert float(s.extended.read_var(w)) == 1.0  # TF 2.21: one variable, not a sum
    assert float(s.extended.read_var(cd.Variable(3.0))) == 3.0
    with pytest.raises(ValueError, match=r"expects a crossdevice\.Variable"):
        s.extended.read_var(np.float32(1.0))
