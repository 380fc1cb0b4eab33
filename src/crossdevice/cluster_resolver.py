"""Cluster resolvers (`tf.distribute.cluster_resolver`): who the workers are.

`MultiWorkerMirroredStrategy(cluster_resolver=None)` reads the cluster from
`TFConfigClusterResolver` (the `TF_CONFIG` environment variable) by default, or from
torchrun's environment (`TorchrunClusterResolver`). The classes follow TF's API:
`cluster_spec()`, `master()`, `num_accelerators()`, `task_type`, `task_id`,
`rpc_layer`, `environment`.

Example:
    >>> import json, os
    >>> os.environ["TF_CONFIG"] = json.dumps({
    ...     "cluster": {"worker": ["localhost:12345", "localhost:23456"]},
    ...     "task": {"type": "worker", "index": 1}})
    >>> resolver = TFConfigClusterResolver()
    >>> resolver.cluster_spec().as_dict()
    {'worker': ['localhost:12345', 'localhost:23456']}
    >>> resolver.task_type, resolver.task_id, resolver.master()
    ('worker', 1, 'localhost:23456')
    >>> del os.environ["TF_CONFIG"]
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping
from typing import Any

from crossdevice._core import devices as _devices
from crossdevice._core.cluster import (
    Cluster,
    Source,
    cluster_from_spec,
    load_tf_config,
    normalize_jobs,
    parse_index,
    parse_torchrun_env,
)

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "resolver_for_cluster",
]


class ClusterSpec:
    """The jobs of a cluster and the addresses of their tasks (TF's `tf.train.ClusterSpec`).

    Args:
        cluster: a dict of job name -> list of `"host:port"` (task `i` at position `i`)
            or job name -> dict of task index -> address (sparse jobs), or a `ClusterSpec`.

    Example:
        >>> spec = ClusterSpec({"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]})
        >>> spec.jobs, spec.num_tasks("worker"), spec.task_address("worker", 1)
        (['chief', 'worker'], 2, 'h2:2222')
    """

    def __init__(self, cluster: Mapping[str, Any] | ClusterSpec | None = None) -> None:
        if isinstance(cluster, ClusterSpec):
            self._jobs: dict[str, dict[int, str]] = {
                job: dict(tasks) for job, tasks in cluster._jobs.items()
            }
        else:
            self._jobs = normalize_jobs(cluster or {})

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """Job name -> list of addresses, or -> dict of index -> address for sparse jobs."""
        result: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            dense = list(tasks) == list(range(len(tasks)))
            result[job] = list(tasks.values()) if dense else dict(tasks)
        return result

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return sorted(self._jobs)

    def _tasks(self, job_name: str) -> dict[int, str]:
        if job_name not in self._jobs:
            raise ValueError(f"No such job in cluster: {job_name!r}; jobs are {self.jobs!r}")
        return self._jobs[job_name]

    def num_tasks(self, job_name: str) -> int:
        """Number of tasks in `job_name` (ValueError for an unknown job)."""
        return len(self._tasks(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The task indices of `job_name`, sorted."""
        return sorted(self._tasks(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of task `task_index` of `job_name`.

        Raises:
            ValueError: no such job or task.
        """
        tasks = self._tasks(job_name)
        if task_index not in tasks:
            raise ValueError(
                f"No task with index {task_index!r} in job {job_name!r}; its tasks are "
                f"{sorted(tasks)!r}"
            )
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> list[str | None]:
        """Addresses of `job_name`'s tasks by index, None where a sparse job has a hole."""
        tasks = self._tasks(job_name)
        size = max(tasks) + 1 if tasks else 0
        return [tasks.get(i) for i in range(size)]

    def __bool__(self) -> bool:
        return any(self._jobs.values())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClusterSpec):
            return self._jobs == other._jobs
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple((job, tuple(tasks.items())) for job, tasks in sorted(self._jobs.items())))

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def _format_master_url(master: str, rpc_layer: str | None) -> str:
    """TF's `format_master_url`: `rpc_layer://master`, or `master` without a layer."""
    return f"{rpc_layer}://{master}" if rpc_layer else master


class ClusterResolver(abc.ABC):
    """Base of the cluster resolvers (TF's `tf.distribute.cluster_resolver.ClusterResolver`).

    A subclass implements `cluster_spec()` and `master()`; `task_type`, `task_id`,
    `rpc_layer` and `environment` are attributes TF's strategies read.
    """

    _task_type: str | None = None
    _task_id: int | None = None
    _rpc_layer: str | None = None
    #: `Cluster.source` of the clusters this resolver describes.
    _cluster_source: Source = "resolver"

    @property
    def task_type(self) -> str | None:
        """This task's job (`"chief"`, `"worker"`, ...), or None when unknown."""
        return self._task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """This task's index within its job, or None when unknown."""
        return self._task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        """The protocol `master()` prefixes (`"grpc"`), or None for none."""
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The `ClusterSpec` of the cluster."""

    @abc.abstractmethod
    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of the master (see each subclass)."""

    @property
    def environment(self) -> str:
        """The environment the cluster runs in (`""`, TF's default)."""
        return ""

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        """Accelerators per type on this task's host: `{"GPU": n}`, or `{}` without any.

        `task_type`, `task_id` and `config_proto` are accepted for TF compatibility; like
        TF's resolvers without a remote lookup we count this host's devices.
        """
        del task_type, task_id, config_proto
        count = _devices.num_gpus()
        return {"GPU": count} if count else {}

    def cluster(self) -> Cluster | None:
        """This task's `Cluster` (rank, world size, rendezvous), None for a single worker.

        Not in TF: `MultiWorkerMirroredStrategy` uses it to start `torch.distributed`.
        """
        return cluster_from_spec(
            self.cluster_spec().as_dict(), self.task_type, self.task_id, source=self._cluster_source
        )


class SimpleClusterResolver(ClusterResolver):
    """A resolver holding a given `ClusterSpec` (TF's `SimpleClusterResolver`).

    Args:
        cluster_spec: the cluster (a `ClusterSpec` or its dict).
        master: the master address `master()` returns by default.
        task_type: this task's job.
        task_id: this task's index in its job.
        environment: the environment string.
        num_accelerators: accelerators per type (`{"GPU": 2}`); None counts this host's.
        rpc_layer: protocol prefixed to `master()` (`"grpc"` gives `grpc://host:port`).

    Example:
        >>> resolver = SimpleClusterResolver(
        ...     ClusterSpec({"worker": ["h0:1", "h1:1"]}), task_type="worker", task_id=1)
        >>> resolver.cluster().rank, resolver.cluster().world_size
        (1, 2)
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec | Mapping[str, Any],
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: Mapping[str, int] | None = None,
        rpc_layer: str | None = None,
    ) -> None:
        self._cluster_spec = ClusterSpec(cluster_spec)
        self._master = master
        self.task_type = task_type
        self.task_id = task_id
        self._environment = environment
        self._num_accelerators = None if num_accelerators is None else dict(num_accelerators)
        self.rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """The `ClusterSpec` given at construction."""
        return self._cluster_spec

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of (`task_type`, `task_id`) if both are given, else the given master."""
        if task_type is not None and task_id is not None:
            master = self._cluster_spec.task_address(task_type, task_id)
        else:
            master = self._master
        return _format_master_url(master, rpc_layer or self.rpc_layer)

    @property
    def environment(self) -> str:
        """The environment string given at construction."""
        return self._environment

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        """The accelerators given at construction, else this host's."""
        if self._num_accelerators is not None:
            return dict(self._num_accelerators)
        return super().num_accelerators(task_type, task_id, config_proto)


class TFConfigClusterResolver(ClusterResolver):
    """The cluster described by the `TF_CONFIG` environment variable (TF's resolver).

    `TF_CONFIG` is read on every call, as TF does, so a program may set it after
    creating the resolver. Without `TF_CONFIG` the cluster spec is empty (local mode).

    Args:
        task_type: overrides `TF_CONFIG["task"]["type"]`.
        task_id: overrides `TF_CONFIG["task"]["index"]`.
        rpc_layer: overrides `TF_CONFIG["rpc_layer"]`; prefixed to `master()`.
        environment: overrides `TF_CONFIG["environment"]`.

    Example:
        >>> import json, os
        >>> os.environ["TF_CONFIG"] = json.dumps({
        ...     "cluster": {"chief": ["h0:2222"], "worker": ["h1:2222"]},
        ...     "task": {"type": "worker", "index": 0}})
        >>> TFConfigClusterResolver().cluster().rank  # the chief is rank 0
        1
        >>> del os.environ["TF_CONFIG"]
    """

    _cluster_source: Source = "tf_config"

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
    ) -> None:
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @staticmethod
    def _config() -> dict[str, Any]:
        return load_tf_config(os.environ.get("TF_CONFIG"))

    @property
    def task_type(self) -> str | None:
        """This task's job: the one given, else `TF_CONFIG["task"]["type"]`, else None."""
        if self._task_type is not None:
            return self._task_type
        task = self._config().get("task", {})
        return str(task["type"]) if isinstance(task, Mapping) and "type" in task else None

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """This task's index: the one given, else `TF_CONFIG["task"]["index"]`, else None."""
        if self._task_id is not None:
            return self._task_id
        task = self._config().get("task", {})
        if isinstance(task, Mapping) and "index" in task:
            return parse_index(task["index"], "TF_CONFIG's task index")
        return None

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        """The given rpc layer, else `TF_CONFIG["rpc_layer"]`, else None."""
        if self._rpc_layer is not None:
            return self._rpc_layer
        layer = self._config().get("rpc_layer")
        return None if layer is None else str(layer)

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str:
        """The given environment, else `TF_CONFIG["environment"]`, else `""`."""
        if self._environment is not None:
            return self._environment
        return str(self._config().get("environment", ""))

    def cluster_spec(self) -> ClusterSpec:
        """`TF_CONFIG["cluster"]` as a `ClusterSpec` (empty without `TF_CONFIG`)."""
        return ClusterSpec(self._config().get("cluster", {}))

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of task (`task_type`, `task_id`), defaulting to this task's.

        Returns `""` when the task is unknown (TF's behaviour), prefixed by the rpc layer
        (`"grpc://h1:2222"`) when there is one.
        """
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            return ""
        master = self.cluster_spec().task_address(task_type, task_id)
        return _format_master_url(master, rpc_layer or self.rpc_layer)


class TorchrunClusterResolver(ClusterResolver):
    """The cluster described by torchrun's environment (not in TF).

    torchrun sets `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK` and
    `LOCAL_WORLD_SIZE` for each worker process. Every worker is a `"worker"` task whose
    index is its rank; worker 0 acts as the chief (TF's rule for a cluster without a
    `"chief"` job). torchrun tells a worker no address but the rendezvous, so the cluster
    spec lists `MASTER_ADDR:MASTER_PORT` for worker 0 and `""` for the others.

    Args:
        environ: the environment to read (default `os.environ`, read on every call).
        rpc_layer: protocol prefixed to `master()`.

    Raises:
        ValueError: (on use) the variables are missing, incomplete or malformed.

    Example:
        >>> env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        ...        "MASTER_PORT": "29500", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
        >>> resolver = TorchrunClusterResolver(env)
        >>> resolver.task_type, resolver.task_id, resolver.local_rank, resolver.master()
        ('worker', 1, 1, '127.0.0.1:29500')
    """

    def __init__(self, environ: Mapping[str, str] | None = None, rpc_layer: str | None = None):
        self._environ = environ
        self.rpc_layer = rpc_layer

    def cluster(self) -> Cluster:
        """This worker's `Cluster`, from torchrun's variables.

        Raises:
            ValueError: the variables are missing, incomplete or malformed.
        """
        env = os.environ if self._environ is None else self._environ
        cluster = parse_torchrun_env(env)
        if cluster is None:
            raise ValueError(
                "TorchrunClusterResolver found none of RANK, WORLD_SIZE, MASTER_ADDR, "
                "MASTER_PORT in the environment; launch with `torchrun --nproc-per-node N "
                "script.py` or use TFConfigClusterResolver"
            )
        return cluster

    @property
    def task_type(self) -> str | None:
        """Always `"worker"`."""
        return "worker"

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        raise AttributeError(
            f"torchrun's workers are all 'worker' tasks; cannot set task_type={task_type!r}"
        )

    @property
    def task_id(self) -> int | None:
        """This worker's `RANK`."""
        return self.cluster().rank

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        raise AttributeError(
            f"torchrun's RANK decides the task index; cannot set task_id={task_id!r}"
        )

    @property
    def local_rank(self) -> int:
        """This worker's `LOCAL_RANK` (0 when unset): its index among this host's workers."""
        return self.cluster().local_rank

    @property
    def local_world_size(self) -> int:
        """`LOCAL_WORLD_SIZE`: the number of worker processes on this host."""
        return self.cluster().local_world_size

    def cluster_spec(self) -> ClusterSpec:
        """A `"worker"` job of `WORLD_SIZE` tasks; only worker 0's address is known."""
        cluster = self.cluster()
        return ClusterSpec({"worker": [cluster.master] + [""] * (cluster.world_size - 1)})

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The rendezvous `MASTER_ADDR:MASTER_PORT` (or worker `task_id`'s address if known)."""
        master = self.cluster().master
        if task_type is not None and task_id is not None:
            master = self.cluster_spec().task_address(task_type, task_id)
        return _format_master_url(master, rpc_layer or self.rpc_layer)

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        """This process's share of the host's GPUs: `{"GPU": gpus // LOCAL_WORLD_SIZE}`.

        torchrun starts one process per GPU by convention (`--nproc-per-node` = GPUs),
        giving one GPU each; with fewer processes each gets an equal share (at least 1).
        """
        del task_type, task_id, config_proto
        count = _devices.num_gpus()
        if not count:
            return {}
        return {"GPU": max(1, count // self.local_world_size)}


class _ClusterViewResolver(SimpleClusterResolver):
    """The resolver `MultiWorkerMirroredStrategy.cluster_resolver` returns for its `Cluster`.

    It answers TF's resolver API from the cluster the strategy actually joined, and hands
    that same `Cluster` back from `cluster()`.
    """

    def __init__(self, cluster: Cluster | None) -> None:
        if cluster is None:
            # TF's local mode: a TFConfigClusterResolver without TF_CONFIG (empty cluster
            # spec, task type and id None, master "").
            super().__init__(ClusterSpec({}))
        else:
            jobs: dict[str, list[str]] = {job: list(tasks) for job, tasks in cluster.jobs}
            if not jobs:
                # torchrun tells a worker no address but the rendezvous (worker 0's).
                jobs = {"worker": [cluster.master] + [""] * (cluster.world_size - 1)}
            spec = ClusterSpec(jobs)
            master = (
                spec.task_address(cluster.task_type, cluster.task_id)
                if cluster.jobs
                else cluster.master
            )
            super().__init__(spec, master, cluster.task_type, cluster.task_id)
        self._cluster = cluster

    def cluster(self) -> Cluster | None:
        """The strategy's own `Cluster` (None in local mode)."""
        return self._cluster

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        """This worker's accelerators: `{"GPU": n}`, or `{}` without any (TF's counting).

        Under torchrun each process on a host gets an equal share of its GPUs.
        """
        del task_type, task_id, config_proto
        count = _devices.num_gpus()
        if not count:
            return {}
        share = self._cluster.local_world_size if self._cluster is not None else 1
        return {"GPU": max(1, count // share)}


def resolver_for_cluster(cluster: Cluster | None) -> ClusterResolver:
    """A TF-style resolver describing `cluster` (None: local mode, an empty cluster spec).

    `cluster_spec()`, `master()`, `task_type`, `task_id` and `num_accelerators()` follow
    TF's resolvers; `cluster()` returns `cluster` itself.

    Example:
        >>> resolver = resolver_for_cluster(None)
        >>> resolver.cluster_spec().as_dict(), resolver.task_type, resolver.task_id
        ({}, None, None)
    """
    return _ClusterViewResolver(cluster)
