"""Issue 18: behaviours TensorFlow's own unit tests check, ported.

Each test names the TF test (or documented behaviour) it follows. TF file names are in
`tensorflow/python/distribute/`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice import cluster_resolver

#: Every single-worker strategy kind, as factories.
SINGLE_WORKER = [
    lambda: cd.MirroredStrategy(["CPU:0", "CPU:1"]),
    lambda: cd.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"]),
    lambda: cd.OneDeviceStrategy("CPU:0"),
    cd.get_strategy,
]
SINGLE_WORKER_IDS = ["mirrored", "central_storage", "one_device", "default"]


@pytest.fixture
def mirrored() -> Any:
    return cd.MirroredStrategy(["CPU:0", "CPU:1"])


def _replica_id() -> int:
    ctx = cd.get_replica_context()
    assert ctx is not None
    return int(ctx.replica_id_in_sync_group)


# --- bug 2: the default strategy's run and scope keep a replica context --------------------
def _assert_in_default_state() -> None:
    """TF `distribute_lib_test._assert_in_default_state`."""
    ctx = cd.get_replica_context()
    assert ctx is not None
    assert ctx.replica_id_in_sync_group == 0
    assert cd.get_cross_replica_context() is None
    assert not cd.in_cross_replica_context()
    assert not cd.has_strategy()


def test_default_strategy_run_gives_a_replica_context() -> None:
    """TF `DefaultDistributionStrategyTest.testRun`-style: fn runs in ReplicaContext(0)."""
    default = cd.get_strategy()

    def fn() -> Any:
        ctx = cd.get_replica_context()
        assert ctx is not None
        assert ctx.strategy is default
        assert ctx.replica_id_in_sync_group == 0
        assert ctx.num_replicas_in_sync == 1
        assert not cd.in_cross_replica_context()
        summed = ctx.all_reduce("sum", {"a": np.float32(3.0), "b": [np.arange(2.0)]})
        gathered = ctx.all_gather(np.arange(3.0), axis=0)
        merged = ctx.merge_call(lambda strategy, s: (strategy, "foo_" + s), args=("bar",))
        return summed, gathered, merged

    summed, gathered, merged = default.run(fn)
    assert float(summed["a"]) == 3.0
    np.testing.assert_array_equal(summed["b"][0], [0.0, 1.0])
    np.testing.assert_array_equal(gathered, [0.0, 1.0, 2.0])
    assert merged == (default, "foo_bar")
    _assert_in_default_state()


def test_default_strategy_scope_stays_in_the_default_replica_context() -> None:
    """TF `DefaultDistributionStrategyTest.testScope`: no cross-replica context pushed."""
    default = cd.get_strategy()
    _assert_in_default_state()
    with default.scope() as entered:
        assert entered is default
        _assert_in_default_state()
        assert cd.get_strategy() is default
        ctx = cd.get_replica_context()
        assert ctx is not None
        assert float(ctx.all_reduce("mean", np.float32(2.0))) == 2.0
        assert ctx.merge_call(lambda strategy: strategy) is default
        v = cd.Variable(1.0)
        assert type(v) is cd.Variable
        assert float(default.reduce("sum", np.float32(4.0), axis=None)) == 4.0
        assert float(default.run(lambda: cd.get_replica_context().all_reduce("sum", 1.0))) == 1.0
    _assert_in_default_state()


def test_default_strategy_merge_fn_is_cross_replica() -> None:
    """TF `DefaultDistributionStrategyTest.testMergeCall`, inside `run`."""
    default = cd.get_strategy()

    def merge_fn(strategy: Any, s: str) -> str:
        assert strategy is default
        assert cd.get_replica_context() is None
        assert cd.get_cross_replica_context() is default
        assert cd.in_cross_replica_context()
        assert not cd.has_strategy()
        return "foo_" + s

    def fn() -> str:
        ctx = cd.get_replica_context()
        assert ctx is not None
        return str(ctx.merge_call(merge_fn, args=("bar",)))

    assert default.run(fn) == "foo_bar"


def test_default_scope_inside_another_strategy_is_an_error(mirrored: Any) -> None:
    """TF: "Must not nest tf.distribute.Strategy scopes." (checked against TF 2.21)."""
    default = cd.get_strategy()
    with mirrored.scope():
        with pytest.raises(RuntimeError, match="Must not nest"), default.scope():
            pass
        with pytest.raises(RuntimeError, match="Must not nest"):
            default.run(lambda: None)
    _assert_in_default_state()


@pytest.mark.parametrize("mode", ["threads", "cooperative"])
@pytest.mark.parametrize("make", SINGLE_WORKER[:3], ids=SINGLE_WORKER_IDS[:3])
def test_other_strategy_inside_default_scope_creates_no_variables(make: Any, mode: str) -> None:
    """TF `DefaultDistributionStrategyTest.testScopeMostlyNoOp`: another strategy's scope
    may be entered inside the default one's, but a variable created there is "Mixing
    different ... Strategy objects"; so is one created in a run or merge_fn started there
    (checked against TF 2.21); after the default scope, creating works again."""
    from tests.strategies.conftest import replica_execution

    strategy = make()

    def mixing() -> Any:
        return pytest.raises(RuntimeError, match=r"^Mixing different crossdevice\.Strategy")

    def merge() -> Any:
        return cd.get_replica_context().merge_call(lambda s: cd.Variable(2.0))

    scope = cd.get_strategy().scope()
    with replica_execution(mode), scope:
        _assert_in_default_state()
        with strategy.scope():
            assert cd.get_cross_replica_context() is strategy
            with mixing():
                cd.Variable(1.0, name="error")
        with scope:  # the same scope again, nested
            _assert_in_default_state()
            with strategy.scope(), mixing():
                cd.Variable(1.0, name="also_error")
        with mixing():
            strategy.run(lambda: cd.Variable(1.0))
        with mixing():
            strategy.run(merge)
        assert type(cd.Variable(1.0)) is cd.Variable  # the default strategy's own: fine
    _assert_in_default_state()
    with strategy.scope():
        assert cd.Variable(1.0, name="after").name == "after:0"
    assert strategy.run(lambda: cd.Variable(3.0, name="in_run")).name == "in_run:0"


# --- bug 4: CentralStorage returns a variable made inside run --------------------------------
def test_central_storage_variable_created_in_run() -> None:
    """TF `central_storage_strategy_test`: replicas share one variable, created once."""
    strategy = cd.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"])

    def fn() -> Any:
        return cd.Variable(np.float32(_replica_id() + 5.0), name="w")

    v = strategy.run(fn)
    assert strategy.extended.variable_created_in_scope(v)
    assert v.name == "w:0"
    assert float(v.numpy()) == 5.0  # replica 0's initial value, as TF
    assert v.device == strategy.extended.parameter_devices[0]


def test_regroup_of_distributed_variables_from_different_replicas(mirrored: Any) -> None:
    """A distributed variable per replica regroups as a PerReplica (no AttributeError)."""
    with mirrored.scope():
        a, b = cd.Variable(1.0), cd.Variable(2.0)
    result = mirrored.run(lambda: a if _replica_id() == 0 else b)
    assert isinstance(result, cd.PerReplica)
    assert result.values == (a, b)


# --- bug 5: next(iterator) inside run ---------------------------------------------------------
def test_next_inside_run_is_an_error(mirrored: Any) -> None:
    """TF `input_lib`: get_next "should be called from outside of replica_fn"."""
    iterator = iter(mirrored.experimental_distribute_dataset([np.arange(4.0)] * 2))
    with pytest.raises(ValueError, match="outside of replica_fn"):
        mirrored.run(lambda: next(iterator))
    with pytest.raises(ValueError, match="outside of replica_fn"):
        mirrored.run(iterator.get_next)
    with pytest.raises(ValueError, match="outside of replica_fn"):
        mirrored.run(iterator.get_next_as_optional)
    # The failed calls consumed nothing: both steps are still there.
    assert len(list(iterator)) == 2


def test_next_inside_run_from_a_function_dataset(mirrored: Any) -> None:
    dist = mirrored.distribute_datasets_from_function(lambda ctx: [np.arange(2.0)] * 4)
    iterator = iter(dist)
    with pytest.raises(ValueError, match="outside of replica_fn"):
        mirrored.run(lambda: next(iterator))


# --- bug 6: ON_READ variables are not trainable by default -----------------------------------
@pytest.mark.parametrize("make", SINGLE_WORKER, ids=SINGLE_WORKER_IDS)
def test_on_read_variables_default_to_not_trainable(make: Any) -> None:
    """TF `variables.validate_synchronization_aggregation_trainable`."""
    strategy = make()
    on_read = cd.VariableSynchronization.ON_READ
    with strategy.scope():
        assert not cd.Variable(1.0, synchronization=on_read, aggregation="sum").trainable
        assert cd.Variable(1.0, synchronization=on_read, trainable=True).trainable
        assert cd.Variable(1.0).trainable
        assert not cd.Variable(1.0, trainable=False).trainable
    assert not cd.Variable(1.0, synchronization=on_read).trainable


def test_on_read_variable_created_in_run_is_not_trainable(mirrored: Any) -> None:
    def fn() -> Any:
        return cd.Variable(1.0, synchronization="ON_READ", aggregation="SUM")

    assert not mirrored.run(fn).trainable


# --- bug 7: variables created in replica context --------------------------------------------
@pytest.mark.parametrize("mode", ["threads", "cooperative"])
def test_variable_created_in_run_takes_replica_0s_name(mode: str) -> None:
    """TF `mirrored_strategy_test.testNameScope...`: replica 0 creates, the others reuse."""
    from tests.strategies.conftest import replica_execution

    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])

    def fn() -> Any:
        r = _replica_id()
        return cd.Variable(np.float32(r + 1), name="v", trainable=r == 0, aggregation="sum")

    with replica_execution(mode):
        v = strategy.run(fn)
    assert isinstance(v, cd.MirroredVariable)
    assert v.name == "v:0"
    assert [c.name for c in v.values] == ["v:0", "v/replica_1:0", "v/replica_2:0"]
    assert [float(c.numpy()) for c in v.values] == [1.0, 1.0, 1.0]
    assert v.trainable  # replica 0's argument
    assert v.aggregation == cd.VariableAggregation.SUM


@pytest.mark.parametrize("mode", ["threads", "cooperative"])
def test_variable_names_must_match_across_replicas(mode: str) -> None:
    """TF `shared_variable_creator`: "Tried to create variable ... with mismatching name"."""
    from tests.strategies.conftest import replica_execution

    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])

    def fn() -> Any:
        return cd.Variable(1.0, name=f"v{_replica_id()}")

    with replica_execution(mode), pytest.raises(RuntimeError, match="mismatching name"):
        strategy.run(fn)
    # The strategy is still usable afterwards.
    assert strategy.run(lambda: cd.Variable(2.0, name="ok")).name == "ok:0"


@pytest.mark.parametrize("mode", ["threads", "cooperative"])
def test_variable_names_match_up_to_uniquifying_suffixes(mode: str) -> None:
    """TF `shared_variable_creator`: names match after dropping `_<n>`, so replicas naming
    a variable `"foo_" + str(replica_id)` make one MirroredVariable named after replica 0's
    (checked against TF 2.21: `foo_0:0`, components `foo_0/replica_<i>:0`)."""
    from tests.strategies.conftest import replica_execution

    strategy = cd.MirroredStrategy([f"CPU:{i}" for i in range(12)])

    def fn() -> Any:
        r = _replica_id()
        return cd.Variable(np.float32(r + 1), name="foo_" + str(r))

    with replica_execution(mode):
        v = strategy.run(fn)
        inner = strategy.run(lambda: cd.Variable(0.0, name=f"block_{_replica_id()}/w_3"))
    assert isinstance(v, cd.MirroredVariable)
    assert v.name == "foo_0:0"
    assert [c.name for c in v.values[:3]] == ["foo_0:0", "foo_0/replica_1:0", "foo_0/replica_2:0"]
    assert [float(c.numpy()) for c in v.values] == [1.0] * 12  # replica 0's initial value
    assert inner.name == "block_0/w_3:0"


def test_central_storage_variable_names_must_match() -> None:
    strategy = cd.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"])
    with pytest.raises(RuntimeError, match="mismatching name"):
        strategy.run(lambda: cd.Variable(1.0, name=f"v{_replica_id()}"))


# --- bug 8: aggregation=None means NONE -------------------------------------------------------
def test_aggregation_none_means_none(mirrored: Any) -> None:
    """TF `variables.validate_synchronization_aggregation_trainable`: None → NONE/AUTO."""
    v = cd.Variable(1.0, aggregation=None, synchronization=None)
    assert v.aggregation == cd.VariableAggregation.NONE
    assert v.synchronization == cd.VariableSynchronization.AUTO
    with mirrored.scope():
        mv = cd.Variable(1.0, aggregation=None, synchronization=None)
    assert isinstance(mv, cd.MirroredVariable)
    assert mv.aggregation == cd.VariableAggregation.NONE
    # TF resolves AUTO under a mirroring strategy: the variable and its components say
    # ON_WRITE (TF 2.21; code testing `== ON_WRITE` ports).
    assert mv.synchronization == cd.VariableSynchronization.ON_WRITE
    assert mv.values[0].synchronization == cd.VariableSynchronization.ON_WRITE
    replica_made = mirrored.run(lambda: cd.Variable(1.0, name="made_in_run"))
    assert replica_made.synchronization == cd.VariableSynchronization.ON_WRITE


# --- bug 9: differently structured results raise AssertionError ------------------------------
@pytest.mark.parametrize(
    "results",
    [([1.0], (1.0,)), ([1.0], [1.0, 2.0]), ({"a": 1.0}, {"b": 1.0})],
    ids=["list_vs_tuple", "lengths", "keys"],
)
def test_replicas_returning_different_structures(mirrored: Any, results: Any) -> None:
    """TF `distribute_utils.regroup` asserts; our error is both AssertionError and ValueError."""
    with pytest.raises(AssertionError, match="different structures") as info:
        mirrored.run(lambda: results[_replica_id()])
    assert isinstance(info.value, ValueError)


# --- bug 10: converting a PerReplica outside a replica context -------------------------------
def test_per_replica_to_array_outside_replica_context(mirrored: Any) -> None:
    """TF `values_test.testToTensorOutsideReplicaContext`-style: a clear ValueError."""
    per_replica = mirrored.run(lambda: np.float32(_replica_id()))
    assert isinstance(per_replica, cd.PerReplica)
    with pytest.raises(ValueError, match="not inside a replica context"):
        np.asarray(per_replica, np.float32)
    with pytest.raises(ValueError, match="not inside a replica context"):
        np.add(per_replica, 1)


def test_per_replica_to_array_inside_replica_context(mirrored: Any) -> None:
    per_replica = cd.PerReplica([np.float32(3.0), np.float32(4.0)])
    result = mirrored.run(lambda x: np.asarray(x, np.float64) + 0, args=(per_replica,))
    assert mirrored.experimental_local_results(result) == (3.0, 4.0)
    seen = mirrored.run(lambda: float(np.asarray(per_replica)))
    assert mirrored.experimental_local_results(seen) == (3.0, 4.0)


# --- feature 1 and 2: cluster_resolver ---------------------------------------------------------
@pytest.mark.parametrize("make", SINGLE_WORKER, ids=SINGLE_WORKER_IDS)
def test_cluster_resolver_is_none_for_single_worker_strategies(make: Any) -> None:
    """TF `strategy_common_test.testClusterResolverProperty`."""
    assert make().cluster_resolver is None


def test_multi_worker_cluster_resolver_local_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """TF `strategy_common_test.testClusterResolverProperty`: TF's methods, stable in scope."""
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    strategy = cd.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    with strategy.scope():
        assert strategy.cluster_resolver is resolver
    for name in ("cluster_spec", "master", "num_accelerators", "task_id", "task_type"):
        assert hasattr(resolver, name)
    # TF 2.21 in local mode: TFConfigClusterResolver with no task and an empty spec.
    assert (resolver.task_type, resolver.task_id) == (None, None)
    assert resolver.cluster_spec().as_dict() == {}
    assert resolver.master() == ""
    assert resolver.num_accelerators() == {}  # no GPU on this host


