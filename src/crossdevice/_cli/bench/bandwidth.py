"""Measure host memory bandwidth: the physical limit of host collectives.

An all-reduce of N host arrays of S bytes must read every input once and write the
result once: (N+1)·S bytes. At memory bandwidth B it cannot take less than
(N+1)·S / B seconds (docs/design.md §4). B is measured as the design defines it: a large
`np.copyto`, once on one thread and once split across every CPU, counting the bytes read
plus the bytes written per second, and taking the better of the two.

A copy also reads each destination cache line before overwriting it (write-allocate), a
traffic the (N+1)·S count leaves out for the reduction too; a blocked reduction that keeps
its accumulator in cache pays that extra read on S bytes only, the copy on all it
writes, so a well-blocked all-reduce can reach slightly more than 100% of this limit.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections.abc import Callable
from typing import Final

import numpy as np

from crossdevice._arrays.host_kernels import available_cpus

__all__ = [
    "DEFAULT_COPY_BYTES",
    "MemoryBandwidth",
    "all_reduce_limit_seconds",
    "measure_memory_bandwidth",
]

#: Bytes copied per measurement: far beyond the last-level cache (32 MiB on the dev
#: machine), so the copy streams from and to DRAM.
DEFAULT_COPY_BYTES: Final = 256 * 1024 * 1024

#: How long any one thread of the all-cores copy may take before the measurement is
#: abandoned (a healthy 256 MiB copy takes about 20 ms).
_THREAD_TIMEOUT_S: Final = 60.0


@dataclasses.dataclass(frozen=True)
class MemoryBandwidth:
    """Host memory bandwidth, in bytes read plus written per second.

    Attributes:
        single_thread: median bandwidth of a one-thread `np.copyto`.
        all_cores: median bandwidth of the same copy split across `threads` threads.
        threads: the number of threads of the all-cores copy.
        copy_bytes: the size of the copied array.
        repeats: measurements per mode.
    """

    single_thread: float
    all_cores: float
    threads: int
    copy_bytes: int
    repeats: int

    @property
    def best(self) -> float:
        """The better of the single-thread and all-cores bandwidths (bytes/s)."""
        return max(self.single_thread, self.all_cores)

    def as_dict(self) -> dict[str, float | int]:
        """A JSON-ready dict (GB/s are 1e9 bytes per second)."""
        return {
            "single_thread_GBps": self.single_thread / 1e9,
            "all_cores_GBps": self.all_cores / 1e9,
            "best_GBps": self.best / 1e9,
            "threads": self.threads,
            "copy_bytes": self.copy_bytes,
            "repeats": self.repeats,
        }


def all_reduce_limit_seconds(num_inputs: int, nbytes: int, bandwidth: float) -> float:
    """The fastest an all-reduce of `num_inputs` host arrays of `nbytes` each can run.

    Args:
        num_inputs: N, the number of replicas' arrays.
        nbytes: S, the bytes of each array.
        bandwidth: memory bandwidth in bytes (read + written) per second.

    Returns:
        (N+1)·S / bandwidth seconds: every input read once, one result written.

    Example:
        >>> all_reduce_limit_seconds(4, 64 * 2**20, 25e9) * 1e3  # doctest: +ELLIPSIS
        13.42...
    """
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, received {bandwidth!r}")
    return (num_inputs + 1) * nbytes / bandwidth


def _median_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: page faults, thread start-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _ParallelCopy:
    """Copies `src` into `dst` with `threads` persistent threads, one slice each.

    The threads are started once and synchronised per copy, so thread creation is not
    timed. Every wait has a timeout; `close()` stops and joins them.
    """

    def __init__(self, dst: np.ndarray, src: np.ndarray, threads: int) -> None:
        size = src.shape[0]
        self._bounds = [size * k // threads for k in range(threads + 1)]
        self._dst, self._src = dst, src
        self._start = threading.Barrier(threads + 1, timeout=_THREAD_TIMEOUT_S)
        self._done = threading.Barrier(threads + 1, timeout=_THREAD_TIMEOUT_S)
        self._workers = [
            threading.Thread(target=self._work, args=(k,), daemon=True, name=f"crossdevice-bw-{k}")
            for k in range(threads)
        ]
        for worker in self._workers:
            worker.start()

    def _work(self, k: int) -> None:
        lo, hi = self._bounds[k], self._bounds[k + 1]
        try:
            while True:
                self._start.wait()
                np.copyto(self._dst[lo:hi], self._src[lo:hi])
                self._done.wait()
        except threading.BrokenBarrierError:
            return  # close() aborted the barriers

    def __call__(self) -> None:
        self._start.wait()
        self._done.wait()

    def close(self) -> None:
        self._start.abort()
        self._done.abort()
        for worker in self._workers:
            worker.join(_THREAD_TIMEOUT_S)


def measure_memory_bandwidth(
    copy_bytes: int = DEFAULT_COPY_BYTES,
    repeats: int = 5,
    threads: int | None = None,
) -> MemoryBandwidth:
    """Measure memory bandwidth with a large `np.copyto`, one thread and all cores.

    Args:
        copy_bytes: size of the copied array (keep it well above the last-level cache).
        repeats: timed copies per mode; the median is kept.
        threads: threads of the all-cores copy (default: the CPUs this process may use).

    Returns:
        The measured `MemoryBandwidth`; `.best` is the limit to compare against.

    Example:
        >>> bw = measure_memory_bandwidth(8 * 2**20, repeats=1)
        >>> bw.best > 0
        True
    """
    if copy_bytes < 8 or repeats < 1:
        raise ValueError(
            f"measure_memory_bandwidth needs copy_bytes >= 8 and repeats >= 1, received "
            f"copy_bytes={copy_bytes!r}, repeats={repeats!r}"
        )
    threads = threads or available_cpus()
    src = np.ones(copy_bytes // 8, dtype=np.float64)
    dst = np.zeros_like(src)  # zeros_like writes every page: no page faults are timed
    moved = 2 * src.nbytes
    single = _median_seconds(lambda: np.copyto(dst, src), repeats)
    if threads > 1:
        copy = _ParallelCopy(dst, src, threads)
        try:
            parallel = _median_seconds(copy, repeats)
        finally:
            copy.close()
    else:
        parallel = single
    return MemoryBandwidth(
        single_thread=moved / single,
        all_cores=moved / parallel,
        threads=threads,
        copy_bytes=src.nbytes,
        repeats=repeats,
    )
