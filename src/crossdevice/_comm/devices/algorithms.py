"""Collective algorithms as pure functions over one array per device.

Each function takes the arrays of the participating devices (NumPy arrays or torch
tensors, all of one library, dtype and shape) and the canonical device string of each,
and returns new arrays; inputs are never written. Moving an array to a device goes
through the array backend, so on logical CPU devices (which share host memory) a "copy"
is free and results may be one shared object: callers decide whether to copy or
freeze before handing results out (see `crossdevice._cross_device.results`).

The phases are named as in the textbooks and in TF's `cross_device_utils.py`.

On GPUs (every array a CUDA tensor on a CUDA device of its own, a dtype NCCL sums
natively, no user `accumulation_fn`) the reduce phases are `torch.cuda.nccl.reduce` and
the broadcasts `torch.cuda.nccl.broadcast`, as `torch.nn.parallel.comm.reduce_add` and
`broadcast_coalesced` do: one grouped launch instead of a chain of `Tensor.to` copies,
each ordered behind everything queued on two streams. NCCL adds in its own order, so
on GPUs these sums are not the in-order chain the host path computes bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from crossdevice._arrays import backend_for, is_torch
from crossdevice._comm.devices import nccl_calls
from crossdevice._core.reduce_op import ReduceOp

__all__ = [
    "AccumulationFn",
    "broadcast",
    "gather_to_one",
    "hierarchical_copy_all_reduce",
    "hierarchical_roots",
    "reduce_to_one",
    "sum_n",
]

#: A function that adds a list of arrays (TF's `accumulation_fn`, `tf.math.add_n` by default).
AccumulationFn = Callable[[list[Any]], Any]


def sum_n(values: Sequence[Any]) -> Any:
    """`values[0] + values[1] + ...`, added in order into a new array.

    Every default accumulation of crossdevice goes through this one function, so the
    host kernel (`NumpyBackend.sum_n`) can be made fast in one place.

    Args:
        values: arrays of one library, dtype and shape, already on one device.

    Returns:
        A new array; for a single value, a copy of it.

    Example:
        >>> import numpy as np
        >>> sum_n([np.ones(2), np.ones(2), np.ones(2)]).tolist()
        [3.0, 3.0]
    """
    if not values:
        raise ValueError("sum_n needs at least one array to add, got an empty list")
    return backend_for(values[0]).sum_n(values)


def _partial_sum(values: Sequence[Any]) -> Any:
    """The sum of `values` without copying a single value (it is only read afterwards)."""
    return values[0] if len(values) == 1 else sum_n(values)


def _to(value: Any, device: str) -> Any:
    return backend_for(value).to_device(value, device)


def _scale(total: Any, reduce_op: ReduceOp, count: int) -> Any:
    if reduce_op is ReduceOp.MEAN:
        return backend_for(total).divide(total, count)
    return total


def _divide_owned(total: Any, count: int) -> Any:
    """MEAN of a buffer we own: floats divide in place, integers become floats (TF)."""
    if total.is_floating_point() or total.is_complex():
        return total.div_(count)
    return backend_for(total).divide(total, count)


def _nccl_reducible(values: Sequence[Any]) -> bool:
    """Whether `values` can be summed by `torch.cuda.nccl.reduce` (see the module docstring)."""
    return (
        len(values) > 1
        and nccl_calls.on_distinct_gpus(values)
        and nccl_calls.sum_route(values[0].dtype).kind == nccl_calls.NATIVE
    )


def _nccl_reduce(values: Sequence[Any], root: int, reduce_op: ReduceOp) -> Any:
    """NCCL reduce of `values` into a new tensor on `values[root]`'s device (inputs only read)."""
    import torch

    inputs = [v if v.is_contiguous() else v.contiguous() for v in values]
    route = nccl_calls.sum_route(inputs[0].dtype)
    average = reduce_op is ReduceOp.MEAN and route.floating and nccl_calls.has_avg()
    out = torch.empty_like(inputs[root], memory_format=torch.contiguous_format)
    if out.numel() > 0:
        nccl_calls.reduce(inputs, out, root, nccl_calls.NCCL_AVG if average else route.op)
    if reduce_op is ReduceOp.MEAN and not average:
        out = _divide_owned(out, len(values))
    return out


