"""Starting torch.distributed with the doors closed: the store and Gloo on one interface.

`torch.distributed.init_process_group("tcp://10.0.0.1:2222")` makes rank 0 serve its
c10d store on every interface (`[::]:2222`), unauthenticated, whatever the address says.
`start_default_group` instead binds rank 0's store to the address of the rendezvous
(`MASTER_ADDR`, or the chief's address in `TF_CONFIG`) by handing torch a socket we
bound ourselves (`TCPStore(master_listen_fd=...)`), and points Gloo at the interface
this worker uses to reach that address (`GLOO_SOCKET_IFNAME`) unless the user chose one.

`CROSSDEVICE_STORE_BIND=<address>` binds the store elsewhere (`0.0.0.0` or `::` for every
interface); under torchrun's agent (`TORCHELASTIC_USE_AGENT_STORE=True`) the agent
serves the store and we only connect to it. See the README's trust model: the cluster
network must still be trusted, as for torch.distributed itself.

Before torch's rendezvous the workers join through the store (`_reach_store`, `_join`),
all within the init timeout (`CROSSDEVICE_INIT_TIMEOUT_SECONDS`, default
`TUNING.default_init_timeout_seconds`). torch alone raised a bare `DistStoreError: wait
timeout after 300000ms, keys: /0//cpu//0/1` after 301 s (a worker never started), or
`DistNetworkError: The client socket has timed out after 300000ms while trying to
connect` after 589 s (its client tries twice; the chief never started, or gone after
giving up). Measured with 2 workers on 127.0.0.1, torch 2.13. Here every worker raises
`CollectiveTimeoutError` naming the workers that joined and those that did not, the
store's address, how long it waited, and the variable that grants more time. The first
worker to give up leaves its account in the store, and the store's host stays until
the joined workers read it (a bounded grace), so a peer does not hear a vanished store.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import json
import os
import socket
import struct
import time
from typing import Any, Final

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from crossdevice._comm.workers.groups import Groups
from crossdevice._comm.workers.health import HealthBoard
from crossdevice._comm.workers.store_logging import quiet_store
from crossdevice._comm.workers.store_watch import watched
from crossdevice._core import environment, tuning
from crossdevice._core.cluster import Cluster, resolve_cluster
from crossdevice._core.errors import CollectiveTimeoutError, WorkerFailedError
from crossdevice._core.options import CommunicationImplementation

__all__ = [
    "INIT_TIMEOUT_ENV",
    "STORE_BIND_ENV",
    "check_joined_group",
    "connect_groups",
    "health_store",
    "interface_of",
    "join_timeout",
    "serves_store",
    "start_cluster_group",
    "start_default_group",
    "start_for",
    "store_host",
]

#: Environment variable naming the address rank 0's store listens on.
STORE_BIND_ENV: Final = "CROSSDEVICE_STORE_BIND"
#: Environment variable: how long a worker waits for every worker to join (seconds).
INIT_TIMEOUT_ENV: Final = "CROSSDEVICE_INIT_TIMEOUT_SECONDS"
#: A join that someone gave up on: added to the arrival count (`_join`), so that an
#: arrival or a look at the count tells "abandoned" from "n of world_size arrived".
_ABANDONED: Final = 1 << 40
#: How long the store's host, having given up on the join, stays for the joined workers
#: to read why (each reads it within a poll, `TUNING.poll_seconds`): without it they
#: heard only that the store vanished.
_TELL_GRACE_SECONDS: Final = 3.0
_SIOCGIFADDR: Final = 0x8915
#: A start-up step's waits for peers inside torch, each bounded by its timeout while the
#: store answers (the store client's connection, the rendezvous's keys, a group's
#: handshake): `watched`'s backstop is this many timeouts.
_STARTUP_WAITS: Final = 3


def store_host() -> int | None:
    """The rank whose process serves the c10d store: 0, or None when torchrun's agent does."""
    return None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0


