"""The implementations `crossdevice bench` times, and the replica threads that drive them.

Each `_Impl` all-reduces one `_Case` (one array per replica) on `ReplicaThreads`; the
table, the checks and the command line are in `bench.py`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from crossdevice._arrays import host_kernels
from crossdevice._comm.local.thread import ThreadCommunicator
from crossdevice._core.reduce_op import ReduceOp

__all__ = ["IMPLEMENTATIONS", "ReplicaThreads"]

#: Seconds any wait of the benchmark's replica threads may take before it gives up.
_WAIT_S: Final = 300.0


class ReplicaThreads:
    """N persistent threads that each run `fn(replica_id)` on demand (bounded waits)."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._start = threading.Barrier(n + 1, timeout=_WAIT_S)
        self._done = threading.Barrier(n + 1, timeout=_WAIT_S)
        self._fn: Callable[[int], Any] | None = None
        self._results: list[Any] = [None] * n
        self._errors: list[BaseException | None] = [None] * n
        self._threads = [
            threading.Thread(target=self._loop, args=(r,), daemon=True, name=f"bench-replica-{r}")
            for r in range(n)
        ]
        for t in self._threads:
            t.start()

    def _loop(self, r: int) -> None:
        try:
            while True:
                self._start.wait()
                fn = self._fn
                if fn is None:
                    return
                try:
                    self._results[r] = fn(r)
                except BaseException as exc:
                    self._errors[r] = exc
                self._done.wait()
        except threading.BrokenBarrierError:
            return

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """`fn(r)` on every replica thread; the results, or the first error raised."""
        self._fn = fn
        self._errors = [None] * self._n
        # Drop the last call's results first: a held result keeps its pooled output
        # buffer busy, and the next all-reduce would pay for a freshly faulted one.
        self._results = [None] * self._n
        self._start.wait()
        self._done.wait()
        for exc in self._errors:
            if exc is not None:
                raise exc
        return list(self._results)

    def close(self) -> None:
        """Stop and join the threads."""
        self._fn = None
        with contextlib.suppress(threading.BrokenBarrierError):
            self._start.wait()
        for t in self._threads:
            t.join(_WAIT_S)


class _Case:
    """One size and dtype: each replica's input and the in-order reference result.

    `tolerance` is the per-element error any summation order may make (floating point;
    None for exact integer sums): N ulps-worth of the sum of magnitudes.
    """

    def __init__(
        self,
        inputs: list[Any],
        expected: np.ndarray,
        tolerance: np.ndarray | None,
        nbytes: int,
        count: int,
    ) -> None:
        self.inputs = inputs
        self.expected = expected.reshape(-1)
        self.tolerance = tolerance
        self.nbytes = nbytes
        self.count = count


class _Impl:
    """An all-reduce implementation under test."""

    name = ""
    description = ""

    def __init__(self, n: int, op: ReduceOp) -> None:
        self.n = n
        self.op = op

    def measure(self, case: _Case, warmup: int, iters: int) -> tuple[list[float], list[Any]]:
        """Per-iteration seconds and one result per replica (from the last iteration)."""
        call = self.prepare(case)
        for _ in range(warmup):
            call()
        times = []
        results: list[Any] = []
        for _ in range(iters):
            start = time.perf_counter()
            results = call()
            times.append(time.perf_counter() - start)
        return times, results

    def prepare(self, case: _Case) -> Callable[[], list[Any]]:
        """A callable running one all-reduce of `case`, returning one result per replica."""
        raise NotImplementedError

    def close(self) -> None:
        """Release threads."""


