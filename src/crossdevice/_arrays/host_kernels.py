"""Bandwidth-optimal in-order sums of host NumPy arrays.

An all-reduce of N host arrays of S bytes must read N·S bytes and write S; the physical
limit is memory bandwidth (docs/design.md §4). The naive chain `out = x0 + x1; out += x2; ...`
streams the accumulator through DRAM once per input (about 3·(N-1)·S bytes). Here the
work is cut into cache-sized blocks: each block of the accumulator stays in cache while
every input's block is added to it, so each input byte is read from DRAM once and the
result written once.

The adds run in replica order, `((x0 + x1) + x2) + ...`, element by element exactly as
the naive chain does, so results are bitwise identical to it (and to TF's in-order
`add_n` on one device) whatever the block size, the thread split or the timing.

Large sums are split across a small persistent worker pool (NumPy releases the GIL in
its loops). `sum_slice` is the building block the replica threads of a
`ThreadCommunicator` call directly, each on its own slice (a reduce-scatter).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from crossdevice._arrays import native
from crossdevice._arrays.buffer_pool import BufferPool
from crossdevice._core import tuning

__all__ = [
    "available_cpus",
    "can_sum_fast",
    "plain_sum",
    "run_parallel",
    "sum_n",
    "sum_slice",
]


def available_cpus() -> int:
    """The number of CPUs this process may run on (its affinity mask where known)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS/Windows have no sched_getaffinity
        return os.cpu_count() or 1


