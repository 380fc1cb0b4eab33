"""All_gather and broadcast across workers: one value each, its shape in the fingerprint.

A gather's or broadcast's fingerprint says the one value's rank, dtype and shape
(`value_print`); once every worker's is known, the checks raise the same ValueError on
every worker (they all read the same table) before data moves, and refuse to allocate
what a peer's (untrusted) header asks for beyond `MAX_PEER_BYTES`; then the data moves
(`gather`, `broadcast`): padded to the largest size along a gather's axis, on NCCL when
any worker's value lives on CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch
import torch.distributed as dist

from crossdevice._comm.workers import fingerprint as fp
from crossdevice._comm.workers.calls import Call
from crossdevice._comm.workers.wire import DTYPE_CODES, Wire, dtype_name, wire_dtype
from crossdevice._sync.call import CallSignature, cached_digest

__all__ = [
    "MAX_PEER_BYTES",
    "broadcast",
    "check_allocation",
    "check_broadcast",
    "check_gather",
    "common_device",
    "gather",
    "value_print",
]

#: Runs one process-group op of the collective (`op(*args)` on the right group), waited on.
Launch = Callable[..., None]

#: Largest buffer a peer's header may make this worker allocate (all_gather padding,
#: a broadcast received without a value of our own): headers are untrusted input.
MAX_PEER_BYTES: Final = 1 << 36


def value_print(
    call: Call,
    kind: str,
    wire: Wire | None,
    arg: int,
    local: int,
    signature: CallSignature | None = None,
) -> fp.Fingerprint:
    """The fingerprint of a gather or broadcast of `wire` (None: a broadcast receiver's).

    `signature`: what a gather's rows stand for (`GatherOptions.signature`): its op goes
    in `op`, and its leaves and call site in `structure`, the fields every worker compares.
    """
    if wire is None:
        return fp.Fingerprint(call.seq, kind, local_replicas=local, arg=arg)
    shape = tuple(wire.tensor.shape)  # at most fp.MAX_NDIM: NumPy's own limit
    op, structure = "none", 0
    if signature is not None:
        op = signature.argument.lower()
        structure = cached_digest((signature.structure_digest(), signature.shapes_digest()))
    return fp.Fingerprint(
        call.seq,
        kind,
        op=op,
        structure=structure,
        local_replicas=local,
        buffers=1,
        nbytes=wire.tensor.numel() * wire.tensor.element_size(),
        arg=arg,
        cuda=wire.tensor.is_cuda,
        ndim=len(shape),
        dtype_code=DTYPE_CODES.index(wire.dtype),
        shape=shape,
    )


def check_allocation(
    call: Call,
    like: torch.Tensor | None,
    numel: int,
    axis: int,
    dtype: torch.dtype | None = None,
) -> None:
    """Refuse to allocate more than `MAX_PEER_BYTES` because a peer's header says so."""
    itemsize = torch.empty((), dtype=dtype or like.dtype).element_size()  # type: ignore[union-attr]
    other = 1
    if like is not None and like.dim():
        other = like.numel() // max(1, like.shape[axis])
    if numel * other * itemsize > MAX_PEER_BYTES:
        raise ValueError(
            f"{call.label}: the peers' shapes would make this worker allocate "
            f"{numel * other * itemsize} bytes, more than MAX_PEER_BYTES="
            f"{MAX_PEER_BYTES}; expected values of a size this worker can hold. Check "
            "the peers' values (a peer sent a corrupt or hostile header?)"
        )


def common_device(prints: Sequence[fp.Fingerprint], cuda_group: Any) -> torch.device:
    """Where a gather or broadcast travels: CUDA (NCCL) if any worker's value is there.

    Decided from the exchanged fingerprints so that every worker picks the same group,
    even when some pass host values or None.
    """
    if cuda_group is not None and any(p.cuda for p in prints):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _describe(prints: Sequence[fp.Fingerprint]) -> str:
    def one(p: fp.Fingerprint) -> str:
        if p.ndim < 0:
            return "None"
        return f"{p.shape} {dtype_name(DTYPE_CODES[p.dtype_code])}"

    return ", ".join(f"rank {rank}: {one(p)}" for rank, p in enumerate(prints))


def check_gather(call: Any, prints: Sequence[fp.Fingerprint], axis: int) -> int:
    """The normalised gather axis; ValueError (alike on every worker) for bad inputs."""
    ndim = prints[0].ndim
    axes = sorted({p.arg for p in prints})
    problem = None
    if len({(p.ndim, p.dtype_code) for p in prints}) > 1:
        problem = "arrays of different ranks or dtypes"
    elif len(axes) > 1:
        problem = f"different axes {axes}"
    elif not -ndim <= axis < ndim:
        problem = f"axis {axis}, out of range for arrays of rank {ndim}"
    else:
        axis %= ndim
        if len({p.shape[:axis] + p.shape[axis + 1 :] for p in prints}) > 1:
            problem = f"shapes that differ on an axis other than {axis}"
    if problem is not None:
        raise ValueError(
            f"{call.label}: every worker must pass an array of the same rank and dtype whose "
            f"shape differs only along the gather axis, with the same axis; received "
            f"{problem} ({_describe(prints)}); reshape or pad the values so that only the "
            f"gather axis differs"
        )
    return axis


def check_broadcast(
    call: Any, prints: Sequence[fp.Fingerprint], root: int, world_size: int
) -> None:
    """ValueError (alike on every worker) when the workers' broadcast calls disagree."""
    roots = sorted({p.arg for p in prints})
    problem = None
    if len(roots) > 1:
        problem = f"different roots {roots}"
    elif not 0 <= root < world_size:
        problem = f"root {root}, out of range for {world_size} workers"
    elif prints[root].ndim < 0:
        problem = f"no value on root {root}"
    elif any(
        p.ndim >= 0 and (p.ndim, p.dtype_code, p.shape) != (r.ndim, r.dtype_code, r.shape)
        for p in prints
        for r in [prints[root]]
    ):
        problem = "values whose shape or dtype differ from root's"
    if problem is not None:
        raise ValueError(
            f"{call.label}: every worker must name the same root, the root must pass a value "
            f"and the others None or an array of the root's shape and dtype; received "
            f"{problem} ({_describe(prints)})"
        )


def gather(
    call: Call,
    wire: Wire,
    axis: int,
    prints: Sequence[fp.Fingerprint],
    rank: int,
    cuda_group: Any,
    launch: Launch,
) -> torch.Tensor:
    """Every worker's value along `axis`, in rank order, once `prints` (all of them) agree."""
    axis = check_gather(call, prints, axis)
    sizes = [p.shape[axis] for p in prints]
    largest = max(sizes)
    check_allocation(call, wire.tensor, largest * len(prints), axis)
    device = common_device(prints, cuda_group)
    padded = wire.tensor.to(device)
    if wire.tensor.shape[axis] != largest:
        shape = list(wire.tensor.shape)
        shape[axis] = largest
        padded = torch.zeros(shape, dtype=wire.tensor.dtype, device=device)
        padded.narrow(axis, 0, sizes[rank]).copy_(wire.tensor)
    outs = [torch.empty_like(padded) for _ in prints]
    launch(dist.all_gather, outs, padded)
    pieces = [out.narrow(axis, 0, size) for out, size in zip(outs, sizes, strict=True)]
    return torch.cat(pieces, dim=axis)


def broadcast(
    call: Call,
    wire: Wire | None,
    root: int,
    prints: Sequence[fp.Fingerprint],
    rank: int,
    cuda_group: Any,
    launch: Launch,
) -> tuple[Wire, torch.Tensor]:
    """`root`'s value on this worker, once `prints` (all of them) agree: (its wire, the data)."""
    check_broadcast(call, prints, root, len(prints))
    dtype = DTYPE_CODES[prints[root].dtype_code]
    if wire is None:
        wire = Wire(torch.empty(0), dtype, "numpy", torch.device("cpu"))
        check_allocation(call, None, math.prod(prints[root].shape), 0, dtype)
    device = common_device(prints, cuda_group)
    if rank == root:
        buffer = wire.tensor.to(device, copy=True)
    else:
        buffer = torch.empty(prints[root].shape, dtype=wire_dtype(dtype), device=device)
    launch(dist.broadcast, buffer, root)
    return wire, buffer