def _attempt_prefix() -> str:
    """The store prefix of this launch attempt under torchrun's agent, else "".

    The agent's store outlives a restart (`--max-restarts`): keys of the failed attempt
    (Gloo's addresses, health marks) would mislead the new one. torch's own env://
    rendezvous prefixes `/worker/attempt_<TORCHELASTIC_RESTART_COUNT>` for this reason.
    """
    if store_host() is not None:
        return ""
    return f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def serves_store(cluster: Cluster) -> bool:
    """Whether this worker serves the c10d store."""
    return cluster.rank == store_host()


def _local_address_towards(host: str, port: int) -> str | None:
    """This host's address on the route to `host` (no packet is sent)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(addr)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 `address` (`"lo"`), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
                if socket.inet_ntoa(reply[20:24]) == address:
                    return name
    return None


def _bound_listener(cluster: Cluster) -> int:
    """A listening socket on the rendezvous address (or `CROSSDEVICE_STORE_BIND`)."""
    host = os.environ.get(STORE_BIND_ENV) or cluster.master_addr
    try:
        infos = socket.getaddrinfo(host, cluster.master_port, type=socket.SOCK_STREAM)
    except OSError as err:
        raise ValueError(
            f"cannot resolve the rendezvous address {host!r} to bind the c10d store to "
            f"({err}); set MASTER_ADDR (or the chief's TF_CONFIG address) to this host's "
            f"address, or {STORE_BIND_ENV} to the address to listen on"
        ) from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise RuntimeError(
            f"rank 0 cannot listen on {addr[0]}:{cluster.master_port} for the rendezvous "
            f"({err}); expected a free port on an address of this host: check MASTER_ADDR/"
            f"MASTER_PORT (or the chief's TF_CONFIG address), or set {STORE_BIND_ENV}"
        ) from None
    return sock.detach()  # the store owns the descriptor from here on


def check_joined_group(cluster: Cluster | None) -> None:
    """ValueError unless `cluster` (when given) matches the process group that exists."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if cluster is not None and (cluster.rank, cluster.world_size) != (rank, world_size):
        raise ValueError(
            f"the cluster makes this worker rank {cluster.rank} of {cluster.world_size}, "
            f"but the torch.distributed process group that already exists has it as rank "
            f"{rank} of {world_size}; pass a matching cluster, or none to join the group"
        )


def start_default_group(
    cluster: Cluster,
    backend: str,
    timeout: float,
    *,
    device_id: Any = None,
) -> None:
    """`init_process_group` for `cluster`, store and Gloo bound to the rendezvous interface.

    Every worker first reaches the store and joins (see the module doc), within `timeout`
    seconds of this call.
    `device_id` (this process's CUDA device) is passed on, so NCCL binds to it eagerly.

    Raises:
        CollectiveTimeoutError: the store not reached, or not every worker joined, in time.
        WorkerFailedError: the store's host went away during the start.
    """
    started = time.monotonic()
    deadline = started + timeout
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        local = _local_address_towards(cluster.master_addr, cluster.master_port)
        name = interface_of(local) if local else None
        if name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = name
    delta = datetime.timedelta(seconds=timeout)
    kwargs: dict[str, Any] = {}
    if serves_store(cluster):
        kwargs["master_listen_fd"] = _bound_listener(cluster)
    else:
        _reach_store(cluster, started, deadline)
    reached = time.monotonic()
    try:
        store = TCPStore(
            cluster.master_addr,
            cluster.master_port,
            cluster.world_size,
            is_master=serves_store(cluster),
            timeout=delta,
            wait_for_workers=False,
            **kwargs,
        )
        _join(quiet_store(store), cluster, started, deadline)
    except dist.DistError as err:  # (not a wait's timeout: `_join` takes those)
        if serves_store(cluster):  # its own store, in this process: not lost
            raise
        raise _store_lost(cluster, reached, err) from err
    kwargs = {} if device_id is None else {"device_id": device_id}
    try:
        dist.init_process_group(
            backend=backend,
            store=PrefixStore(_attempt_prefix(), store) if _attempt_prefix() else store,
            rank=cluster.rank,
            world_size=cluster.world_size,
            timeout=delta,
            **kwargs,
        )
    except dist.DistError as err:
        raise _rendezvous_failed(cluster, err) from err


def _store_name(cluster: Cluster) -> str:
    who = "torchrun's agent" if store_host() is None else "rank 0, the chief"
    return f"the c10d store at {cluster.master} (served by {who})"


