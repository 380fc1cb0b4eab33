"""`InputContext`, `ValueContext`, `InputOptions` and `InputReplicationMode` (TF `distribute_lib`).

An `InputContext` tells a `dataset_fn` which input pipeline it builds (one per worker, or
one per replica in `PER_REPLICA` mode) and how many replicas share a step, so that it can
shard its input and size its per-replica batches. A `ValueContext` does the same for
`experimental_distribute_values_from_function`.
"""

from __future__ import annotations

import dataclasses
import enum

from crossdevice._core.coerce import coerce_enum

__all__ = ["InputContext", "InputOptions", "InputReplicationMode", "ValueContext"]


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_index(name: str, value: object, count_name: str, count: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
        raise ValueError(
            f"{name} must be an int in [0, {count_name}={count}), got {value!r}; "
            f"pass an id between 0 and {count - 1}"
        )
    return value


class InputContext:
    """What a `dataset_fn` passed to `distribute_datasets_from_function` needs to know.

    TF does not validate these arguments; we do (ValueError for counts below 1 and ids
    out of range), because a wrong id silently duplicates or drops a shard.

    Args:
        num_input_pipelines: the number of input pipelines (workers, or replicas in
            `PER_REPLICA` mode) reading the data.
        input_pipeline_id: the id of this pipeline, in `[0, num_input_pipelines)`.
        num_replicas_in_sync: the number of replicas that take part in each step.

    Example:
        >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
        >>> ctx.get_per_replica_batch_size(64)
        16
    """

    __slots__ = ("_input_pipeline_id", "_num_input_pipelines", "_num_replicas_in_sync")

    def __init__(
        self,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        num_replicas_in_sync: int = 1,
    ) -> None:
        self._num_input_pipelines = _check_count("num_input_pipelines", num_input_pipelines, 1)
        self._input_pipeline_id = _check_index(
            "input_pipeline_id", input_pipeline_id, "num_input_pipelines", num_input_pipelines
        )
        self._num_replicas_in_sync = _check_count("num_replicas_in_sync", num_replicas_in_sync, 1)

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas that take part in each step."""
        return self._num_replicas_in_sync

    @property
    def input_pipeline_id(self) -> int:
        """The id of this input pipeline, in `[0, num_input_pipelines)`."""
        return self._input_pipeline_id

    @property
    def num_input_pipelines(self) -> int:
        """The number of input pipelines (shard the data this many ways)."""
        return self._num_input_pipelines

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The per-replica batch size for a global batch of `global_batch_size` examples.

        Args:
            global_batch_size: the batch size of one step across all replicas.

        Returns:
            `global_batch_size // num_replicas_in_sync`.

        Raises:
            ValueError: `global_batch_size` is not divisible by `num_replicas_in_sync`
                (TF's error), or is not an int.
        """
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
            raise ValueError(
                f"global_batch_size must be an int, got {global_batch_size!r}; "
                "pass the number of examples in one step across all replicas"
            )
        n = self._num_replicas_in_sync
        if global_batch_size % n != 0:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size!r} is not divisible by "
                f"`num_replicas_in_sync` {n!r}; choose a global batch size that is a multiple "
                f"of {n} (e.g. {(global_batch_size // n + 1) * n})"
            )
        return global_batch_size // n

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InputContext):
            return NotImplemented
        return (
            self._num_input_pipelines,
            self._input_pipeline_id,
            self._num_replicas_in_sync,
        ) == (other._num_input_pipelines, other._input_pipeline_id, other._num_replicas_in_sync)

    def __hash__(self) -> int:
        return hash(
            (self._num_input_pipelines, self._input_pipeline_id, self._num_replicas_in_sync)
        )

    def __repr__(self) -> str:
        return (
            f"crossdevice.InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )

    def __str__(self) -> str:
        # TF: "tf.distribute.InputContext(input pipeline id {}, total: {})".
        return (
            f"crossdevice.InputContext(input pipeline id {self._input_pipeline_id}, "
            f"total: {self._num_input_pipelines})"
        )


class ValueContext:
    """What a `value_fn` passed to `experimental_distribute_values_from_function` gets.

    Args:
        replica_id_in_sync_group: the id of the replica the value is for.
        num_replicas_in_sync: the number of replicas in sync.

    Example:
        >>> ctx = ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)
        >>> ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync
        (1, 2)
    """

    __slots__ = ("_num_replicas_in_sync", "_replica_id_in_sync_group")

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1) -> None:
        self._num_replicas_in_sync = _check_count("num_replicas_in_sync", num_replicas_in_sync, 1)
        self._replica_id_in_sync_group = _check_index(
            "replica_id_in_sync_group",
            replica_id_in_sync_group,
            "num_replicas_in_sync",
            num_replicas_in_sync,
        )

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas in sync."""
        return self._num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """The id of the replica the value is for, in `[0, num_replicas_in_sync)`."""
        return self._replica_id_in_sync_group

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ValueContext):
            return NotImplemented
        return (self._replica_id_in_sync_group, self._num_replicas_in_sync) == (
            other._replica_id_in_sync_group,
            other._num_replicas_in_sync,
        )

    def __hash__(self) -> int:
        return hash((self._replica_id_in_sync_group, self._num_replicas_in_sync))

    def __repr__(self) -> str:
        return (
            "crossdevice.experimental.ValueContext("
            f"replica_id_in_sync_group={self._replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )

    def __str__(self) -> str:
        # TF: "tf.distribute.ValueContext(replica id {}, total replicas in sync: {})".
        return (
            f"crossdevice.experimental.ValueContext(replica id {self._replica_id_in_sync_group}, "
            f"total replicas in sync: {self._num_replicas_in_sync})"
        )


class InputReplicationMode(enum.Enum):
    """How `distribute_datasets_from_function` builds its input pipelines.

    `PER_WORKER`: `dataset_fn` is called once per worker and each local replica takes
    the next element in turn. `PER_REPLICA`: `dataset_fn` is called once per replica and
    each replica reads its own dataset.
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass(frozen=True, init=False)
class InputOptions:
    """Options for `experimental_distribute_dataset` and `distribute_datasets_from_function`.

    Args:
        experimental_fetch_to_device: place each per-replica batch on its replica's device
            (None means True, as in TF). Host arrays on logical CPU devices never move.
        experimental_replication_mode: an `InputReplicationMode` (or its name in any
            case); `PER_REPLICA` is only allowed in `distribute_datasets_from_function`.
        experimental_place_dataset_on_device: TF places the dataset itself on the device;
            it requires `PER_REPLICA` mode and `experimental_fetch_to_device=False`. Our
            input pipelines are Python iterables, so this only changes validation.
        experimental_per_replica_buffer_size: TF's prefetch depth per replica (>= 1).
            Batches are split when they are asked for, so it is accepted and validated
            but nothing is prefetched.

    Example:
        >>> InputOptions(experimental_fetch_to_device=False).experimental_fetch_to_device
        False
    """

    experimental_fetch_to_device: bool
    experimental_replication_mode: InputReplicationMode
    experimental_place_dataset_on_device: bool
    experimental_per_replica_buffer_size: int

    def __init__(
        self,
        experimental_fetch_to_device: bool | None = None,
        experimental_replication_mode: InputReplicationMode | str = InputReplicationMode.PER_WORKER,
        experimental_place_dataset_on_device: bool = False,
        experimental_per_replica_buffer_size: int = 1,
    ) -> None:
        if experimental_fetch_to_device is None:
            experimental_fetch_to_device = True
        if not isinstance(experimental_fetch_to_device, bool):
            raise ValueError(
                "experimental_fetch_to_device must be True, False or None, "
                f"got {experimental_fetch_to_device!r}"
            )
        experimental_replication_mode = coerce_enum(
            experimental_replication_mode,
            InputReplicationMode,
            message="experimental_replication_mode must be one of {choices}: it must be a "
            "crossdevice.InputReplicationMode or its name, got {value}",
        )
        if not isinstance(experimental_place_dataset_on_device, bool):
            raise ValueError(
                "experimental_place_dataset_on_device must be True or False, "
                f"got {experimental_place_dataset_on_device!r}"
            )
        _check_count(
            "experimental_per_replica_buffer_size", experimental_per_replica_buffer_size, 1
        )
        object.__setattr__(self, "experimental_fetch_to_device", experimental_fetch_to_device)
        object.__setattr__(self, "experimental_replication_mode", experimental_replication_mode)
        object.__setattr__(
            self, "experimental_place_dataset_on_device", experimental_place_dataset_on_device
        )
        object.__setattr__(
            self, "experimental_per_replica_buffer_size", experimental_per_replica_buffer_size
        )