def reduce_to_one(
    values: Sequence[Any],
    device: str,
    reduce_op: ReduceOp = ReduceOp.SUM,
    accumulation_fn: AccumulationFn | None = None,
) -> Any:
    """Reduce one array per device onto `device` (TF's `_simple_reduce`).

    Args:
        values: one array per participating device, in replica order.
        device: the canonical device to reduce on.
        reduce_op: SUM adds; MEAN adds then divides by `len(values)`.
        accumulation_fn: adds a list of arrays on `device`; default `sum_n` (in order).

    Returns:
        The reduced array on `device`. With a custom `accumulation_fn` it may be one of
        the inputs (e.g. for a single value); the caller copies before handing it out.

    Example:
        >>> import numpy as np
        >>> reduce_to_one([np.array([1.0]), np.array([3.0])], "CPU:0", ReduceOp.MEAN).tolist()
        [2.0]
    """
    if not values:
        raise ValueError("per_replica_value must be non-empty: reduce_to_one got no values")
    if accumulation_fn is None and _nccl_reducible(values):
        target = nccl_calls.cuda_device_of(device)
        roots = [k for k, v in enumerate(values) if v.device.index == target]
        if roots:
            # reduce: one NCCL reduce onto the device (torch's comm.reduce_add)
            return _nccl_reduce(values, roots[0], reduce_op)
    # gather: copy every value to the reduce device
    gathered = [_to(v, device) for v in values]
    # accumulate, in replica order
    total = accumulation_fn(gathered) if accumulation_fn is not None else sum_n(gathered)
    # scale
    return _scale(total, reduce_op, len(values))


def gather_to_one(values: Sequence[Any], device: str, axis: int) -> Any:
    """Concatenate one array per device along `axis` on `device` (TF's `_simple_gather`).

    Args:
        values: one array per device, equal in shape except along `axis`.
        device: the canonical device to concatenate on.
        axis: the axis to concatenate along (negative counts from the end).

    Returns:
        A new array on `device`.
    """
    if not values:
        raise ValueError("gather_to_one needs at least one value, got none")
    # gather: copy every value to the gathering device
    gathered = [_to(v, device) for v in values]
    # concatenate
    return backend_for(gathered[0]).concat(gathered, axis)


def broadcast(value: Any, devices: Sequence[str]) -> list[Any]:
    """`value` moved to each of `devices` (free between host devices: the same object).

    Args:
        value: the array to send.
        devices: canonical destination devices.

    Returns:
        One array per device, in the order of `devices`. Between distinct CUDA devices
        it is one `torch.cuda.nccl.broadcast` (of the bytes: any dtype) from the device
        that holds `value`; the result there is `value` itself, as with copies.
    """
    nccl = _nccl_broadcast(value, devices)
    if nccl is not None:
        return nccl
    return [_to(value, d) for d in devices]


def _nccl_broadcast(value: Any, devices: Sequence[str]) -> list[Any] | None:
    """`broadcast` through NCCL, or None where it cannot run (then copies do the work)."""
    if len(devices) < 2 or not is_torch(value) or value.device.type != "cuda":
        return None
    targets = [nccl_calls.cuda_device_of(d) for d in devices]
    indices = [t for t in targets if t is not None]
    if len(set(indices)) != len(targets) or value.device.index not in indices:
        return None
    if not nccl_calls.nccl_available():
        return None
    import torch

    source = value if value.is_contiguous() else value.contiguous()
    out = [
        source
        if t == source.device.index
        else torch.empty_like(source, device=torch.device("cuda", t))
        for t in indices
    ]
    if source.numel() > 0:
        # Bytes, not elements: a broadcast copies bits, so every dtype goes (bool and
        # float8 are bytes to torch anyway; complex and int16 have no NCCL type).
        wire = [t.reshape(-1).view(torch.uint8) for t in out]
        nccl_calls.broadcast(wire, indices.index(source.device.index))
    return out


def hierarchical_roots(num_devices: int, index: int) -> tuple[int, int]:
    """The two roots `(m0, m1)` of the `index`-th all-reduce of a hierarchical copy.

    The devices split into two halves, `[0, g)` and `[g, N)` with `g = N // 2` (the
    second half takes the extra device when N is odd). `m0 = index % N` rotates over all
    devices to spread the load, and `m1` is its partner in the other half: `m0 + g` for a
    first-half root, `(m0 - g) % g` for a second-half one. For even N this is TF's
    `(m0 + g) % N` (the i <-> i+4 links of a DGX-1).

    Args:
        num_devices: N, at least 2.
        index: which tensor or pack of the batch is reduced.

    Returns:
        `(m0, m1)`: the root of `m0`'s half and the root of the other half.

    Example:
        >>> hierarchical_roots(8, 5)
        (5, 1)
        >>> hierarchical_roots(3, 2)
        (2, 0)
    """
    if num_devices < 2:
        raise ValueError(f"a hierarchical copy needs at least 2 devices, got {num_devices}")
    half = num_devices // 2
    m0 = index % num_devices
    m1 = m0 + half if m0 < half else (m0 - half) % half
    return m0, m1