def _first_line(err: BaseException) -> str:
    line = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {line[:300]}"


def _why_unreached(err: OSError | None) -> str:
    if isinstance(err, ConnectionRefusedError):
        return "connection refused: nothing listens there"
    if isinstance(err, TimeoutError):
        return "no answer: the host is down, unreachable, or a firewall drops the connection"
    if isinstance(err, socket.gaierror):
        return f"the host name does not resolve ({err})"
    return "no connection" if err is None else _first_line(err)


def _reach_store(cluster: Cluster, started: float, deadline: float) -> None:
    """Return once the store's port accepts a connection; CollectiveTimeoutError at `deadline`.

    torch's client retries too, for its whole timeout, then says only that its socket
    timed out: a chief not started yet and one already gone look alike from here.
    """
    address = (cluster.master_addr, cluster.master_port)
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection(address, timeout=min(1.0, max(0.05, remaining))):
                return
        except OSError as err:
            last = err
        now = time.monotonic()
        if now >= deadline:
            break
        time.sleep(min(tuning.TUNING.poll_seconds, deadline - now))
    host = "torchrun's agent" if store_host() is None else "the chief (rank 0)"
    if store_host() is not None and cluster.task_of(0) is not None:
        host = f"the chief (rank 0, {cluster.task_of(0)})"
    raise CollectiveTimeoutError(
        f"rank {cluster.rank} of {cluster.world_size} could not reach {_store_name(cluster)} "
        f"for {now - started:.1f} s ({_why_unreached(last)}); it never accepted a "
        f"connection. Expected {host} to listen there: it has not started yet, crashed "
        "before opening its store, or already gave up waiting for the workers (its own "
        "init timeout ran out) and exited; or the address is wrong or blocked. Check its "
        "log, and that MASTER_ADDR/MASTER_PORT (or the chief's TF_CONFIG address) is "
        "right and reachable from this host, then start every worker again; when the chief "
        f"starts much later than the others, raise {INIT_TIMEOUT_ENV} (now "
        f"{deadline - started:g} s) in every worker's environment"
    )


def _join(store: Any, cluster: Cluster, started: float, deadline: float) -> None:
    """Count this worker in and wait for the others; CollectiveTimeoutError at `deadline`.

    One counter decides, atomically: arrivals add 1 and a worker giving up adds
    `_ABANDONED`, so every worker sees either all `world_size` arrived or the join
    abandoned, never both. A generation per rank keeps a later start of the same
    process (a store that outlives it: torchrun's agent) apart from this one.
    """
    rank, world = cluster.rank, cluster.world_size
    generation = int(store.add(f"{_attempt_prefix()}crossdevice/join/generation/{rank}", 1))
    base = f"{_attempt_prefix()}crossdevice/join/{generation}/"
    store.set(f"{base}rank/{rank}", b"1")
    count = int(store.add(f"{base}count", 1))
    if count == world:
        store.set(f"{base}all", b"1")
    poll = datetime.timedelta(seconds=tuning.TUNING.poll_seconds)
    while count < world:
        try:
            store.wait([f"{base}all"], poll)
            return
        except dist.DistStoreError:  # the wait's own timeout (a lost store: DistNetworkError)
            pass
        count = int(store.add(f"{base}count", 0))
        if count < world and time.monotonic() >= deadline:
            before = int(store.add(f"{base}count", _ABANDONED)) - _ABANDONED
            if before == world:  # the last one came just now
                return
            if before < world:  # this worker gives up first: it tells why
                joined = [r for r in range(world) if store.check([f"{base}rank/{r}"])]
                record = {"rank": rank, "waited": time.monotonic() - started, "joined": joined}
                record.update(timeout=deadline - started, count=before)
                store.set(f"{base}reason", json.dumps(record))
            count = world + 1
    if count == world:
        return
    record = json.loads(store.get(f"{base}reason"))  # (set just after the count)
    store.add(f"{base}left", 1)
    if rank == store_host():
        # The store dies with this process: stay until the joined workers read why.
        until = time.monotonic() + _TELL_GRACE_SECONDS
        while int(store.add(f"{base}left", 0)) < record["count"] and time.monotonic() < until:
            time.sleep(tuning.TUNING.poll_seconds / 5)
    missing = cluster.describe_ranks(sorted(set(range(world)) - set(record["joined"])))
    mine = record["rank"] == rank
    who = f"this worker (rank {rank})" if mine else f"rank {record['rank']}"
    waited = (
        "" if mine else f"; this worker (rank {rank}) waited {time.monotonic() - started:.1f} s"
    )
    raise CollectiveTimeoutError(
        f"the workers did not all join: expected {world} at {_store_name(cluster)}; "
        f"{cluster.describe_ranks(record['joined'])} joined, {missing} did not, and {who} "
        f"gave up after waiting {record['waited']:.1f} s (its init timeout: "
        f"{record['timeout']:g} s){waited}. Start the missing worker(s) with the others, "
        "or look in their logs for a crash before they built the strategy; when workers "
        f"start minutes apart, raise {INIT_TIMEOUT_ENV} (now {deadline - started:g} s here) "
        "in every worker's environment"
    )


