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
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import os
import socket
import struct
from typing import Any, Final

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from crossdevice._comm.workers.groups import Groups
from crossdevice._comm.workers.health import HealthBoard
from crossdevice._comm.workers.store_watch import watched
from crossdevice._core import environment, tuning
from crossdevice._core.cluster import Cluster, resolve_cluster
from crossdevice._core.options import CommunicationImplementation

__all__ = [
    "STORE_BIND_ENV",
    "check_joined_group",
    "connect_groups",
    "health_store",
    "interface_of",
    "serves_store",
    "start_cluster_group",
    "start_default_group",
    "start_for",
    "store_host",
]

#: Environment variable naming the address rank 0's store listens on.
STORE_BIND_ENV: Final = "CROSSDEVICE_STORE_BIND"
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
    cluster: Cluster, backend: str, timeout: float, *, device_id: Any = None
) -> None:
    """`init_process_group` for `cluster`, store and Gloo bound to the rendezvous interface.

    `device_id` (this process's CUDA device) is passed on, so NCCL binds to it eagerly.
    """
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        local = _local_address_towards(cluster.master_addr, cluster.master_port)
        name = interface_of(local) if local else None
        if name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = name
    delta = datetime.timedelta(seconds=timeout)
    kwargs: dict[str, Any] = {}
    if serves_store(cluster):
        kwargs["master_listen_fd"] = _bound_listener(cluster)
    store = TCPStore(
        cluster.master_addr,
        cluster.master_port,
        cluster.world_size,
        is_master=serves_store(cluster),
        timeout=delta,
        wait_for_workers=False,
        **kwargs,
    )
    kwargs = {} if device_id is None else {"device_id": device_id}
    dist.init_process_group(
        backend=backend,
        store=PrefixStore(_attempt_prefix(), store) if _attempt_prefix() else store,
        rank=cluster.rank,
        world_size=cluster.world_size,
        timeout=delta,
        **kwargs,
    )


def start_for(cluster: Cluster | None, init_timeout: float | None) -> Cluster:
    """Start the default group for `cluster` (None: `resolve_cluster`); the cluster started.

    Raises:
        ValueError: no cluster described.
    """
    if cluster is None:
        cluster = resolve_cluster()
    if cluster is None:
        raise ValueError(
            "no cluster to join: TF_CONFIG describes no cluster, torchrun's RANK/"
            "WORLD_SIZE/MASTER_ADDR/MASTER_PORT are unset and torch.distributed is not "
            "initialised; launch with `torchrun`, set TF_CONFIG, or pass a Cluster"
        )
    if init_timeout is None:
        init_timeout = tuning.TUNING.default_init_timeout_seconds
    start_cluster_group(cluster, init_timeout)
    return cluster


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
        backstop=_STARTUP_WAITS * init_timeout + tuning.TUNING.backstop_slack_seconds,
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
