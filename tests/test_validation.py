"""Every input gets a clear answer: the checks of `_core/validate.py` at each entry point.

Each case here did something else before the validation layer: summed strings
(`'a' + 'b'`), turned SUM of booleans into logical OR, raised NumPy's or Python's own
errors from inside a replica, or accepted NaN and infinite timeouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import crossdevice
from crossdevice import PerReplica
from crossdevice._core import validate

BAD_LEAVES = {
    "str-array": (np.array(["a"]), "of dtype <U1"),
    "python-str": ("a", r"a str \('a'\)"),
    "bytes": (b"a", "a bytes"),
    "object": (np.array([object()], dtype=object), "of dtype object"),
    "datetime": (np.array(["2020-01-01"], dtype="datetime64[D]"), r"of dtype datetime64\[D\]"),
    "timedelta": (np.array([1], dtype="timedelta64[s]"), r"of dtype timedelta64\[s\]"),
    "none": (None, "None"),
    "bool-array": (np.array([True, False]), "of dtype bool"),
    "python-bool": (True, "a Python bool"),
    "numpy-bool": (np.bool_(True), "of dtype bool"),
    "other-object": (object(), "an? object"),
}


@pytest.fixture
def strategy() -> crossdevice.MirroredStrategy:
    return crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])


@pytest.mark.parametrize("case", sorted(BAD_LEAVES))
def test_all_reduce_rejects_non_numeric_leaves_naming_path_and_dtype(
    strategy: crossdevice.MirroredStrategy, case: str
) -> None:
    leaf, described = BAD_LEAVES[case]

    def step() -> Any:
        value = {"loss": np.float32(1.0), "extra": [np.ones(2), leaf]}
        return crossdevice.replica_context().all_reduce("sum", value)

    pattern = rf"ReplicaContext\.all_reduce: .*the value\['extra'\]\[1\] is {described}"
    with pytest.raises(TypeError, match=pattern):
        strategy.run(step)


def test_bool_is_rejected_as_in_tf_with_the_cast_to_use(
    strategy: crossdevice.MirroredStrategy,
) -> None:
    def step() -> Any:
        return crossdevice.replica_context().all_reduce("mean", np.array([True, False]))

    with pytest.raises(TypeError, match=r"astype\(np\.int32\)"):
        strategy.run(step)
    # Cast, and the count is right (NumPy's bool sum would have been a logical OR).
    counts = strategy.run(
        lambda: crossdevice.replica_context().all_reduce(
            "sum", np.array([True, False]).astype(np.int32)
        )
    )
    assert [c.tolist() for c in strategy.experimental_local_results(counts)] == [[2, 0]] * 2


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda s, v: s.reduce("sum", v, axis=None), id="Strategy.reduce"),
        pytest.param(lambda s, v: s.reduce("mean", v, axis=0), id="Strategy.reduce-axis"),
        pytest.param(
            lambda s, v: s.extended.reduce_to("sum", v, destinations="CPU:0"),
            id="StrategyExtended.reduce_to",
        ),
        pytest.param(
            lambda s, v: s.extended.batch_reduce_to("sum", [(v, "CPU:0")]),
            id="StrategyExtended.batch_reduce_to",
        ),
        pytest.param(
            lambda s, v: crossdevice.ReductionToOneDevice().reduce("sum", v, destinations="CPU:0"),
            id="CrossDeviceOps.reduce",
        ),
        pytest.param(
            lambda s, v: crossdevice.HierarchicalCopyAllReduce().batch_reduce("sum", [(v, v)]),
            id="CrossDeviceOps.batch_reduce",
        ),
    ],
)
def test_cross_replica_reductions_reject_strings_per_replica(
    strategy: crossdevice.MirroredStrategy,
    call: Callable[[crossdevice.MirroredStrategy, Any], Any],
) -> None:
    value = PerReplica([np.array(["a"]), np.array(["b"])])  # summed to 'ab' before
    with pytest.raises(TypeError, match=r"only numbers are reduced.*\(replica 0\) is of dtype"):
        call(strategy, value)


def test_gathers_take_any_dtype(strategy: crossdevice.MirroredStrategy) -> None:
    gathered = strategy.gather(PerReplica([np.array(["a"]), np.array(["b"])]), axis=0)
    assert gathered.tolist() == ["a", "b"]


def test_numbers_of_every_kind_still_reduce(strategy: crossdevice.MirroredStrategy) -> None:
    value = {"f": np.float32(1), "i": np.arange(3), "u": np.uint8(2), "c": np.array([1j]), "p": 2}
    result = strategy.run(lambda: crossdevice.replica_context().all_reduce("sum", value))
    local = strategy.experimental_local_results(result)[0]
    assert float(local["f"]) == 2.0
    assert local["i"].tolist() == [0, 2, 4]
    assert int(local["u"]) == 4
    assert local["c"].tolist() == [2j]
    assert int(local["p"]) == 4


def test_run_and_merge_call_need_a_function(strategy: crossdevice.MirroredStrategy) -> None:
    with pytest.raises(TypeError, match=r"Strategy\.run needs a function to call, got NoneType"):
        strategy.run(None)  # type: ignore[arg-type]

    def step() -> None:
        crossdevice.replica_context().merge_call(None)  # type: ignore[arg-type]

    with pytest.raises(TypeError, match=r"ReplicaContext\.merge_call needs a function"):
        strategy.run(step)


@pytest.mark.parametrize(
    ("timeout", "message"),
    [
        (float("nan"), "got nan"),
        (float("inf"), r"at most 2592000 \(30 days\), got inf; pass None for no timeout"),
        (1e12, r"at most 2592000 \(30 days\)"),
        (-1, ">= 0"),
        ("5", "a number of seconds"),
        (True, "a number of seconds"),
    ],
)
def test_communication_options_reject_bad_timeouts(timeout: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        crossdevice.experimental.CommunicationOptions(timeout_seconds=timeout)


def test_communication_options_keep_good_timeouts() -> None:
    options = crossdevice.experimental.CommunicationOptions
    assert options(timeout_seconds=120).timeout_seconds == 120
    assert options(timeout_seconds=0).timeout_seconds is None  # 0 means no timeout
    assert options(timeout_seconds=validate.MAX_TIMEOUT_SECONDS).timeout_seconds is not None


def test_one_device_strategy_takes_one_device_string() -> None:
    with pytest.raises(
        TypeError, match=r"got a list \['CPU:0'\]; write OneDeviceStrategy\('CPU:0'\)"
    ):
        crossdevice.OneDeviceStrategy(["CPU:0"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="one device string"):
        crossdevice.OneDeviceStrategy(0)  # type: ignore[arg-type]


def test_device_scope_needs_an_existing_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from crossdevice._core import devices

    monkeypatch.setattr(devices, "num_gpus", lambda: 0)
    with pytest.raises(ValueError, match="No CUDA GPU is visible"):
        crossdevice.device("GPU:0")
    with pytest.raises(ValueError, match="write 'GPU:0', not 'cuda:0'"):
        crossdevice.device("cuda:0")
    with pytest.raises(ValueError, match="write 'GPU:1', not 'cuda:1'"):
        crossdevice.MirroredStrategy(["cuda:1"])
    with crossdevice.device("CPU:1") as name:
        assert name.endswith("device:CPU:1")


# --- distributed values must fit the strategy ------------------------------------------
def test_per_replica_with_the_wrong_number_of_components(
    strategy: crossdevice.MirroredStrategy,
) -> None:
    three = PerReplica([np.ones(2), np.ones(2), np.ones(2)])
    with pytest.raises(ValueError, match=r"has 3 components, but .* has 2 local replicas"):
        strategy.reduce("sum", three, axis=None)
    with pytest.raises(ValueError, match=r"Strategy\.run: the PerReplica at \[0\]\[0\]"):
        strategy.run(lambda x: x, args=(three,))  # TF silently dropped the third
    fine = PerReplica([np.ones(2), np.ones(2)])
    with pytest.raises(ValueError, match=r"Strategy\.run: the PerReplica at \[0\]\[2\]\['b'\]"):
        strategy.run(lambda *x: x, args=(fine, 1.0, {"a": fine, "b": three}))
    with pytest.raises(ValueError, match="has 3 components"):
        strategy.extended.batch_reduce_to("sum", [(three, "CPU:0")])
    with pytest.raises(ValueError, match="has 3 components"):
        strategy.gather(three, axis=0)


def test_a_variable_of_another_strategy_is_refused(strategy: crossdevice.MirroredStrategy) -> None:
    other = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
    with other.scope():
        v = crossdevice.Variable(1.0)
    with pytest.raises(ValueError, match=r"belongs to .*not to"):
        strategy.reduce("mean", v, axis=None)
    with pytest.raises(ValueError, match="belongs to"):
        strategy.extended.reduce_to("mean", v, "CPU:0")
    with other.scope():
        assert float(other.reduce("mean", v, axis=None)) == 1.0  # its own strategy: fine


def test_a_per_replica_value_of_another_strategy_is_refused(
    strategy: crossdevice.MirroredStrategy,
) -> None:
    other = crossdevice.MirroredStrategy(["CPU:2", "CPU:3"])
    theirs = other.experimental_distribute_values_from_function(lambda ctx: np.ones(2))
    with pytest.raises(ValueError, match=r"made by another strategy"):
        strategy.reduce("sum", theirs, axis=None)
    mine = PerReplica([np.ones(2), np.ones(2)])  # no devices given: any strategy's
    np.testing.assert_array_equal(other.reduce("sum", mine, axis=None), [2.0, 2.0])


def test_reduce_to_a_device_of_another_worker(strategy: crossdevice.MirroredStrategy) -> None:
    value = PerReplica([np.ones(2), np.ones(2)])
    with pytest.raises(ValueError, match=r"names job 'foo' task 3, but this worker is job"):
        strategy.extended.reduce_to("sum", value, "/job:foo/task:3/device:CPU:0")
    np.testing.assert_array_equal(
        strategy.extended.reduce_to("sum", value, "/job:localhost/task:0/device:CPU:1"),
        [2.0, 2.0],
    )


def test_reduction_to_one_device_needs_a_device_or_none() -> None:
    with pytest.raises(ValueError, match="empty string"):
        crossdevice.ReductionToOneDevice(reduce_to_device="")


def test_accumulation_fn_results_are_checked() -> None:
    ops = crossdevice.ReductionToOneDevice(accumulation_fn=np.sum)  # sums over every axis: a scalar
    value = PerReplica([np.ones(3), np.ones(3)])
    with pytest.raises(ValueError, match=r"of their shape \(3,\), but it returned shape \(\)"):
        ops.reduce("sum", value, destinations="CPU:0")
    good = crossdevice.ReductionToOneDevice(accumulation_fn=sum)
    np.testing.assert_array_equal(good.reduce("sum", value, destinations="CPU:0"), [2.0] * 3)


def test_torch_unsigned_types_torch_cannot_add(
    torch_module: Any, strategy: crossdevice.MirroredStrategy
) -> None:
    torch = torch_module

    def step() -> Any:
        return crossdevice.get_replica_context().all_reduce(
            "sum", torch.ones(2, dtype=torch.uint16)
        )

    with pytest.raises(TypeError, match=r"torch\.uint16, which torch cannot add.*torch\.int32"):
        strategy.run(step)


# --- the property: a malformed call is a documented error or the NumPy answer ------------
try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    pass
else:
    _LEAVES = st.sampled_from(
        [
            np.float32(1.5),
            np.arange(3.0),
            np.arange(3, dtype=np.int32),
            2,
            0.25,
            np.array(["a"]),
            None,
            True,
            np.array([1], dtype="datetime64[D]"),
            np.array([object()], dtype=object),
        ]
    )
    _NESTS = st.recursive(
        _LEAVES,
        lambda children: (
            st.lists(children, max_size=3)
            | st.dictionaries(st.sampled_from("abc"), children, max_size=3)
        ),
        max_leaves=5,
    )

    @settings(max_examples=60, deadline=None)
    @given(value=_NESTS, op=st.sampled_from(["sum", "mean"]))
    def test_malformed_reductions_raise_typeerror_or_match_numpy(value: Any, op: str) -> None:
        import copy

        import optree

        strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
        before = copy.deepcopy(value)
        leaves = optree.tree_leaves(value, none_is_leaf=True, namespace="crossdevice")
        bad = any(
            x is None
            or isinstance(x, bool)
            or (isinstance(x, np.ndarray) and x.dtype.kind not in "iufc")
            for x in leaves
        )

        def step() -> Any:
            return crossdevice.get_replica_context().all_reduce(op, value)

        if bad:
            with pytest.raises(TypeError, match=r"expected|cannot|reduce"):
                strategy.run(step)
        else:
            out = strategy.experimental_local_results(strategy.run(step))[0]
            expected = optree.tree_map(
                lambda x: np.asarray(x) * (2 if op == "sum" else 1),
                value,
                none_is_leaf=True,
                namespace="crossdevice",
            )
            for got, want in zip(
                optree.tree_leaves(out, namespace="crossdevice"),
                optree.tree_leaves(expected, namespace="crossdevice"),
                strict=True,
            ):
                np.testing.assert_allclose(np.asarray(got), want)
        # Inputs are never mutated.
        assert optree.tree_structure(value, none_is_leaf=True, namespace="crossdevice") == (
            optree.tree_structure(before, none_is_leaf=True, namespace="crossdevice")
        )
        for a, b in zip(
            optree.tree_leaves(value, none_is_leaf=True, namespace="crossdevice"),
            optree.tree_leaves(before, none_is_leaf=True, namespace="crossdevice"),
            strict=True,
        ):
            if isinstance(a, np.ndarray) and a.dtype.kind in "iufc":
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("initial", ["abc", np.array(["a", "b"]), np.array([object()])])
def test_variables_hold_numbers(initial: Any) -> None:
    with pytest.raises(TypeError, match="holds numbers or booleans"):
        crossdevice.Variable(initial)
    assert crossdevice.Variable(np.array([True])).numpy().dtype == np.bool_  # TF allows bool