def _store_lost(cluster: Cluster, reached: float, err: BaseException) -> WorkerFailedError:
    """The error of a worker whose store went away while the workers joined."""
    host = "torchrun's agent" if store_host() is None else "the chief (rank 0)"
    return WorkerFailedError(
        f"rank {cluster.rank} of {cluster.world_size} reached {_store_name(cluster)} "
        f"{time.monotonic() - reached:.1f} s ago, but it stopped answering while the "
        f"workers joined ({_first_line(err)}): {host} has crashed or exited (it may have "
        "given up waiting for workers that did not come). Check its log, then start every "
        "worker again"
    )


def _rendezvous_failed(cluster: Cluster, err: BaseException) -> WorkerFailedError:
    """The error of torch's rendezvous failing after every worker joined."""
    try:
        with socket.create_connection((cluster.master_addr, cluster.master_port), timeout=1):
            why = "a worker probably crashed or exited right after joining"
    except OSError:
        host = "torchrun's agent" if store_host() is None else "the chief (rank 0)"
        why = f"the store no longer listens: {host} has crashed or exited"
    return WorkerFailedError(
        f"all {cluster.world_size} workers joined at {_store_name(cluster)}, but torch's "
        f"rendezvous of the process group then failed on rank {cluster.rank} "
        f"({_first_line(err)}): {why}. Check the other workers' logs, then start every "
        "worker again"
    )


def start_for(cluster: Cluster | None, init_timeout: float | None) -> Cluster:
    """Start the default group for `cluster` (None: `resolve_cluster`); the cluster started.

    `init_timeout` (None: `join_timeout`'s choice) bounds the wait for every worker to
    join.

    Raises:
        ValueError: no cluster described, or a bad `CROSSDEVICE_INIT_TIMEOUT_SECONDS`.
    """
    if cluster is None:
        cluster = resolve_cluster()
    if cluster is None:
        raise ValueError(
            "no cluster to join: TF_CONFIG describes no cluster, torchrun's RANK/"
            "WORLD_SIZE/MASTER_ADDR/MASTER_PORT are unset and torch.distributed is not "
            "initialised; launch with `torchrun`, set TF_CONFIG, or pass a Cluster"
        )
    start_cluster_group(cluster, join_timeout(init_timeout))
    return cluster


def join_timeout(given: float | None) -> float:
    """How long a worker waits for every worker to join, in seconds.

    `given` (a communicator's `init_timeout_seconds`: no public API passes one) wins; then
    `CROSSDEVICE_INIT_TIMEOUT_SECONDS`; then `TUNING.default_init_timeout_seconds`
    (5 minutes: workers start minutes apart on busy clusters).

    Raises:
        ValueError: the variable holds no number of seconds >= 1.
    """
    if given is not None:
        return given
    seconds = environment.env_seconds(INIT_TIMEOUT_ENV, minimum=1.0)
    return tuning.TUNING.default_init_timeout_seconds if seconds is None else seconds


