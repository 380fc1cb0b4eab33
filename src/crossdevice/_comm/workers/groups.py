"""`Groups`: a communicator's own torch.distributed process groups, and their end.

Every communicator creates its own groups (Gloo for host values and all metadata, NCCL
for CUDA values when available), so two communicators (two strategies) never mix their
collectives. A failed communicator's groups cannot simply be freed: dropping the last
reference to a Gloo group with pending work blocks (measured: until the work's own
timeout) holding the GIL, and `abort()` does not cancel Gloo work (measured), so they are
unregistered from torch.distributed and kept alive for ever (`FAILED`): the process can
still exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from crossdevice._comm.workers.calls import WaitFailedError
from crossdevice._core.options import CommunicationImplementation

__all__ = ["FAILED", "Groups", "shared_devices"]

_LOG = logging.getLogger("crossdevice")
#: Not empty once this process has warned that its workers share CUDA devices.
_WARNED: list[bool] = []

#: Process groups (and work) of failed communicators, never freed (see the module doc).
FAILED: list[Any] = []


#: The options of every all-reduce (a process group copies them into each op it starts).
_SUM = dist.AllreduceOptions()
_SUM.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)


class Groups:
    """The host (Gloo) group and, with CUDA and NCCL, the CUDA (NCCL) group of a communicator.

    Every worker creates the same groups in the same order (`new_group`'s contract).
    Workers that share a CUDA device (more workers than GPUs on a host) get no NCCL
    group, because NCCL refuses two ranks on one device: every worker learns every
    worker's device in one Gloo gather, so all of them decide the same, and CUDA values
    then travel through Gloo on the host (one warning per process).

    Args:
        timeout: the groups' own timeout (a backstop behind the communicator's waits).
        implementation: RING keeps CUDA values on Gloo (no NCCL group).
    """

    def __init__(self, timeout: float, implementation: CommunicationImplementation) -> None:
        self.host: Any = None
        self.cuda: Any = None
        delta = datetime.timedelta(seconds=timeout)
        self.host = dist.new_group(backend="gloo", timeout=delta)
        if (
            torch.cuda.is_available()
            and dist.is_nccl_available()
            and implementation != CommunicationImplementation.RING
        ):
            identities: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(identities, _device_identity(), group=self.host)
            shared = shared_devices(identities)
            if not shared:
                self.cuda = dist.new_group(backend="nccl", timeout=delta)
            elif not _WARNED:
                _WARNED.append(True)  # once per process: every communicator finds the same
                _LOG.warning(
                    "workers share CUDA devices (ranks %s) and NCCL refuses two ranks on "
                    "one device, so CUDA values travel through Gloo on the host. For "
                    "NCCL, run one worker per GPU (torchrun --nproc-per-node at most the "
                    "GPU count, or CUDA_VISIBLE_DEVICES per worker).",
                    "; ".join(", ".join(map(str, ranks)) for ranks in shared),
                )
        self.name = str(self.host.group_name)

    def group_for(self, tensor: torch.Tensor) -> Any:
        """The group that carries `tensor`: NCCL's for CUDA tensors (when there is one)."""
        return self.cuda if tensor.is_cuda else self.host

    def all_reduce(self, tensor: torch.Tensor) -> Any:
        """Launch an in-place SUM of `tensor` on its group; returns the work.

        The process group's own method: `torch.distributed.all_reduce`'s checks and
        logging cost ~40 us a call (measured) and guard nothing these tensors need
        (contiguous, of a wire dtype, of this process).
        """
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        return self.group_for(tensor).allreduce([tensor], _SUM)

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        """Launch a send of host `tensor` to rank `peer` on the Gloo group.

        Raises `WaitFailedError` when the link is broken (see `recv`).
        """
        try:
            return self.host.send([tensor], peer, tag)
        except RuntimeError as err:
            raise WaitFailedError(err) from err

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        """Launch a receive into host `tensor` from rank `peer` on the Gloo group.

        Gloo posts a point-to-point op at once, so a connection already closed (a peer
        that quit, or gave up on this worker and dropped its groups) fails the launch
        itself (`Connection closed by peer`), not a later wait. That is a broken link as
        a failed wait's is: `WaitFailedError`, so the communicator looks for the peer at
        fault (`HealthBoard.diagnose`) instead of taking it for this worker's failure.
        """
        try:
            return self.host.recv([tensor], peer, tag)
        except RuntimeError as err:
            raise WaitFailedError(err) from err

    @property
    def alive(self) -> bool:
        """Whether the groups still exist (not destroyed)."""
        return self.host is not None

    def destroy(self, *, keep_alive: bool = False) -> None:
        """Unregister the groups; `keep_alive` never frees them (a failed communicator)."""
        for attr in ("host", "cuda"):
            group = getattr(self, attr)
            if group is not None:
                setattr(self, attr, None)
                if keep_alive:
                    FAILED.append(group)
                    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
                with contextlib.suppress(Exception):  # best effort: it may be gone already
                    dist.destroy_process_group(group)


def _device_identity() -> tuple[str, str]:
    """This worker's host and current CUDA device (its UUID: the same card under any index)."""
    index = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return socket.gethostname(), str(uuid if uuid is not None else index)


def shared_devices(identities: Sequence[tuple[str, str]]) -> list[list[int]]:
    """The ranks that share a (host, CUDA device), in groups of two or more; [] when none.

    `identities[rank]` is the worker's `(host, device)`.
    """
    ranks: dict[tuple[str, str], list[int]] = {}
    for rank, identity in enumerate(identities):
        ranks.setdefault((identity[0], identity[1]), []).append(rank)
    return [group for group in ranks.values() if len(group) > 1]