class _Sharded(_Impl):
    name = "sharded"
    description = "ThreadCommunicator: replica threads each reduce a slice (default host path)"

    def __init__(self, n: int, op: ReduceOp) -> None:
        super().__init__(n, op)
        self._threads = ReplicaThreads(n)
        self._comm = ThreadCommunicator(n, name="bench")

    def measure(self, case: _Case, warmup: int, iters: int) -> tuple[list[float], list[Any]]:
        comm, op, inputs = self._comm, self.op, case.inputs
        stamps: list[float] = []

        def replica(r: int) -> Any:
            mine = [inputs[r]]
            for _ in range(warmup + 1):  # the last warm-up call lines the replicas up
                comm.all_reduce(r, mine, op, timeout=_WAIT_S)
            if r == 0:
                stamps.append(time.perf_counter())
            out = None
            for _ in range(iters):
                out = comm.all_reduce(r, mine, op, timeout=_WAIT_S)
                if r == 0:
                    stamps.append(time.perf_counter())
            return out[0] if out else None

        # Back to back, as replicas run steps: replica 0's completion times give the
        # interval between consecutive all-reduces.
        results = self._threads.run(replica)
        return [b - a for a, b in itertools.pairwise(stamps)], results

    def close(self) -> None:
        self._threads.close()


class _OneThread(_Impl):
    """A cross-replica sum from the calling thread; one shared result for all replicas."""

    def kernel(self, arrays: list[np.ndarray], out: np.ndarray) -> None:
        raise NotImplementedError

    def prepare(self, case: _Case) -> Callable[[], list[Any]]:
        from crossdevice._arrays import backend_for

        first = case.inputs[0]
        be = backend_for(first)
        n, mean = self.n, self.op is ReduceOp.MEAN
        if be.name == "torch" and str(first.dtype) == "torch.bfloat16":
            # NumPy has no bfloat16: torch's own in-order sum.
            def call_torch() -> list[Any]:
                total = be.sum_n(case.inputs)
                return [be.divide(total, n) if mean else total] * n

            return call_torch
        arrays = [np.asarray(x) for x in case.inputs]
        out = np.empty_like(arrays[0])

        def call() -> list[Any]:
            self.kernel(arrays, out)
            return [np.true_divide(out, n) if mean else out] * n

        return call


class _SumN(_OneThread):
    name = "sum_n"
    description = "host_kernels.sum_n from one thread with its worker pool (shared result)"

    def kernel(self, arrays: list[np.ndarray], out: np.ndarray) -> None:
        host_kernels.sum_n(arrays, out)


class _Naive(_OneThread):
    name = "naive"
    description = "pairwise np.add chain, one thread (baseline: one pass per input)"

    def kernel(self, arrays: list[np.ndarray], out: np.ndarray) -> None:
        host_kernels.plain_sum(arrays, out)


class _CrossDeviceOps(_Impl):
    factory = ""

    def prepare(self, case: _Case) -> Callable[[], list[Any]]:
        import crossdevice
        from crossdevice._values.values import PerReplica

        devices = [f"CPU:{i}" for i in range(self.n)]
        ops = getattr(crossdevice, self.factory)()
        value = PerReplica(case.inputs, devices)
        op = self.op

        def call() -> list[Any]:
            reduced = ops.reduce(op, value, destinations=value)
            return list(getattr(reduced, "values", (reduced,)))

        return call


class _ReduceToOne(_CrossDeviceOps):
    name = "reduce_to_one"
    description = "crossdevice.ReductionToOneDevice().reduce(op, v, destinations=v)"
    factory = "ReductionToOneDevice"


class _HierCopy(_CrossDeviceOps):
    name = "hier_copy"
    description = "crossdevice.HierarchicalCopyAllReduce().reduce(op, v, destinations=v)"
    factory = "HierarchicalCopyAllReduce"


class _Nccl(_CrossDeviceOps):
    name = "nccl"
    description = "crossdevice.NcclAllReduce().reduce(...) (host values fall back)"
    factory = "NcclAllReduce"


#: `--ops` names -> implementations.
IMPLEMENTATIONS: Final[dict[str, type[_Impl]]] = {
    impl.name: impl for impl in (_Sharded, _ReduceToOne, _HierCopy, _Nccl, _SumN, _Naive)
}