def start_cluster_group(cluster: Cluster, init_timeout: float) -> None:
    """The default group for `cluster`: Gloo, plus NCCL on this process's GPU when CUDA is up.

    NCCL joins only when every worker on this host has a GPU of its own: it refuses two
    ranks on one device, and binding them eagerly fails the start. With more workers than
    GPUs the default group is Gloo only (our communicators then carry CUDA values through
    Gloo on the host; `Groups` says so). The rendezvous runs `watched`: a store host that
    freezes meanwhile ends it with an error, not a wait for ever.
    """
    import torch

    cuda = torch.cuda.is_available() and dist.is_nccl_available()
    device = None
    if cuda:
        # One GPU per process (torchrun's LOCAL_RANK): NCCL then binds each rank to its
        # own device instead of every rank to GPU 0. Set here, on the caller's thread.
        count = torch.cuda.device_count()
        device = torch.device("cuda", cluster.local_rank % count)
        torch.cuda.set_device(device)
        if cluster.local_world_size > count:
            cuda, device = False, None
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    address = (cluster.master_addr, cluster.master_port)
    watched(
        functools.partial(start_default_group, cluster, backend, init_timeout, device_id=device),
        store=address,
        store_host=store_host(),
        backstop=_STARTUP_WAITS * init_timeout
        + _TELL_GRACE_SECONDS
        + tuning.TUNING.backstop_slack_seconds,
        what=f"the rendezvous of {cluster.world_size} workers (rank {cluster.rank})",
    )


def connect_groups(
    timeout: float, implementation: CommunicationImplementation, rank: int, world_size: int
) -> tuple[Groups, HealthBoard]:
    """A communicator's own groups (`timeout`: theirs) and its health board, `watched`.

    Both talk to the default group's store inside torch (a group's Gloo handshake, the
    board's store clients): a store host that freezes meanwhile ends this with an error.
    `CROSSDEVICE_DEAD_AFTER_SECONDS` is read first (`patience_from_environment`).
    """
    patience_from_environment()

    def connect() -> tuple[Groups, HealthBoard]:
        groups = Groups(timeout, implementation)
        try:
            health = HealthBoard(lambda: health_store(groups.name), rank, world_size, store_host())
        except BaseException:
            groups.destroy()
            raise
        return groups, health

    return watched(
        connect,
        store=_default_store_address(),
        store_host=store_host(),
        backstop=_STARTUP_WAITS * timeout + tuning.TUNING.backstop_slack_seconds,
        what=f"creating a communicator's process groups on rank {rank} of {world_size}",
    )


#: How long a worker's silence must last before its peers declare it dead (seconds).
DEAD_AFTER_ENV: Final = "CROSSDEVICE_DEAD_AFTER_SECONDS"


def patience_from_environment() -> None:
    """Take `TUNING.dead_after_seconds` from `CROSSDEVICE_DEAD_AFTER_SECONDS`, when set.

    A worker that stalls longer than that (a debugger, a long pause of a loaded host) is
    declared dead by its peers; give them more patience on every worker.

    Raises:
        ValueError: the variable holds no number of seconds >= 0.5.
    """
    seconds = environment.env_seconds(DEAD_AFTER_ENV, minimum=0.5)
    if seconds is not None and seconds != tuning.TUNING.dead_after_seconds:
        tuning.set_tuning(dead_after_seconds=seconds)


def _default_tcp_store() -> Any:
    """The default group's store under its prefixes, when it is a TCPStore (else None)."""
    # torch keeps no public handle on the default group's store; this private getter
    # has existed since torch 1.x.
    base = dist.distributed_c10d._get_default_store()
    while isinstance(base, PrefixStore):
        base = base.underlying_store
    return base if isinstance(base, TCPStore) else None


def _default_store_address() -> tuple[str, int] | None:
    base = _default_tcp_store()
    return None if base is None else (base.host, base.port)


def health_store(namespace: str) -> Any:
    """A store for health marks, with its own connection and a short read timeout."""
    base = _default_tcp_store()
    if base is None:
        store = dist.distributed_c10d._get_default_store()
    else:
        # A connection of our own: its timeout bounds our reads without changing the
        # default store's, and a dead server fails our reads at once.
        store = TCPStore(
            base.host,
            base.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=tuning.TUNING.diagnosis_store_timeout_seconds),
        )
    return PrefixStore(f"{_attempt_prefix()}crossdevice/{namespace}/health/", store)