def sum_slice(
    inputs: Sequence[np.ndarray],
    out: np.ndarray,
    start: int = 0,
    stop: int | None = None,
    *,
    divisor: int | None = None,
    block_elements: int | None = None,
    stream: bool = False,
) -> None:
    """`out[start:stop] = inputs[0][start:stop] + inputs[1][start:stop] + ...`, in order.

    All arrays are 1-D with the same length and dtype (flat views of the real arrays).
    The range is processed in cache-sized blocks: per block, the accumulator block stays
    in cache while each input's block is added to it in replica order, so the result is
    bitwise identical to the naive chain. Replica threads call this on disjoint ranges of
    a shared `out` (a reduce-scatter); it never blocks.

    Args:
        inputs: one or more 1-D arrays, added in this order.
        out: the 1-D output; it may be `inputs[0]` itself (in-place accumulation).
        start: first element of the range.
        stop: one past the last element; None means `len(out)`.
        divisor: if given, each block of the sum is then divided by it in place (a MEAN
            while the block is still in cache); bitwise equal to `np.true_divide(sum, n)`
            for floating-point `out`.
        block_elements: elements per block (default: the whole range below
            `TUNING.blocked_min_bytes`, else `TUNING.block_bytes` worth).
        stream: the whole result is far larger than the caches: the compiled kernel, when
            it runs, writes it with non-temporal stores (`TUNING.stream_min_bytes`).

    Example:
        >>> xs = [np.arange(5, dtype=np.float32) for _ in range(3)]
        >>> out = np.empty(5, np.float32)
        >>> sum_slice(xs, out, 1, 4)
        >>> out[1:4]
        array([3., 6., 9.], dtype=float32)
    """
    if stop is None:
        stop = out.shape[0]
    if stop <= start:
        return
    n = len(inputs)
    if n == 0:
        raise ValueError("sum_slice expected at least one input array, received none")
    if block_elements is None:
        # A range that fits in cache is one block (the plain chain is fastest there).
        itemsize = max(1, out.itemsize)
        small = (stop - start) * itemsize < tuning.TUNING.blocked_min_bytes
        block_elements = stop - start if small else max(1, tuning.TUNING.block_bytes // itemsize)
    block = block_elements
    add = np.add
    first = inputs[0]
    if n == 1:
        np.copyto(out[start:stop], first[start:stop])
        if divisor is not None:
            np.true_divide(out[start:stop], divisor, out=out[start:stop])
        return
    if (stop - start) * out.itemsize >= tuning.TUNING.native_min_bytes and native.can_sum(
        inputs, out, divisor
    ):
        native.fused_sum(inputs, out, start, stop, divisor=divisor, stream=stream)
        return
    second = inputs[1]
    rest = inputs[2:]
    for lo in range(start, stop, block):
        hi = lo + block if lo + block < stop else stop
        acc = out[lo:hi]
        add(first[lo:hi], second[lo:hi], out=acc)
        for x in rest:
            add(acc, x[lo:hi], out=acc)
        if divisor is not None:
            np.true_divide(acc, divisor, out=acc)


def plain_sum(inputs: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """The naive in-order chain `x0 + x1`, then `+= x2`, ... (NumPy broadcasting rules).

    This is the reference the fast paths must match bitwise, and the path for small,
    broadcast, mixed-dtype or overlapping operands.
    """
    if len(inputs) == 1:
        if out is None:
            return np.array(inputs[0], copy=True)
        np.copyto(out, inputs[0])
        return out
    if out is None:
        # np.add of 0-d arrays returns a NumPy scalar, which cannot take `out=` below.
        out = np.asarray(np.add(inputs[0], inputs[1]))
    else:
        np.add(inputs[0], inputs[1], out=out)
    for x in inputs[2:]:
        np.add(out, x, out=out)
    return out


def can_sum_fast(inputs: Sequence[np.ndarray], out: np.ndarray | None) -> bool:
    """Whether the blocked kernel gives the same result as `plain_sum` for these operands.

    That needs two or more arrays of one shape and one numeric dtype, all C-contiguous
    (so flat views exist), and an `out` of that shape and dtype that overlaps no input
    except by being one of them exactly (the naive chain and the blocked kernel then do
    the same element-wise operations).
    """
    if len(inputs) < 2:
        return False
    first = inputs[0]
    dtype = first.dtype
    shape = first.shape
    if dtype.kind not in "biufc" or dtype.kind == "b":
        return False
    for x in inputs:
        if x.dtype != dtype or x.shape != shape or not x.flags.c_contiguous:
            return False
    if out is None:
        return True
    if out.dtype != dtype or out.shape != shape or not out.flags.c_contiguous:
        return False
    if not out.flags.writeable:
        return False
    out_ptr = out.__array_interface__["data"][0]
    for x in inputs:
        if np.may_share_memory(x, out) and x.__array_interface__["data"][0] != out_ptr:
            return False
    return True


class _Pool:
    """A lazily started, persistent pool of summing threads (one per extra CPU)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.workers = max(0, min(available_cpus(), 8) - 1)

    def executor(self) -> concurrent.futures.ThreadPoolExecutor | None:
        if self.workers == 0:
            return None
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.workers, thread_name_prefix="crossdevice-sum"
                )
            return self._executor


_POOL: Final = _Pool()

#: Recycled outputs of large sums. A fresh allocation is zero-filled page by page on first
#: touch: measured, 4 x 64 MiB float32, 13.3-15.4 ms into a new array vs 10.4-11.2 ms
#: into a reused one (medians of 9, the 2-core dev machine).
_OUTPUTS: Final = BufferPool()


def _split(size: int, parts: int, align: int) -> list[tuple[int, int]]:
    """`parts` contiguous ranges covering `range(size)`, boundaries multiples of `align`."""
    bounds = [0]
    for i in range(1, parts):
        b = (size * i // parts) // align * align
        bounds.append(max(b, bounds[-1]))
    bounds.append(size)
    return [(bounds[i], bounds[i + 1]) for i in range(parts) if bounds[i + 1] > bounds[i]]


def run_parallel(task: Callable[[int], None], parts: int | None = None) -> None:
    """Run `task(0)`, ..., `task(parts - 1)` at once: part 0 here, the rest on the pool.

    Waits for every part and re-raises the first exception. `parts` defaults to one per
    CPU. The tasks must not wait for each other (they are NumPy work, not rendezvous).
    """
    parts = _POOL.workers + 1 if parts is None else parts
    executor = _POOL.executor() if parts > 1 else None
    futures: list[concurrent.futures.Future[None]] = []
    if executor is not None:
        try:
            futures = [executor.submit(task, k) for k in range(1, parts)]
        except RuntimeError:  # interpreter shutting down: the pool takes no new work
            futures = []
    first_error: BaseException | None = None
    try:
        task(0)
        if not futures:
            for k in range(1, parts):
                task(k)
    except BaseException as exc:
        first_error = exc
    # Pure NumPy tasks with no waits of their own: these joins cannot hang.
    for future in futures:
        failure = future.exception()
        if first_error is None and failure is not None:
            first_error = failure
    if first_error is not None:
        raise first_error


def sum_n(
    inputs: Sequence[np.ndarray],
    out: np.ndarray | None = None,
    *,
    parallel: bool = True,
) -> np.ndarray:
    """`inputs[0] + inputs[1] + ...` added in order, bitwise equal to the naive chain.

    Same-shape, same-dtype, contiguous arrays of at least `TUNING.native_min_bytes` are
    summed by `sum_slice` (the compiled kernel where it runs) into a recycled output,
    blocked and split across the worker pool from `TUNING.blocked_min_bytes` /
    `TUNING.kernel_parallel_min_bytes` on;
    anything else (broadcasting, mixed dtypes, small arrays) takes `plain_sum`.

    Args:
        inputs: the arrays, in replica order.
        out: where to write the result (may be `inputs[0]`). When None, a new array, or
            for large sums a recycled buffer that nothing references any more.
        parallel: allow the worker pool (replica threads that already run in parallel
            pass False).

    Returns:
        `out`, or the new result array.

    Example:
        >>> xs = [np.full(3, i, np.float32) for i in range(4)]
        >>> sum_n(xs)
        array([6., 6., 6.], dtype=float32)
    """
    if len(inputs) == 0:
        raise ValueError("sum_n expected at least one array, received an empty sequence")
    arrays = [np.asarray(x) for x in inputs]
    nbytes = arrays[0].nbytes
    if nbytes < tuning.TUNING.native_min_bytes or not can_sum_fast(arrays, out):
        return plain_sum(arrays, out)
    if out is None:
        # A recycled buffer: fresh memory is faulted in and zeroed page by page, which
        # costs more than the sum (ReductionToOneDevice.batch_reduce of 160 gradients of
        # <= 2.4 MB: 117-159 ms into fresh outputs, 51-67 ms into recycled ones).
        first = arrays[0]
        out = _OUTPUTS.take(first.dtype, first.size).reshape(first.shape)
    flats = [x.reshape(-1) for x in arrays]
    flat_out = out.reshape(-1)
    size = flat_out.shape[0]
    executor = (
        _POOL.executor() if parallel and nbytes >= tuning.TUNING.kernel_parallel_min_bytes else None
    )
    stream = out.nbytes >= tuning.TUNING.stream_min_bytes
    if executor is None or size == 0:
        sum_slice(flats, flat_out, 0, size, stream=stream)
        return out
    block = max(1, tuning.TUNING.block_bytes // out.itemsize)
    ranges = _split(size, _POOL.workers + 1, block)
    run_parallel(
        lambda k: sum_slice(flats, flat_out, *ranges[k], block_elements=block, stream=stream),
        len(ranges),
    )
    return out