def test_multi_worker_cluster_resolver_is_the_given_one() -> None:
    given = cluster_resolver.SimpleClusterResolver(cluster_resolver.ClusterSpec({}))
    assert cd.MultiWorkerMirroredStrategy(cluster_resolver=given).cluster_resolver is given


def test_resolver_for_a_cluster() -> None:
    """The resolver describing a `Cluster` (TF_CONFIG or torchrun) speaks TF's API."""
    from crossdevice._core.cluster import Cluster

    jobs = (("chief", ("h0:2222",)), ("worker", ("h1:2222",)))
    cluster = Cluster("worker", 0, 1, 2, "h0", 2222, jobs=jobs)  # task, rank, rendezvous
    resolver = cluster_resolver.resolver_for_cluster(cluster)
    assert resolver.cluster_spec().as_dict() == {"chief": ["h0:2222"], "worker": ["h1:2222"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 0)
    assert resolver.master() == "h1:2222"
    assert resolver.master("chief", 0, rpc_layer="grpc") == "grpc://h0:2222"
    assert resolver.num_accelerators() == {}
    assert resolver.num_accelerators("worker", 0) == {}
    torchrun = Cluster("worker", 1, 1, 3, "10.0.0.1", 29500, source="torchrun")
    spec = cluster_resolver.resolver_for_cluster(torchrun).cluster_spec()
    assert spec.num_tasks("worker") == 3
    assert spec.task_address("worker", 0) == "10.0.0.1:29500"
    local = cluster_resolver.resolver_for_cluster(None)
    assert local.cluster_spec().as_dict() == {}
    assert (local.task_type, local.task_id) == (None, None)


# --- feature 3: distribute_strategy ------------------------------------------------------------
def test_distribute_strategy_property(mirrored: Any) -> None:
    """TF `values.DistributedVariable.distribute_strategy`."""
    with mirrored.scope():
        mv = cd.Variable(1.0)
        sv = cd.Variable(1.0, synchronization="ON_READ", aggregation="SUM")
    assert mv.distribute_strategy is mirrored
    assert sv.distribute_strategy is mirrored
    central = cd.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"])
    with central.scope():
        av = cd.Variable(1.0)
    assert av.distribute_strategy is central


# --- feature 5: bitwise operators and three-argument pow --------------------------------------
def test_bitwise_operators_are_forwarded(mirrored: Any) -> None:
    """TF `values.DistributedDelegate`: & | ^ ~ and pow(x, y, mod) reach the local value."""
    x = np.array([5, 6], np.int32)
    mirrored_value = cd.Mirrored([x, x.copy()])
    with mirrored.scope():
        variable = cd.Variable(x)
    for value in (mirrored_value, variable):
        np.testing.assert_array_equal(value & 3, x & 3)
        np.testing.assert_array_equal(3 & value, 3 & x)
        np.testing.assert_array_equal(value | 8, x | 8)
        np.testing.assert_array_equal(8 | value, 8 | x)
        np.testing.assert_array_equal(value ^ 1, x ^ 1)
        np.testing.assert_array_equal(1 ^ value, 1 ^ x)
        np.testing.assert_array_equal(~value, ~x)
        np.testing.assert_array_equal(pow(value, 2, 7), (x**2) % 7)
        np.testing.assert_array_equal(pow(value, 2), x**2)
    assert pow(cd.Mirrored([5, 5]), 2, 3) == 1  # Python ints: the built-in pow


# --- review p05/p14: distributed variables' aggregation rules, as TF 2.21 applies them ---
MIRRORED_KINDS = [
    lambda: cd.MirroredStrategy(["CPU:0"]),
    lambda: cd.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"]),
    cd.MultiWorkerMirroredStrategy,
]
MIRRORED_IDS = ["mirrored1", "mirrored3", "multi_worker"]


@pytest.mark.parametrize("sync", ["on_write", "on_read", "auto"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_, np.complex64])
@pytest.mark.parametrize("make", MIRRORED_KINDS, ids=MIRRORED_IDS)
def test_mean_of_a_non_floating_distributed_variable_is_refused(
    make: Any, dtype: Any, sync: str
) -> None:
    # TF values.DistributedVariable: "creating distributed tf.Variable with
    # aggregation=MEAN and a non-floating dtype is not supported" (any replica count).
    with make().scope(), pytest.raises(ValueError, match="aggregation=MEAN and a non-floating"):
        cd.Variable(np.zeros(2, dtype), synchronization=sync, aggregation="mean")


@pytest.mark.parametrize("make", SINGLE_WORKER[1:], ids=SINGLE_WORKER_IDS[1:])
def test_mean_of_an_integer_variable_is_accepted_where_tf_accepts_it(make: Any) -> None:
    # CentralStorage, OneDevice and the default strategy make no DistributedVariable in
    # TF (AggregatingVariable or a plain one): TF accepts MEAN there.
    with make().scope():
        for sync in ("on_write", "on_read"):
            v = cd.Variable(np.int32(1), synchronization=sync, aggregation="mean")
            assert int(v.numpy()) == 1


@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
@pytest.mark.parametrize("make", MIRRORED_KINDS, ids=MIRRORED_IDS)
def test_cross_replica_update_of_an_on_read_none_variable_is_refused(
    make: Any, method: str
) -> None:
    # TF 2.21: "Could not convert from `tf.VariableAggregation` VariableAggregationV2.NONE
    # to `tf.distribute.ReduceOp` type" for all three, with any number of replicas.
    strategy = make()
    with strategy.scope():
        v = cd.Variable(np.float32(1.0), synchronization="on_read", aggregation="none")
    with pytest.raises(ValueError, match=r"VariableAggregation\.NONE to a reduce op") as info:
        getattr(v, method)(np.float32(3.0))
    assert "strategy.run" in str(info.value)
    assert [float(c.numpy()) for c in v.values] == [1.0] * len(v.values)  # nothing applied
    # Inside a replica (and in extended.update) each component is its own: allowed.
    strategy.run(lambda: getattr(v, method)(np.float32(2.0)))
    strategy.extended.update(v, lambda c: c.assign(np.float32(5.0)))
    assert [float(c.numpy()) for c in v.values] == [5.0] * len(v.values)


@pytest.mark.parametrize(
    ("replicas", "value", "components"),
    [
        (1, 7, [7]),  # TF: [7] (ours raised TypeError)
        (2, 4, [2, 2]),  # TF: [2, 2]
        (3, 6, [2, 2, 2]),  # TF: [2, 2, 2]
        (3, 7, [3, 2, 2]),  # TF: [2, 2, 2], which reads back as 6: we keep the remainder
        (3, -7, [-2, -2, -3]),  # TF: [-2, -2, -2], read -6
    ],
)
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_cross_replica_assign_of_an_integer_sum_variable(
    replicas: int, value: int, components: list[int], dtype: Any
) -> None:
    strategy = cd.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    with strategy.scope():
        v = cd.Variable(dtype(0), synchronization="on_read", aggregation="sum")
    v.assign(value)
    assert [int(c.numpy()) for c in v.values] == components
    assert all(c.numpy().dtype == dtype for c in v.values)
    assert int(v.numpy()) == value


@pytest.mark.parametrize("make", SINGLE_WORKER[1:], ids=SINGLE_WORKER_IDS[1:])
def test_integer_sum_variable_assign_on_single_replica_strategies(make: Any) -> None:
    # TF: OneDevice, default and CentralStorage all give back 7.
    with make().scope():
        v = cd.Variable(np.int32(0), synchronization="on_read", aggregation="sum")
    v.assign(7)
    assert int(v.numpy()) == 7


def test_float_sum_variable_assign_divides_as_tf_does() -> None:
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        v = cd.Variable(np.float32(0.0), synchronization="on_read", aggregation="sum")
    v.assign(5)  # TF: [2.5, 2.5], read 5.0
    assert [float(c.numpy()) for c in v.values] == [2.5, 2.5]
    assert float(v.numpy()) == 5.0


# --- review p07/p19: colocate_vars_with's scope, non_slot_devices and update_non_slot ------
EVERY_KIND = [*SINGLE_WORKER, cd.MultiWorkerMirroredStrategy]
EVERY_KIND_IDS = [*SINGLE_WORKER_IDS, "multi_worker"]


@pytest.mark.parametrize(
    "make", [m for m, i in zip(EVERY_KIND, EVERY_KIND_IDS, strict=True) if i != "default"]
)
def test_colocate_vars_with_needs_the_strategy_scope(make: Any) -> None:
    # TF: RuntimeError 'Need to be inside "with strategy.scope()" for ...'.
    strategy = make()
    with strategy.scope():
        v = cd.Variable(1.0)
    outside = r'Need to be inside "with strategy\.scope\(\)"'
    with pytest.raises(RuntimeError, match=outside), strategy.extended.colocate_vars_with(v):
        pass
    other = cd.MirroredStrategy(["CPU:0"])
    with (
        other.scope(),
        pytest.raises(RuntimeError, match="in the scope"),
        strategy.extended.colocate_vars_with(v),
    ):
        pass
    with strategy.scope(), strategy.extended.colocate_vars_with(v):
        w = cd.Variable(2.0)
    assert type(w) is type(v)


def test_the_default_strategy_colocates_with_any_variable() -> None:
    v = cd.Variable(1.0)  # TF's default strategy checks neither scope nor variable
    with cd.get_strategy().extended.colocate_vars_with(v):
        w = cd.Variable(2.0)
    assert float(w.numpy()) == 2.0


@pytest.mark.parametrize("make", EVERY_KIND, ids=EVERY_KIND_IDS)
def test_update_non_slot_as_tf(make: Any) -> None:
    strategy = make()
    extended = strategy.extended
    with strategy.scope():
        a = cd.Variable(1.0, name="b_var")
        b = cd.Variable(2.0, name="a_var")
    devices = extended.non_slot_devices([a, b])
    if isinstance(devices, tuple):  # Mirrored, MultiWorkerMirrored and OneDevice: devices
        assert devices == extended.worker_devices
        calls = len(devices)
    else:  # the default strategy and CentralStorage: the variable that sorts first
        assert devices is b
        calls = 1
    # TF: `update_non_slot(non_slot_devices([v]), lambda: 5)` is 5; with group=False (5,).
    assert extended.update_non_slot(devices, lambda: 5) == 5
    assert extended.update_non_slot(devices, lambda: 5, group=False) == (5,)
    assert extended.update_non_slot(devices, lambda x, y=0: x + y, args=(1,), kwargs={"y": 2}) == 3
    result = extended.update_non_slot(devices, lambda: np.array(3.0))
    local = strategy.experimental_local_results(result)
    assert [float(x) for x in local] == [3.0] * calls
    assert type(result) is (cd.Mirrored if calls > 1 else np.ndarray)
    each = extended.update_non_slot(devices, lambda: np.array(3.0), group=False)
    assert type(each) is tuple
    assert len(each) == calls
    # Each call runs in an update context: a variable's update reaches every component.
    extended.update_non_slot(devices, lambda: a.assign_add(1.0))
    assert [float(c.numpy()) for c in strategy.experimental_local_results(a)] == [2.0] * len(
        strategy.experimental_local_results(a)
    )
    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(lambda: extended.update_non_slot(devices, lambda: 5))


def test_update_non_slot_splits_per_replica_arguments() -> None:
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    extended = strategy.extended
    devices = extended.non_slot_devices([])
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float64(ctx.replica_id_in_sync_group + 1)
    )
    result = extended.update_non_slot(devices, lambda x: x * 2, args=(value,))
    assert [float(x) for x in strategy.experimental_local_results(result)] == [2.0, 4.0, 6.0]
    part = extended.update_non_slot(devices[1:], cd.get_replica_context)
    assert part is None  # an update context is no replica context (TF)
    with pytest.raises(ValueError, match="what non_slot_devices\\(\\) returned") as info:
        extended.update_non_slot(strategy.extended.worker_devices[0], lambda: 5)
    assert "CPU:2" in str(info.value)
    with pytest.raises(ValueError, match="non_slot_devices"):
        extended.update_non_slot(("CPU:3",), lambda: 5)
