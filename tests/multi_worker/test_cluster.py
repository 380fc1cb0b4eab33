"""Cluster descriptions: TF_CONFIG, torchrun's environment, the resolvers (no processes)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from crossdevice import cluster_resolver
from crossdevice._core.cluster import (
    Cluster,
    cluster_from_resolver,
    cluster_from_spec,
    parse_tf_config,
    parse_torchrun_env,
    resolve_cluster,
    split_address,
)

CHIEF_CLUSTER = {"chief": ["h0:2222"], "worker": ["h1:2223", "h2:2224"]}


def tf_config(cluster: dict[str, Any], task_type: str, index: int, **extra: Any) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}, **extra})


TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
}


# -- TF_CONFIG ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task_type", "index", "rank"), [("chief", 0, 0), ("worker", 0, 1), ("worker", 1, 2)]
)
def test_tf_config_ranks_chief_first(task_type: str, index: int, rank: int) -> None:
    cluster = parse_tf_config(tf_config(CHIEF_CLUSTER, task_type, index))
    assert cluster == Cluster(
        task_type=task_type,
        task_id=index,
        rank=rank,
        world_size=3,
        master_addr="h0",
        master_port=2222,
        source="tf_config",
        jobs=(("chief", ("h0:2222",)), ("worker", ("h1:2223", "h2:2224"))),
    )
    assert cluster.is_chief == (rank == 0)
    assert cluster.num_workers == 3
    assert cluster.init_method == "tcp://h0:2222"


def test_tf_config_without_chief_makes_worker_0_the_master() -> None:
    config = tf_config({"worker": ["a:1", "b:2"], "ps": ["p:3"], "evaluator": ["e:4"]}, "worker", 1)
    cluster = parse_tf_config(config)
    assert cluster is not None
    assert (cluster.rank, cluster.world_size, cluster.master, cluster.is_chief) == (
        1,
        2,
        "a:1",
        False,
    )


@pytest.mark.parametrize(
    "config", [None, "", "  ", "{}", '{"cluster": {}}', '{"cluster": {"worker": []}}']
)
def test_no_cluster_is_local_mode(config: str | None) -> None:
    assert parse_tf_config(config) is None


def test_tf_config_as_dict_and_ipv6_master() -> None:
    cluster = parse_tf_config(
        {"cluster": {"worker": ["[::1]:5000"]}, "task": {"type": "worker", "index": "0"}}
    )
    assert cluster is not None
    assert (cluster.master_addr, cluster.master_port, cluster.master) == ("::1", 5000, "[::1]:5000")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("not json", "TF_CONFIG must be a JSON object"),
        ("[1, 2]", "TF_CONFIG must be a JSON object"),
        (json.dumps({"cluster": {"worker": ["a:1"]}}), "needs this task's type and index"),
        (
            tf_config({"worker": ["a:1"]}, "worker", 1),
            "of job 'worker', which has 1 task.*got task index 1",
        ),
        (
            tf_config({"worker": ["a:1"]}, "chief", 0),
            "of job 'chief', which has 0 task.*got task index 0",
        ),
        (
            tf_config({"worker": ["a:1"], "evaluator": ["e:1"]}, "evaluator", 0),
            "got task type 'evaluator'",
        ),
        (tf_config({"chief": ["a:1", "b:2"]}, "chief", 0), "at most one chief"),
        (tf_config({"worker": {"0": "a:1", "2": "c:3"}}, "worker", 0), "without holes"),
        (tf_config({"ps": ["p:1"]}, "ps", 0), "no 'chief' or 'worker' job"),
        (tf_config({"worker": ["nohost"]}, "worker", 0), "expected a task address 'host:port'"),
        (tf_config({"worker": ["a:99999"]}, "worker", 0), "port in 1..65535"),
        (tf_config({"worker": "a:1"}, "worker", 0), "must list its task addresses"),
        (json.dumps({"cluster": {"worker": ["a:1"]}, "task": "worker"}), "'task' must be"),
        (
            json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "x"}}),
            "must be an integer",
        ),
    ],
)
def test_bad_tf_config_says_what_to_do(config: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_tf_config(config)
    assert "got" in str(info.value)


@pytest.mark.parametrize(
    ("address", "expected"),
    [("h:1", ("h", 1)), ("10.0.0.1:29500", ("10.0.0.1", 29500)), ("[fe80::1]:80", ("fe80::1", 80))],
)
def test_split_address(address: str, expected: tuple[str, int]) -> None:
    assert split_address(address) == expected


@pytest.mark.parametrize("address", ["h", ":1", "h:", "h:0", "::1:80", "h:x", ""])
def test_split_address_rejects(address: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        split_address(address)


# -- torchrun ----------------------------------------------------------------------------


def test_torchrun_env() -> None:
    cluster = parse_torchrun_env(TORCHRUN)
    assert cluster == Cluster(
        task_type="worker",
        task_id=1,
        rank=1,
        world_size=4,
        master_addr="10.0.0.1",
        master_port=29500,
        local_rank=1,
        local_world_size=2,
        source="torchrun",
    )
    assert cluster.init_method == "tcp://10.0.0.1:29500"


def test_torchrun_env_defaults_local_rank() -> None:
    env = {k: v for k, v in TORCHRUN.items() if not k.startswith("LOCAL")}
    cluster = parse_torchrun_env(env)
    assert cluster is not None
    assert (cluster.local_rank, cluster.local_world_size) == (0, 1)


def test_no_torchrun_env() -> None:
    assert parse_torchrun_env({"LOCAL_RANK": "0", "PATH": "/bin"}) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"MASTER_PORT": ""}, r"incomplete: .* \['MASTER_PORT'\] are not"),
        ({"RANK": "one"}, "RANK must be an integer >= 0 \\(an int or ASCII digits\\), got 'one'"),
        ({"RANK": "4"}, r"rank must be in \[0, 4\)"),
        ({"WORLD_SIZE": "0"}, "world_size must be >= 1"),
        ({"MASTER_PORT": "70000"}, "master_port must be in 1..65535"),
        ({"LOCAL_RANK": "2"}, r"local_rank must be in \[0, 2\)"),
    ],
)
def test_bad_torchrun_env(change: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_torchrun_env({**TORCHRUN, **change})


# -- resolve_cluster ---------------------------------------------------------------------


def test_resolve_prefers_tf_config_and_takes_local_rank_from_torchrun() -> None:
    env = {
        **TORCHRUN,
        "RANK": "2",
        "WORLD_SIZE": "3",
        "TF_CONFIG": tf_config(CHIEF_CLUSTER, "worker", 1),
    }
    cluster = resolve_cluster(env)
    assert cluster is not None
    assert (cluster.source, cluster.rank, cluster.master, cluster.local_rank) == (
        "tf_config",
        2,
        "h0:2222",
        1,
    )


def test_resolve_rejects_disagreement() -> None:
    env = {**TORCHRUN, "TF_CONFIG": tf_config(CHIEF_CLUSTER, "worker", 1)}
    with pytest.raises(ValueError, match="TF_CONFIG makes this worker rank 2 of 3 but torchrun"):
        resolve_cluster(env)


def test_resolve_falls_back() -> None:
    assert resolve_cluster({}) is None
    assert resolve_cluster(dict(TORCHRUN)) == parse_torchrun_env(TORCHRUN)
    assert resolve_cluster({"TF_CONFIG": tf_config(CHIEF_CLUSTER, "chief", 0)}) is not None


def test_cluster_from_spec_accepts_sparse_dicts_without_holes() -> None:
    cluster = cluster_from_spec({"worker": {1: "b:2", 0: "a:1"}}, "worker", 1)
    assert cluster is not None
    assert (cluster.rank, cluster.master) == (1, "a:1")


# -- resolvers ---------------------------------------------------------------------------


def test_cluster_spec_api() -> None:
    spec = cluster_resolver.ClusterSpec({"worker": ["a:1", "b:2"], "ps": {3: "p:3"}})
    assert spec.as_dict() == {"worker": ["a:1", "b:2"], "ps": {3: "p:3"}}
    assert spec.jobs == ["ps", "worker"]
    assert (spec.num_tasks("worker"), spec.task_indices("ps")) == (2, [3])
    assert spec.task_address("worker", 1) == "b:2"
    assert spec.job_tasks("ps") == [None, None, None, "p:3"]
    assert spec == cluster_resolver.ClusterSpec(spec)
    assert hash(spec) == hash(cluster_resolver.ClusterSpec(spec.as_dict()))
    assert bool(spec)
    assert not cluster_resolver.ClusterSpec({})
    assert repr(spec).startswith("ClusterSpec({")
    with pytest.raises(ValueError, match="No such job in cluster: 'chief'"):
        spec.num_tasks("chief")
    with pytest.raises(ValueError, match="No task with index 5 in job 'worker'"):
        spec.task_address("worker", 5)


def test_tf_config_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "TF_CONFIG", tf_config(CHIEF_CLUSTER, "worker", 1, rpc_layer="grpc", environment="cloud")
    )
    resolver = cluster_resolver.TFConfigClusterResolver()
    assert resolver.cluster_spec().as_dict() == CHIEF_CLUSTER
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "grpc")
    assert resolver.environment == "cloud"
    assert resolver.master() == "grpc://h2:2224"
    assert resolver.master("chief", 0, rpc_layer="tcp") == "tcp://h0:2222"
    assert resolver.num_accelerators() in ({}, {"GPU": resolver.num_accelerators().get("GPU")})
    cluster = resolver.cluster()
    assert cluster is not None
    assert (cluster.rank, cluster.source) == (2, "tf_config")
    assert cluster_from_resolver(resolver) == cluster
    # Overrides, as in TF
    resolver.task_type, resolver.task_id, resolver.rpc_layer = "chief", 0, None
    assert resolver.master() == "grpc://h0:2222"  # TF_CONFIG's rpc_layer still applies
    other = cluster_resolver.TFConfigClusterResolver("chief", 0, rpc_layer="", environment="x")
    assert (other.master(), other.environment) == ("h0:2222", "x")


def test_tf_config_resolver_without_tf_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    resolver = cluster_resolver.TFConfigClusterResolver()
    assert resolver.cluster_spec().as_dict() == {}
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == (None, None, None)
    assert (resolver.master(), resolver.environment) == ("", "")
    assert resolver.cluster() is None


def test_torchrun_resolver() -> None:
    resolver = cluster_resolver.TorchrunClusterResolver(TORCHRUN)
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert (resolver.local_rank, resolver.local_world_size) == (1, 2)
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.1:29500", "", "", ""]}
    assert resolver.master() == "10.0.0.1:29500"
    assert resolver.master("worker", 0, rpc_layer="grpc") == "grpc://10.0.0.1:29500"
    assert resolver.cluster() == parse_torchrun_env(TORCHRUN)
    assert cluster_from_resolver(resolver) == resolver.cluster()
    with pytest.raises(AttributeError, match="RANK decides the task index"):
        resolver.task_id = 3
    with pytest.raises(ValueError, match="found none of RANK"):
        cluster_resolver.TorchrunClusterResolver({}).cluster()


def test_torchrun_resolver_shares_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_resolver._devices, "num_gpus", lambda: 8)
    assert cluster_resolver.TorchrunClusterResolver(TORCHRUN).num_accelerators() == {"GPU": 4}
    monkeypatch.setattr(cluster_resolver._devices, "num_gpus", lambda: 0)
    assert cluster_resolver.TorchrunClusterResolver(TORCHRUN).num_accelerators() == {}


def test_simple_resolver_and_duck_typed_resolvers() -> None:
    resolver = cluster_resolver.SimpleClusterResolver(
        {"worker": ["a:1", "b:2"]},
        master="a:1",
        task_type="worker",
        task_id=0,
        num_accelerators={"GPU": 2},
        rpc_layer="grpc",
    )
    assert resolver.master() == "grpc://a:1"
    assert resolver.master("worker", 1) == "grpc://b:2"
    assert resolver.num_accelerators() == {"GPU": 2}
    assert resolver.environment == ""
    cluster = cluster_from_resolver(resolver)
    assert cluster is not None
    assert (cluster.rank, cluster.world_size, cluster.source) == (0, 2, "resolver")

    class UsersResolver:  # a TF-style resolver that is not ours
        task_type = "worker"
        task_id = 1
        local_rank = 0

        def cluster_spec(self) -> dict[str, list[str]]:
            return {"worker": ["a:1", "b:2"]}

    cluster = cluster_from_resolver(UsersResolver())
    assert cluster is not None
    assert (cluster.rank, cluster.master) == (1, "a:1")


def test_public_names_are_documented() -> None:
    for name in cluster_resolver.__all__:
        obj = getattr(cluster_resolver, name)
        assert obj.__doc__, name
        for attr, member in vars(obj).items():
            if not attr.startswith("_") and callable(member):
                assert member.__doc__, f"{name}.{attr}"