def check_options(options: InputOptions | None, *, from_function: bool) -> InputOptions:
    """`options` (or the defaults) after TF's checks for the distribution method it is for.

    Args:
        options: the user's options, or None for the defaults.
        from_function: True for `distribute_datasets_from_function`, False for
            `experimental_distribute_dataset`.

    Raises:
        TypeError: `options` is not an `InputOptions`.
        NotImplementedError: `PER_REPLICA` mode in `experimental_distribute_dataset` (TF).
        ValueError: `experimental_place_dataset_on_device` without `PER_REPLICA` mode, or
            together with `experimental_fetch_to_device` (TF).
    """
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(
            f"options must be a crossdevice.InputOptions or None, got {options!r}; "
            "build one with crossdevice.InputOptions(...)"
        )
    per_replica = options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
    if per_replica and not from_function:
        raise NotImplementedError(
            "InputReplicationMode.PER_REPLICA is only supported in "
            "`distribute_datasets_from_function`; use it, or PER_WORKER here"
        )
    if options.experimental_place_dataset_on_device:
        if not per_replica:
            raise ValueError(
                "When `experimental_place_dataset_on_device` is set for dataset placement, "
                "you must also specify `PER_REPLICA` for the replication mode; got "
                f"{options.experimental_replication_mode!r}"
            )
        if options.experimental_fetch_to_device:
            raise ValueError(
                "`experimental_place_dataset_on_device` can not be set to True when "
                "experimental_fetch_to_device is True and replication mode is set to "
                "`PER_REPLICA`; pass experimental_fetch_to_device=False"
            )
    return options