def hierarchical_copy_all_reduce(
    values: Sequence[Any],
    devices: Sequence[str],
    reduce_op: ReduceOp = ReduceOp.SUM,
    index: int = 0,
) -> list[Any]:
    """All-reduce one array per device along TF's DGX-1 hierarchy, for every N.

    TF's `aggregate_gradients_using_hierarchical_copy` sums `[0, g)` and `[g, 2g)` with
    `g = N // 2`, so for odd N it silently drops device N-1's input while still sending it
    the (wrong) total. Here the second half is `[g, N)`: every device is summed.

    Args:
        values: one array per device, in device order.
        devices: the canonical device of each array.
        reduce_op: SUM, or MEAN (the total is divided once, on the root, before the copies).
        index: the position of this array in its batch; it picks the rotating roots.

    Returns:
        One result per device. On host devices the copies are free, so every result may
        be one shared array; for N = 1 the result is the input itself.

    Example:
        >>> import numpy as np
        >>> out = hierarchical_copy_all_reduce(
        ...     [np.array([1]), np.array([2]), np.array([4])], ["CPU:0", "CPU:1", "CPU:2"]
        ... )
        >>> [o.tolist() for o in out]
        [[7], [7], [7]]
    """
    n = len(values)
    if n != len(devices):
        raise ValueError(
            f"hierarchical_copy_all_reduce needs one device per value, got {n} values and "
            f"{len(devices)} devices ({list(devices)})"
        )
    if n == 0:
        raise ValueError("hierarchical_copy_all_reduce needs at least one value, got none")
    if n == 1:
        # TF never gets here (the single-replica shortcut hides it; add_n of [] would fail).
        return [_scale(values[0], reduce_op, 1)]
    if _nccl_reducible(values):
        return _hierarchical_copy_nccl(values, devices, reduce_op, index)
    half = n // 2
    m0, m1 = hierarchical_roots(n, index)
    first, second = range(half), range(half, n)
    own, other = (first, second) if m0 < half else (second, first)
    # reduce the other half onto its root m1
    partial = _partial_sum([_to(values[j], devices[m1]) for j in other])
    # reduce m0's half, then the other half's partial sum, onto m0: in-order addition makes
    # this bitwise equal to TF's add_n(sum_own, sum_other) while saving one temporary.
    total = sum_n([*(_to(values[j], devices[m0]) for j in own), _to(partial, devices[m0])])
    total = _scale(total, reduce_op, n)
    # copy the total back to the other half's root
    total_m1 = _to(total, devices[m1])
    # broadcast: every device copies from the root of its own half
    return [_to(total if j in own else total_m1, devices[j]) for j in range(n)]


def _hierarchical_copy_nccl(
    values: Sequence[Any], devices: Sequence[str], reduce_op: ReduceOp, index: int
) -> list[Any]:
    """`hierarchical_copy_all_reduce` with NCCL reduces and broadcasts inside each half.

    Each half always uses the same device list (so torch's communicator cache holds two
    communicators, whatever the rotating roots); the roots exchange by one P2P copy each
    way. The total is `sum(own half) + sum(other half)`, each half summed in NCCL's order.
    """
    n = len(values)
    half = n // 2
    m0, m1 = hierarchical_roots(n, index)
    first, second = list(range(half)), list(range(half, n))
    own, other = (first, second) if m0 < half else (second, first)
    values = [v if v.is_contiguous() else v.contiguous() for v in values]
    # reduce the other half onto its root m1 (its value itself for a half of one)
    if len(other) > 1:
        partial = _nccl_reduce([values[j] for j in other], other.index(m1), ReduceOp.SUM)
    else:
        partial = values[m1]
    # reduce m0's half onto m0, into a buffer of ours
    if len(own) > 1:
        total = _nccl_reduce([values[j] for j in own], own.index(m0), ReduceOp.SUM)
    else:
        total = values[m0].clone()
    # add the other half's partial sum (one P2P copy into m0)
    total.add_(partial.to(total.device))
    if reduce_op is ReduceOp.MEAN:
        total = _divide_owned(total, n)
    # copy the total back to the other half's root
    total_m1 = total.to(values[m1].device)
    # broadcast: every device gets the total from the root of its own half
    out: list[Any] = [None] * n
    for members, root_value in ((own, total), (other, total_m1)):
        copies = broadcast(root_value, [devices[j] for j in members])
        for j, result in zip(members, copies, strict=True):
            out[j] = result
    return out
