"""What `assign`, `assign_add` and `assign_sub` return (read_value=True), per variable kind.

TF 2.21 (measured with paired scripts): a distributed variable's update returns a
snapshot of the value it wrote where TF's `update_regroup` reads the components through
`identity` (cross-replica updates of Mirrored and sync-on-read variables, aggregated
replica-context updates of Mirrored ones, `extended.update` with `group=True`); elsewhere
(a plain variable, CentralStorage's one variable, a replica's own component) the variable
itself, live. Before the fix every kind returned the live variable: a counter's history
`[run(lambda: step.assign_add(1.)) for _ in range(3)]` read [3, 3, 3] where TF gives
[1, 2, 3].
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from tests.conftest import require_torch

AGG = cd.VariableAggregation
SYNC = cd.VariableSynchronization


def _locals(strategy: Any, value: Any) -> list[float]:
    return [float(np.asarray(x)) for x in strategy.experimental_local_results(value)]


def _replica_id() -> float:
    ctx = cd.get_replica_context()
    assert ctx is not None
    return float(ctx.replica_id_in_sync_group)


@pytest.mark.parametrize("aggregation", [AGG.ONLY_FIRST_REPLICA, AGG.MEAN])
def test_counter_history_in_run_reads_each_steps_value(aggregation: Any) -> None:
    s = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    with s.scope():
        step = cd.Variable(0.0, aggregation=aggregation)
    history = [s.run(lambda: step.assign_add(1.0)) for _ in range(3)]
    # TF 2.21 (t_counter.py): [1.0, 2.0, 3.0]; before the fix [3.0, 3.0, 3.0].
    assert [_locals(s, h) for h in history] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert all(isinstance(h, cd.PerReplica) for h in history)


def test_aggregated_assign_in_run_keeps_the_merged_value() -> None:
    s = cd.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    with s.scope():
        m = cd.Variable(1.0, aggregation=AGG.MEAN)
    x = s.run(lambda: m.assign(np.float32(_replica_id())))
    m.assign(7.0)
    x2 = s.run(lambda: m.assign_add(1.0))
    m.assign(100.0)
    # TF 2.21 (t_snap.py): the mean 1.0 and 8.0, whatever was assigned after.
    assert _locals(s, x) == [1.0, 1.0, 1.0]
    assert _locals(s, x2) == [8.0, 8.0, 8.0]


@pytest.mark.parametrize("aggregation", [AGG.NONE, AGG.SUM, AGG.MEAN, AGG.ONLY_FIRST_REPLICA])
@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
def test_cross_replica_update_returns_a_mirrored_snapshot(aggregation: Any, method: str) -> None:
    s = cd.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    with s.scope():
        m = cd.Variable(1.0, aggregation=aggregation)
    y = getattr(m, method)(5.0)
    m.assign(7.0)
    expected = {"assign": 5.0, "assign_add": 6.0, "assign_sub": -4.0}[method]
    assert isinstance(y, cd.Mirrored)
    assert _locals(s, y) == [expected] * 3  # TF 2.21: 5.0 for assign, not 7.0


def test_one_replica_mirrored_snapshot_too() -> None:
    # TF returns the live variable with one replica (no `identity` for one value), a
    # snapshot with several; a program's numbers must not depend on the replica count.
    s = cd.MirroredStrategy(["CPU:0"])
    with s.scope():
        m = cd.Variable(1.0, aggregation=AGG.SUM)
    y = m.assign(5.0)
    history = [s.run(lambda: m.assign_add(1.0)) for _ in range(2)]
    m.assign(7.0)
    assert float(y) == 5.0
    assert [float(h) for h in history] == [6.0, 7.0]


def test_update_with_group_returns_a_snapshot_without_group_the_components() -> None:
    s = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    with s.scope():
        v = cd.Variable(0.0)
    grouped = s.extended.update(v, lambda c, d: c.assign_add(d), args=(1.0,))
    loose = s.extended.update(v, lambda c, d: c.assign_add(d), args=(1.0,), group=False)
    v.assign(20.0)
    assert isinstance(grouped, cd.Mirrored)
    assert _locals(s, grouped) == [1.0, 1.0]  # TF 2.21: 8.0 in t_probe's sequence, not 20
    assert [float(c.numpy()) for c in loose] == [20.0, 20.0]  # TF: live UnreadVariables


def test_unaggregated_assign_in_run_stays_live_as_tf() -> None:
    # TF 2.21 returns the replica's component (an unread, live view): [2, 2] after two runs.
    s = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    with s.scope():
        v = cd.Variable(0.0)
    first = s.run(lambda: v.assign_add(1.0))
    s.run(lambda: v.assign_add(1.0))
    assert _locals(s, first) == [2.0, 2.0]


@pytest.mark.parametrize(
    ("aggregation", "method", "expected"),
    [
        (AGG.SUM, "assign", 5.0),
        (AGG.MEAN, "assign", 5.0),
        (AGG.MEAN, "assign_add", 6.0),
        (AGG.ONLY_FIRST_REPLICA, "assign_sub", -4.0),
    ],
)
def test_sync_on_read_cross_replica_update_returns_the_read_value(
    aggregation: Any, method: str, expected: float
) -> None:
    s = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    with s.scope():
        w = cd.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=aggregation)
    y = getattr(w, method)(5.0)
    w.assign(7.0)
    # TF 2.21: a tensor of the cross-replica read (the SUM, MEAN, first value) at the time.
    assert isinstance(y, np.ndarray)
    assert float(y) == expected


def test_sync_on_read_update_in_run_stays_live_as_tf() -> None:
    s = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    with s.scope():
        acc = cd.Variable(0.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
    history = [s.run(lambda: acc.assign_add(1.0)) for _ in range(3)]
    # TF 2.21 (t_counter.py): [3.0, 3.0, 3.0]: the replica's component, live.
    assert [_locals(s, h)[0] for h in history] == [3.0, 3.0, 3.0]


@pytest.mark.parametrize(
    "strategy",
    [
        lambda: cd.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"]),
        lambda: cd.OneDeviceStrategy("CPU:0"),
        cd.get_strategy,
    ],
    ids=["central_storage", "one_device", "default"],
)
def test_one_variable_strategies_return_the_live_variable(strategy: Any) -> None:
    s = strategy()
    with s.scope():
        v = cd.Variable(0.0, aggregation=AGG.MEAN)
    y = v.assign(5.0)
    v.assign(7.0)
    r = s.run(lambda: v.assign_add(1.0))
    v.assign(9.0)
    # TF 2.21: an unread (live) view of the one variable in every context.
    assert _locals(s, y)[0] == 9.0
    assert _locals(s, r)[0] == 9.0


def test_plain_variable_stays_live() -> None:
    q = cd.Variable(1.0)
    w = q.assign(5.0)
    q.assign(9.0)
    assert w is q
    assert float(w.numpy()) == 9.0  # TF 2.21: 9.0


def test_torch_components_are_snapshot_by_clone(request: pytest.FixtureRequest) -> None:
    torch = require_torch(request)
    s = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    with s.scope():
        m = cd.Variable(torch.zeros(2), aggregation=AGG.ONLY_FIRST_REPLICA)
    y = m.assign(torch.ones(2))
    r = s.run(lambda: m.assign_add(torch.ones(2)))
    m.assign(torch.full((2,), 7.0))
    assert all(torch.equal(t, torch.ones(2)) for t in s.experimental_local_results(y))
    assert all(torch.equal(t, torch.full((2,), 2.0)) for t in s.experimental_local_results(r))
