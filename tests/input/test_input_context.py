"""InputContext, ValueContext, InputOptions: TF's fields, defaults and errors."""

from __future__ import annotations

import dataclasses

import pytest

from crossdevice._input.input_context import (
    InputContext,
    InputOptions,
    InputReplicationMode,
    ValueContext,
    check_options,
)


def test_input_context_defaults_and_fields() -> None:
    ctx = InputContext()
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 1)
    ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (2, 1, 8)
    assert ctx == InputContext(2, 1, 8)
    assert ctx != InputContext(2, 0, 8)
    assert str(ctx) == "crossdevice.InputContext(input pipeline id 1, total: 2)"


@pytest.mark.parametrize(
    ("global_batch", "replicas", "expected"), [(64, 4, 16), (8, 8, 1), (0, 3, 0)]
)
def test_get_per_replica_batch_size(global_batch: int, replicas: int, expected: int) -> None:
    ctx = InputContext(num_replicas_in_sync=replicas)
    assert ctx.get_per_replica_batch_size(global_batch) == expected


def test_get_per_replica_batch_size_not_divisible() -> None:
    ctx = InputContext(num_replicas_in_sync=3)
    with pytest.raises(
        ValueError,
        match=r"The `global_batch_size` 10 is not divisible by "
        r"`num_replicas_in_sync` 3",
    ) as info:
        ctx.get_per_replica_batch_size(10)
    assert "multiple of 3 (e.g. 12)" in str(info.value)
    with pytest.raises(ValueError, match="global_batch_size must be an int"):
        ctx.get_per_replica_batch_size(8.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_input_pipelines": 0}, "num_input_pipelines must be an int >= 1, got 0"),
        ({"num_input_pipelines": 2, "input_pipeline_id": 2}, r"input_pipeline_id must be .* got 2"),
        ({"input_pipeline_id": -1}, r"input_pipeline_id must be .* got -1"),
        ({"num_replicas_in_sync": 0}, "num_replicas_in_sync must be an int >= 1, got 0"),
        ({"num_replicas_in_sync": True}, "num_replicas_in_sync must be an int >= 1, got True"),
    ],
)
def test_input_context_rejects_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        InputContext(**kwargs)


def test_value_context() -> None:
    ctx = ValueContext()
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (0, 1)
    ctx = ValueContext(replica_id_in_sync_group=3, num_replicas_in_sync=4)
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (3, 4)
    assert ctx == ValueContext(3, 4)
    assert "replica id 3" in str(ctx)
    with pytest.raises(ValueError, match=r"replica_id_in_sync_group must be .* got 4"):
        ValueContext(4, 4)


def test_input_options_defaults() -> None:
    options = InputOptions()
    assert options.experimental_fetch_to_device is True  # None means True, as in TF
    assert options.experimental_replication_mode is InputReplicationMode.PER_WORKER
    assert options.experimental_place_dataset_on_device is False
    assert options.experimental_per_replica_buffer_size == 1
    assert InputOptions(
        experimental_replication_mode="per_replica"
    ).experimental_replication_mode is (InputReplicationMode.PER_REPLICA)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.experimental_fetch_to_device = False  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"experimental_fetch_to_device": 1}, "experimental_fetch_to_device must be True, False"),
        (
            {"experimental_replication_mode": "per_host"},
            "experimental_replication_mode must be one",
        ),
        ({"experimental_replication_mode": 3}, "must be a crossdevice.InputReplicationMode"),
        ({"experimental_place_dataset_on_device": "yes"}, "place_dataset_on_device must be True"),
        ({"experimental_per_replica_buffer_size": 0}, "buffer_size must be an int >= 1, got 0"),
    ],
)
def test_input_options_rejects_bad_fields(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        InputOptions(**kwargs)  # type: ignore[arg-type]


def test_check_options_follows_tf() -> None:
    assert check_options(None, from_function=False) == InputOptions()
    per_replica = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    with pytest.raises(NotImplementedError, match="PER_REPLICA is only supported in"):
        check_options(per_replica, from_function=False)
    assert check_options(per_replica, from_function=True) is per_replica
    with pytest.raises(ValueError, match="you must also specify `PER_REPLICA`"):
        check_options(InputOptions(experimental_place_dataset_on_device=True), from_function=True)
    on_device = InputOptions(
        experimental_replication_mode="PER_REPLICA", experimental_place_dataset_on_device=True
    )
    with pytest.raises(ValueError, match="can not be set to True when experimental_fetch_to"):
        check_options(on_device, from_function=True)
    with pytest.raises(TypeError, match=r"options must be a crossdevice\.InputOptions"):
        check_options({"experimental_fetch_to_device": False}, from_function=True)  # type: ignore[arg-type]
