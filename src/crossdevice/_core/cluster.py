"""The cluster a worker belongs to, from `TF_CONFIG` or torchrun's environment.

A `Cluster` says everything a worker needs to join the others: its rank among the
`world_size` workers, the address of the rendezvous (`master_addr:master_port`) and the
TF task it plays. It is parsed from:

* `TF_CONFIG` (TF's format), for example
  `{"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},
  "task": {"type": "worker", "index": 0}}`. TF's ranking rule
  (`multi_worker_util.id_in_cluster`) applies: the chief is rank 0 and worker `i` is rank
  `i + number of chiefs`; the rendezvous is the rank-0 task's address (the chief's, else
  worker 0's). `ps` and `evaluator` tasks take no part in collectives.
* torchrun's environment: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`,
  `LOCAL_RANK` and `LOCAL_WORLD_SIZE`.

No `TF_CONFIG` (or an empty cluster) and no torchrun variables mean a single worker:
`resolve_cluster` returns None, as TF's strategy then runs in local mode.

This module is pure parsing: no torch, no sockets.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

from crossdevice._core.validate import safe_repr

__all__ = [
    "COLLECTIVE_TASK_TYPES",
    "MAX_TASKS",
    "MAX_TF_CONFIG_BYTES",
    "Cluster",
    "Source",
    "check_host",
    "cluster_from_resolver",
    "cluster_from_spec",
    "load_tf_config",
    "normalize_jobs",
    "parse_index",
    "parse_tf_config",
    "parse_torchrun_env",
    "resolve_cluster",
    "split_address",
]

#: Task types that take part in collectives, in rank order (TF's `id_in_cluster`).
COLLECTIVE_TASK_TYPES: Final = ("chief", "worker")

#: torchrun's variables: the four that must come together, then the optional ones.
_TORCHRUN_REQUIRED: Final = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_TORCHRUN_OPTIONAL: Final = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")

#: Longest `TF_CONFIG` accepted: real ones are a few KiB; a bound keeps a hostile one
#: from costing memory or time.
MAX_TF_CONFIG_BYTES: Final = 1 << 20
#: Most tasks in one job (TF clusters have at most thousands).
MAX_TASKS: Final = 1 << 16
#: Most ranks an error lists one by one (`Cluster.describe_ranks`); the rest are counted.
_RANKS_SHOWN: Final = 16
#: A DNS name: dot-separated labels of letters, digits and hyphens (RFC 1123).
_HOSTNAME: Final = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?\Z"
)


def check_host(host: object, what: str) -> str:
    """`host` if it is a DNS name or an IP address; ValueError naming `what` else.

    Rejects what no host name can hold and a launcher may have been fed by mistake or by
    an attacker: schemes (`tcp://h`), users (`user@h`), paths, spaces, control characters.

    Example:
        >>> check_host("10.0.0.1", "MASTER_ADDR")
        '10.0.0.1'
    """
    if isinstance(host, str) and host.isascii():
        try:
            ipaddress.ip_address(host)
            return host
        except ValueError:
            if _HOSTNAME.match(host):
                return host
    raise ValueError(
        f"{what} must be a host name (letters, digits, '-' and '.') or an IP address, got "
        f"{host!r:.120}; give the bare host, without a scheme, user, path or spaces"
    )


def parse_index(value: object, what: str) -> int:
    """A non-negative integer written as an int or a string of ASCII digits.

    `True` and `1.9` are not task indices (`int()` would make both 1).
    """
    if type(value) is int and value >= 0:
        return value
    if (
        type(value) is str  # not a _LongInt: that is an int literal too long to convert
        and value.isascii()
        and value.isdigit()
        and len(value) <= 9
    ):
        return int(value)
    raise ValueError(
        f"{what} must be an integer >= 0 (an int or ASCII digits), got {safe_repr(value):.80}"
    )


class _LongInt(str):
    """An integer literal of `TF_CONFIG` too long to be any index or port, kept as text.

    Python refuses `int()` of more than 4300 digits with a ValueError of its own
    (CVE-2020-10735), which would reach the user instead of the message that names
    the field (`parse_index`); no TF_CONFIG number needs more than `_MAX_INT_DIGITS`.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<an integer of {len(self.lstrip('-'))} digits: {str.__str__(self)[:12]}...>"


