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
from typing import Any

import torch
import torch.distributed as dist

from crossdevice._core.options import CommunicationImplementation

__all__ = ["FAILED", "Groups"]

#: Process groups (and work) of failed communicators, never freed (see the module doc).
FAILED: list[Any] = []


#: The options of every all-reduce (a process group copies them into each op it starts).
_SUM = dist.AllreduceOptions()
_SUM.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)


class Groups:
    """The host (Gloo) group and, with CUDA and NCCL, the CUDA (NCCL) group of a communicator.

    Every worker creates the same groups in the same order (`new_group`'s contract).

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
            self.cuda = dist.new_group(backend="nccl", timeout=delta)
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
        """Launch a send of host `tensor` to rank `peer` on the Gloo group."""
        return self.host.send([tensor], peer, tag)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        """Launch a receive into host `tensor` from rank `peer` on the Gloo group."""
        return self.host.recv([tensor], peer, tag)

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
