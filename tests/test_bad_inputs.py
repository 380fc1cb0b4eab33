"""Issue 23: bad axes, unwritable assigns and absurd TF_CONFIG numbers get our errors.

Each names the entry point or variable, the value received and what was expected, and
is raised before anything ran or changed: no reduction or gather started, no component
of a variable written. Before, these reached the user as NumPy's, torch's or Python's
own messages from deep inside (NumPy's "duplicate value in 'axis'", "Cannot cast scalar
from dtype('<U3')", "Exceeds the limit (4300 digits) for integer string conversion").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice import cluster_resolver
from crossdevice._core.validate import safe_repr
from tests.strategies.conftest import replica_execution


def _ids(cases: list[tuple[Any, ...]]) -> list[str]:
    """Test ids: the value's repr (`safe_repr`: pytest's own str() fails on huge ints)."""
    return [safe_repr(case[0])[:30] for case in cases]


#: (axis, error, message) for every axis-taking API; `several` APIs take tuples.
ONE_AXIS = [
    (2, ValueError, r"axis = 2 out of range for value with rank 2; expected an int in \[-2, 2\)"),
    (-3, ValueError, r"axis = -3 out of range for value with rank 2"),
    (10**30, ValueError, r"axis = 1000000000000000000000000000000 out of range"),
    (10**5000, ValueError, r"axis = <an int of about 5001 digits> out of range"),
    ("0", TypeError, r"axis must be an int, got str: '0'"),
    (1.0, TypeError, r"axis must be an int, got float: 1.0"),
    (True, TypeError, r"axis must be an int, got bool: True"),
    ((0, 0), TypeError, r"axis must be an int, got tuple: \(0, 0\)"),
]
SEVERAL_AXES = [
    ((0, 0), ValueError, r"axis = \(0, 0\) names axis 0 more than once"),
    ((0, -2), ValueError, r"axis = \(0, -2\) names axis 0 more than once"),
    ([1, -1], ValueError, r"axis = \[1, -1\] names axis 1 more than once"),
    ((0, 2), ValueError, r"axis = \(0, 2\) out of range for value with rank 2; expected each"),
    (2, ValueError, r"axis = 2 out of range for value with rank 2"),
    ("0", TypeError, r"axis must be an int or a tuple/list of distinct ints, got str: '0'"),
    ((0, 1.0), TypeError, r"axis must be an int or a tuple/list of distinct ints, got tuple"),
]


@pytest.fixture(params=["threads", "cooperative"])
def strategy(request: pytest.FixtureRequest) -> Iterator[Any]:
    with replica_execution(request.param):
        yield cd.MirroredStrategy(["CPU:0", "CPU:1"])


@pytest.fixture
def collectives(strategy: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the strategy's reductions and gathers that started (none may)."""
    started: list[str] = []
    extended = strategy.extended
    for name in ("reduce_to", "batch_reduce_to", "_gather_to", "_replica_all_gather"):
        original = getattr(extended, name)

        def record(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            started.append(_name)
            return _original(*args, **kw)

        monkeypatch.setattr(extended, name, record)
    return started


def _values(strategy: Any, backend: Any) -> tuple[Any, Any]:
    """A nest whose first leaf reduces along any axis, and a rank-2 PerReplica."""
    good = strategy.experimental_distribute_values_from_function(
        lambda ctx: backend.make(np.ones((2, 3, 4), np.float32))
    )
    bad = strategy.experimental_distribute_values_from_function(
        lambda ctx: backend.make(np.ones((2, 3), np.float32))
    )
    return good, bad


@pytest.mark.parametrize(("axis", "error", "message"), SEVERAL_AXES, ids=_ids(SEVERAL_AXES))
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_axis(
    strategy: Any,
    collectives: list[str],
    backend: Any,
    op: str,
    axis: Any,
    error: Any,
    message: str,
) -> None:
    good, bad = _values(strategy, backend)
    with pytest.raises(error, match="^Strategy.reduce: " + message):
        strategy.reduce(op, {"a": good, "b": bad}, axis=axis)
    assert collectives == []  # the first leaf was not reduced either


@pytest.mark.parametrize(("axis", "error", "message"), ONE_AXIS, ids=_ids(ONE_AXIS))
def test_gather_axis(
    strategy: Any, collectives: list[str], backend: Any, axis: Any, error: Any, message: str
) -> None:
    good, bad = _values(strategy, backend)
    with pytest.raises(error, match="^Strategy.gather: " + message):
        strategy.gather([good, bad], axis=axis)
    assert collectives == []


@pytest.mark.parametrize(("axis", "error", "message"), ONE_AXIS, ids=_ids(ONE_AXIS))
def test_all_gather_axis(
    strategy: Any, collectives: list[str], backend: Any, axis: Any, error: Any, message: str
) -> None:
    def step() -> Any:
        value = [backend.make(np.ones((2, 3, 4))), backend.make(np.ones((2, 3)))]
        return cd.get_replica_context().all_gather(value, axis=axis)

    with pytest.raises(error, match="^ReplicaContext.all_gather: " + message):
        strategy.run(step)
    assert collectives == []  # raised in each replica before it met the others


@pytest.mark.parametrize(("axis", "error", "message"), ONE_AXIS, ids=_ids(ONE_AXIS))
def test_cross_device_ops_gather_axis(backend: Any, axis: Any, error: Any, message: str) -> None:
    value = cd.PerReplica([backend.make(np.ones((2, 3))) for _ in range(2)])
    for ops in (cd.ReductionToOneDevice(), cd.HierarchicalCopyAllReduce()):
        with pytest.raises(error, match="^CrossDeviceOps._gather: " + message):
            ops._gather(value, value, axis=axis)


def test_good_axes_still_work(strategy: Any, backend: Any) -> None:
    good, _ = _values(strategy, backend)
    total = strategy.reduce("sum", good, axis=(np.int64(0), -1))
    np.testing.assert_array_equal(np.asarray(total), np.full(3, 16.0))
    assert tuple(strategy.gather(good, axis=np.int64(-1)).shape) == (2, 3, 8)


# --- assign / assign_add / assign_sub -------------------------------------------------------
def _variables(backend: Any) -> dict[str, Callable[[], Any]]:
    """Every kind of variable, made with `backend`'s values, by name."""
    mirrored = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    central = cd.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"])

    def under(strategy: Any, **kw: Any) -> Callable[[], Any]:
        def make() -> Any:
            with strategy.scope():
                return cd.Variable(backend.make(np.arange(2, dtype=np.float32)), **kw)

        return make

    return {
        "Variable": lambda: cd.Variable(backend.make(np.arange(2, dtype=np.float32))),
        "MirroredVariable": under(mirrored),
        "MirroredVariable-sum": under(mirrored, aggregation="sum"),
        "SyncOnReadVariable-sum": under(mirrored, synchronization="ON_READ", aggregation="sum"),
        "SyncOnReadVariable-mean": under(mirrored, synchronization="ON_READ", aggregation="mean"),
        "AggregatingVariable": under(central, aggregation="mean"),
    }


BAD_ASSIGNS = [
    ("abc", TypeError, r"received str: 'abc', of dtype <U3, which is not a number type"),
    (None, TypeError, r"received NoneType: None, of dtype object, which is not a number"),
    ([1, "a"], TypeError, r"received list: \[1, 'a'\], of dtype <U21"),
    ([[1, 2], [3]], TypeError, r"received list: \[\[1, 2\], \[3\]\], which is not an array"),
    (1 + 2j, TypeError, r"of dtype complex128, a higher kind than float32"),
    (np.ones(3), ValueError, r"received ndarray: array\(\[1., 1., 1.\]\), of shape \(3,\)"),
]
KINDS = [
    "Variable",
    "MirroredVariable",
    "MirroredVariable-sum",
    "SyncOnReadVariable-sum",
    "SyncOnReadVariable-mean",
    "AggregatingVariable",
]


def _components(v: Any) -> list[np.ndarray]:
    parts = v.values if hasattr(v, "values") else (v,)
    return [np.array(np.asarray(c._value), copy=True) for c in parts]


@pytest.mark.parametrize(("value", "error", "message"), BAD_ASSIGNS, ids=_ids(BAD_ASSIGNS))
@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
@pytest.mark.parametrize("kind", KINDS)
def test_bad_assign_names_the_variable_and_changes_nothing(
    backend: Any, kind: str, method: str, value: Any, error: Any, message: str
) -> None:
    v = _variables(backend)[kind]()
    before = _components(v)
    name = kind.split("-", maxsplit=1)[0]
    pattern = rf"^{name} 'Variable:0' \(dtype float32, shape \(2,\)\): {method} needs numbers"
    with pytest.raises(error, match=pattern) as caught:
        getattr(v, method)(value)
    assert re_search(message, str(caught.value))
    assert "nothing was changed" in str(caught.value)
    for old, new in zip(before, _components(v), strict=True):
        np.testing.assert_array_equal(old, new)


@pytest.mark.parametrize("kind", ["MirroredVariable-sum", "SyncOnReadVariable-mean"])
def test_bad_assign_in_a_replica_changes_nothing(backend: Any, kind: str) -> None:
    v = _variables(backend)[kind]()
    strategy = v.distribute_strategy
    before = _components(v)
    with pytest.raises(TypeError, match=r"assign_add needs numbers .* received str: 'abc'"):
        strategy.run(lambda: v.assign_add("abc"))
    for old, new in zip(before, _components(v), strict=True):
        np.testing.assert_array_equal(old, new)


def test_integer_variables_refuse_floats(backend: Any) -> None:
    v = cd.Variable(backend.make(np.zeros(2, np.int32)))
    with pytest.raises(TypeError, match="of dtype float64, a higher kind than int32"):
        v.assign_add(1.5)  # NumPy refused; torch's copy_ truncated to 1 silently
    np.testing.assert_array_equal(np.asarray(v.numpy()), [0, 0])


def test_good_assigns_still_work(backend: Any) -> None:
    for kind, make in _variables(backend).items():
        v = make()
        v.assign(backend.make(np.ones(2, np.float32)))
        if not kind.startswith("SyncOnReadVariable-sum"):  # TF: assign only, cross-replica
            v.assign_add(1)  # an int into a float variable: a lower kind
            v.assign_sub(np.float64(0.5))  # float64 into float32: the same kind
            np.testing.assert_array_equal(np.asarray(v.numpy()), [1.5, 1.5], kind)
        v.assign(True)  # bool: the lowest kind, one element
        np.testing.assert_array_equal(np.asarray(v.numpy()), [1.0, 1.0], kind)


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


# --- TF_CONFIG -----------------------------------------------------------------------------
@pytest.mark.parametrize("sign", ["", "-"])
def test_tf_config_task_index_of_5000_digits(monkeypatch: pytest.MonkeyPatch, sign: str) -> None:
    config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker"}}
    text = json.dumps(config)[:-2] + f', "index": {sign}{"9" * 5000}}}}}'
    monkeypatch.setenv("TF_CONFIG", text)
    message = (
        r"^TF_CONFIG's task index must be an integer >= 0 \(an int or ASCII digits\), got "
        rf"<an integer of 5000 digits: {sign}9+\.\.\.>"
    )
    with pytest.raises(ValueError, match=message):
        _ = cluster_resolver.TFConfigClusterResolver().task_id  # read when asked, as TF
    with pytest.raises(ValueError, match=message):
        cd.MultiWorkerMirroredStrategy()


def test_tf_config_given_as_a_dict_with_a_huge_index() -> None:
    from crossdevice._core.cluster import parse_tf_config

    config = {
        "cluster": {"worker": ["127.0.0.1:1"]},
        "task": {"type": "worker", "index": -(10**5000)},
    }
    with pytest.raises(ValueError, match=r"task index .* got <an int of about 5001 digits>"):
        parse_tf_config(config)