#: The most digits a TF_CONFIG integer is converted with (a port has 5, an index fewer).
_MAX_INT_DIGITS: Final = 100


def _json_int(text: str) -> int | _LongInt:
    """`json.loads`'s `parse_int`: an int, or a `_LongInt` for absurdly long literals."""
    return _LongInt(text) if len(text) > _MAX_INT_DIGITS else int(text)


#: Where a `Cluster` description came from.
Source = Literal["tf_config", "torchrun", "resolver"]


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this worker stands in a multi-worker cluster.

    Attributes:
        task_type: `"chief"` or `"worker"` (torchrun workers are `"worker"`).
        task_id: index of this task within its job.
        rank: this worker's id in the cluster, 0 .. world_size - 1 (0 is the chief).
        world_size: number of workers taking part in collectives (chiefs + workers).
        master_addr: host of the rendezvous (the rank-0 task, or torchrun's MASTER_ADDR).
        master_port: port of the rendezvous.
        local_rank: index of this process among the workers on its host (torchrun's
            `LOCAL_RANK`; 0 under `TF_CONFIG`, which runs one process per host).
        local_world_size: number of worker processes on this host.
        source: where the description came from: `"tf_config"`, `"torchrun"` or
            `"resolver"` (a user's cluster resolver).
        jobs: the collective jobs and their task addresses (`(("chief", ("h0:2222",)), ...)`);
            empty under torchrun, which tells a worker no address but the rendezvous.
    """

    task_type: str
    task_id: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int = 0
    local_world_size: int = 1
    source: Source = "tf_config"
    jobs: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must be in [0, {self.world_size}) for world_size {self.world_size}, "
                f"got {self.rank!r}"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port!r}")
        check_host(self.master_addr, "master_addr")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank must be in [0, {self.local_world_size}) for local_world_size "
                f"{self.local_world_size}, got {self.local_rank!r}"
            )

    @property
    def num_workers(self) -> int:
        """Number of workers (chiefs + workers): TF's `multi_worker_util.worker_count`."""
        return self.world_size

    @property
    def is_chief(self) -> bool:
        """Whether this worker is the chief (rank 0), whose values initialise variables."""
        return self.rank == 0

    @property
    def master(self) -> str:
        """`master_addr:master_port`, IPv6 hosts in brackets (`[::1]:2222`)."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"{host}:{self.master_port}"

    @property
    def init_method(self) -> str:
        """The `torch.distributed` init method URL: `tcp://master_addr:master_port`."""
        return f"tcp://{self.master}"

    def task_of(self, rank: int) -> str | None:
        """The TF task of `rank` (`"worker 1 at h2:2222"`); None under torchrun.

        Example:
            >>> Cluster("worker", 0, 1, 3, "h0", 2222,
            ...         jobs=(("chief", ("h0:2222",)), ("worker", ("h1:2222", "h2:2222")))
            ...         ).task_of(2)
            'worker 1 at h2:2222'
        """
        for job, addresses in self.jobs:
            if rank < len(addresses):
                return f"{job} {rank} at {addresses[rank]}"
            rank -= len(addresses)
        return None  # torchrun tells a worker no task but its own

    def describe_ranks(self, ranks: Sequence[int]) -> str:
        """`ranks` for an error, with their TF tasks when the cluster names them.

        Example:
            >>> Cluster("worker", 0, 1, 3, "h0", 2222,
            ...         jobs=(("chief", ("h0:2222",)), ("worker", ("h1:2222", "h2:2222")))
            ...         ).describe_ranks([2, 0])
            'rank(s) [0, 2] (chief 0 at h0:2222, worker 1 at h2:2222)'
        """
        shown = sorted(ranks)[:_RANKS_SHOWN]
        more = f" and {len(ranks) - len(shown)} more" if len(ranks) > len(shown) else ""
        named = ", ".join(filter(None, map(self.task_of, shown)))
        return f"rank(s) {shown}{more}" + (f" ({named})" if named else "")


def split_address(address: str) -> tuple[str, int]:
    """Split `"host:port"` (or `"[v6addr]:port"`) into host and port.

    Raises:
        ValueError: not of that form, or the port is not in 1..65535.
    """
    text = address.strip() if isinstance(address, str) else ""
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 address needs brackets: [::1]:2222
    if (
        not sep
        or not host
        or not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5)
        or not 0 < int(port_text) < 65536
    ):
        raise ValueError(
            f"expected a task address 'host:port' (IPv6 as '[addr]:port') with a port in "
            f"1..65535, got {address!r:.120}"
        )
    return check_host(host, f"the host of task address {address!r:.120}"), int(port_text)


def normalize_jobs(cluster: Mapping[str, Any]) -> dict[str, dict[int, str]]:
    """TF's cluster dict (job -> list of addresses, or job -> {index: address}) normalised.

    Raises:
        ValueError: a job that is neither a list nor a dict of addresses.
    """
    if not isinstance(cluster, Mapping):
        raise ValueError(
            f"expected the cluster as a dict of job name -> list of 'host:port', got "
            f"{cluster!r:.120}"
        )
    jobs: dict[str, dict[int, str]] = {}
    for job, tasks in cluster.items():
        if not isinstance(job, str):
            raise ValueError(f"job names must be strings, got {job!r:.80}")
        if isinstance(tasks, Mapping | Sequence) and len(tasks) > MAX_TASKS:
            raise ValueError(
                f"job {job!r:.80} lists {len(tasks)} tasks, more than {MAX_TASKS}; expected "
                "one address per task of a real cluster"
            )
        if isinstance(tasks, Mapping):
            entries = {
                parse_index(i, f"a task index of job {job!r:.80}"): a for i, a in tasks.items()
            }
        elif isinstance(tasks, Sequence) and not isinstance(tasks, str):
            entries = dict(enumerate(tasks))
        else:
            raise ValueError(
                f"job {job!r} must list its task addresses (a list, or a dict of task index "
                f"-> address), got {tasks!r}"
            )
        for index, address in entries.items():
            if not isinstance(address, str):
                raise ValueError(
                    f"task {index} of job {job!r} must have a 'host:port' address, got "
                    f"{address!r:.120}"
                )
        jobs[str(job)] = dict(sorted(entries.items()))
    return jobs


def cluster_from_spec(
    cluster: Mapping[str, Any],
    task_type: str | None,
    task_id: int | None,
    *,
    local_rank: int = 0,
    local_world_size: int = 1,
    source: Source = "tf_config",
) -> Cluster | None:
    """The `Cluster` of task (`task_type`, `task_id`) in a TF cluster dict.

    Args:
        cluster: job name -> task addresses, as in `TF_CONFIG["cluster"]` or
            `ClusterSpec.as_dict()`.
        task_type: this task's job (`"chief"` or `"worker"`).
        task_id: this task's index in its job.
        local_rank: index of this process among the workers on its host.
        local_world_size: number of worker processes on this host.
        source: where the description came from (see `Cluster.source`).

    Returns:
        None for an empty cluster (TF's local mode), else the `Cluster`.

    Raises:
        ValueError: more than one chief, a job with holes, no or an unknown task, a task
            that takes no part in collectives (evaluator, ps), a bad address.
    """
    jobs = normalize_jobs(cluster)
    if not any(jobs.values()):
        return None
    if len(jobs.get("chief", {})) > 1:
        raise ValueError(
            f"a cluster has at most one chief (TF's rule), got chief tasks "
            f"{list(jobs['chief'].values())!r}; make the others workers"
        )
    ranked: list[tuple[str, tuple[str, ...]]] = []
    for job in COLLECTIVE_TASK_TYPES:
        tasks = jobs.get(job, {})
        if list(tasks) != list(range(len(tasks))):
            raise ValueError(
                f"job {job!r} must have tasks 0..n-1 without holes so that every task has a "
                f"rank, got task indices {sorted(tasks)!r}"
            )
        if tasks:
            ranked.append((job, tuple(tasks.values())))
    if not ranked:
        raise ValueError(
            f"the cluster has no 'chief' or 'worker' job to run collectives, got jobs "
            f"{sorted(jobs)!r}; name the training tasks 'worker' (and optionally one 'chief')"
        )
    if task_type is None or task_id is None:
        raise ValueError(
            f"a multi-worker cluster needs this task's type and index, got task_type="
            f"{task_type!r} and task_id={task_id!r}; set TF_CONFIG's 'task' to "
            "{'type': 'worker', 'index': i}"
        )
    if task_type not in COLLECTIVE_TASK_TYPES:
        raise ValueError(
            f"expected this task to be one of {list(COLLECTIVE_TASK_TYPES)!r}, which take part "
            f"in multi-worker collectives, got task type {task_type!r}; run an evaluator "
            "with a single-worker strategy"
        )
    addresses = dict(ranked).get(task_type, ())
    if (
        isinstance(task_id, bool)
        or not isinstance(task_id, int)
        or not 0 <= task_id < len(addresses)
    ):
        raise ValueError(
            f"expected a task index of job {task_type!r}, which has {len(addresses)} task(s) "
            f"{list(addresses)!r}, got task index {task_id!r}"
        )
    num_chiefs = len(jobs.get("chief", {}))
    rank = task_id + (num_chiefs if task_type == "worker" else 0)
    world_size = sum(len(addresses) for _, addresses in ranked)
    master_addr, master_port = split_address(ranked[0][1][0])
    return Cluster(
        task_type=task_type,
        task_id=task_id,
        rank=rank,
        world_size=world_size,
        master_addr=master_addr,
        master_port=master_port,
        local_rank=local_rank,
        local_world_size=local_world_size,
        source=source,
        jobs=tuple(ranked),
    )


def load_tf_config(text: str | None) -> dict[str, Any]:
    """`TF_CONFIG`'s JSON as a dict (`{}` for None or an empty string).

    Raises:
        ValueError: not a JSON object.
    """
    if text is None or not text.strip():
        return {}
    if len(text) > MAX_TF_CONFIG_BYTES:
        raise ValueError(
            f"TF_CONFIG is {len(text)} characters long, more than {MAX_TF_CONFIG_BYTES}; "
            "expected a cluster description of a few KiB"
        )
    try:
        config = json.loads(text, parse_int=_json_int)
    except RecursionError:
        raise ValueError(
            "TF_CONFIG nests too deeply to be a cluster description; expected "
            '{"cluster": {...}, "task": {"type": ..., "index": ...}}'
        ) from None
    except json.JSONDecodeError as err:
        raise ValueError(
            f'TF_CONFIG must be a JSON object such as \'{{"cluster": {{"worker": '
            f'["host:port", ...]}}, "task": {{"type": "worker", "index": 0}}}}\', '
            f"got {text!r} ({err})"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object, got {text!r}")
    return config


def parse_tf_config(config: str | Mapping[str, Any] | None) -> Cluster | None:
    """The `Cluster` described by a `TF_CONFIG` (its JSON text or the parsed dict).

    Returns:
        None when there is no cluster (TF's local mode).

    Raises:
        ValueError: see `cluster_from_spec`; a task that is not a dict.
    """
    parsed = load_tf_config(config) if config is None or isinstance(config, str) else config
    task = parsed.get("task", {})
    if not isinstance(task, Mapping):
        raise ValueError(f"TF_CONFIG's 'task' must be {{'type': ..., 'index': ...}}, got {task!r}")
    task_type = task.get("type")
    if task_type is not None and not isinstance(task_type, str):
        raise ValueError(f"TF_CONFIG's task type must be a string, got {task_type!r:.80}")
    index = task.get("index")
    task_id = None if index is None else parse_index(index, "TF_CONFIG's task index")
    return cluster_from_spec(
        parsed.get("cluster", {}), None if task_type is None else str(task_type), task_id
    )


def _env_int(env: Mapping[str, str], name: str) -> int:
    # Strict: int() would also take " 1", "+1", "1_0" and non-ASCII digits.
    return parse_index(env[name], f"environment variable {name}")


def parse_torchrun_env(env: Mapping[str, str]) -> Cluster | None:
    """The `Cluster` described by torchrun's variables in `env`.

    Returns:
        None when none of `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` is set.

    Raises:
        ValueError: some of them set but not all, or values that are not integers or are
            out of range.
    """
    present = [name for name in _TORCHRUN_REQUIRED if env.get(name)]
    if not present:
        return None
    missing = [name for name in _TORCHRUN_REQUIRED if not env.get(name)]
    if missing:
        raise ValueError(
            f"torchrun's environment is incomplete: {present!r} are set but {missing!r} are "
            "not; launch with `torchrun` or set all of RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT"
        )
    rank = _env_int(env, "RANK")
    world_size = _env_int(env, "WORLD_SIZE")
    port = _env_int(env, "MASTER_PORT")
    local_rank = _env_int(env, "LOCAL_RANK") if env.get("LOCAL_RANK") else 0
    local_world = _env_int(env, "LOCAL_WORLD_SIZE") if env.get("LOCAL_WORLD_SIZE") else None
    if local_world is None:
        local_world = max(1, local_rank + 1)
    return Cluster(
        task_type="worker",
        task_id=rank,
        rank=rank,
        world_size=world_size,
        master_addr=check_host(_bracketless(env["MASTER_ADDR"]), "MASTER_ADDR"),
        master_port=port,
        local_rank=local_rank,
        local_world_size=local_world,
        source="torchrun",
    )


def _bracketless(host: str) -> str:
    """`::1` for `[::1]` (an IPv6 address as URLs write it)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def resolve_cluster(env: Mapping[str, str] | None = None) -> Cluster | None:
    """The cluster this process belongs to: `TF_CONFIG` first, else torchrun's variables.

    Args:
        env: the environment to read (default `os.environ`).

    Returns:
        None for a single worker (no cluster in `TF_CONFIG`, no torchrun variables).

    Raises:
        ValueError: a malformed description, or `TF_CONFIG` and torchrun disagreeing on
            this worker's rank or the number of workers.
    """
    env = os.environ if env is None else env
    from_tf = parse_tf_config(env.get("TF_CONFIG"))
    from_torchrun = parse_torchrun_env(env)
    if from_tf is None:
        return from_torchrun
    if from_torchrun is None:
        return from_tf
    if (from_tf.rank, from_tf.world_size) != (from_torchrun.rank, from_torchrun.world_size):
        raise ValueError(
            f"TF_CONFIG makes this worker rank {from_tf.rank} of {from_tf.world_size} but "
            f"torchrun's RANK/WORLD_SIZE say {from_torchrun.rank} of "
            f"{from_torchrun.world_size}; unset one of them or make them agree"
        )
    # Same rank: keep TF_CONFIG's addresses, add torchrun's view of this host.
    return dataclasses.replace(
        from_tf,
        local_rank=from_torchrun.local_rank,
        local_world_size=from_torchrun.local_world_size,
    )


def cluster_from_resolver(resolver: Any) -> Cluster | None:
    """The `Cluster` of a TF-style cluster resolver (ours or a user's).

    Uses only TF's resolver API: `cluster_spec().as_dict()`, `task_type` and `task_id`;
    `local_rank` and `local_world_size` are read when the resolver has them (ours for
    torchrun do) and the resolver may give the whole `Cluster` through a `cluster()`
    method.

    Returns:
        None for an empty cluster spec (local mode).
    """
    own = getattr(resolver, "cluster", None)
    if callable(own):
        result = own()
        if result is None or isinstance(result, Cluster):
            return result
    spec = resolver.cluster_spec()
    as_dict = spec.as_dict() if hasattr(spec, "as_dict") else spec
    return cluster_from_spec(
        as_dict,
        resolver.task_type,
        resolver.task_id,
        local_rank=int(getattr(resolver, "local_rank", 0)),
        local_world_size=int(getattr(resolver, "local_world_size", 1)),
        source="resolver",
    )
