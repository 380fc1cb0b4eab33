"""One host all-reduce, from every replica's inputs to the results they share.

`arrive` turns one replica's values into a `CollectiveArrival` (host NumPy views, their
signature, the small ones packed per dtype); `Reduction.start` plans the sum of every
replica's arrival (`host_reduce.make_plan`, on the one packer) and either computes it
at once (small rounds, or values NumPy cannot add here) or leaves `work`: pieces any
number of threads take in turn, after which `finish` builds the shared results. The
same code serves the replica threads of a `ThreadCommunicator` (each replica takes
pieces in a round of the rendezvous) and `all_reduce_host` (the caller's thread and the
host kernels' pool take them): no waiting and no rendezvous here.

Adds run in replica order, so results are bitwise reproducible and equal to the naive
in-order chain whatever the thread timing.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from crossdevice._arrays import backend_for
from crossdevice._arrays.host_kernels import available_cpus, plain_sum
from crossdevice._arrays.numpy_backend import NUMPY
from crossdevice._comm.local.arrivals import (
    NUMERIC_KINDS,
    ONE_NUMPY,
    CollectiveArrival,
    host_view,
    no_torch,
)
from crossdevice._comm.local.host_reduce import Plan, make_plan, reduce_pieces
from crossdevice._core import tuning
from crossdevice._core.reduce_op import ReduceOp

__all__ = ["Packs", "Reduction", "arrive", "plan_for"]

#: Output buffers: (dtype, elements) -> a flat buffer (recycled when large).
Output = Callable[[np.dtype, int], np.ndarray]


def plan_for(sig: tuple[Any, ...]) -> Plan:
    """The plan of one input signature, remembered: a training step repeats its shapes."""
    return _plan(sig, tuning.TUNING.pack_below_bytes)


@functools.lru_cache(maxsize=64)
def _plan(sig: tuple[Any, ...], pack_below_bytes: int) -> Plan:
    del pack_below_bytes  # part of the key: a plan follows the threshold in force
    return make_plan(sig)


class Packs:
    """One replica's reusable buffers for the packs of its small arrays (`Plan.packs`).

    The buffer of round k+1 may reuse round k's: every replica has finished reading
    round k's inputs before any replica leaves round k.
    """

    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        self._buffers: dict[tuple[np.dtype, int], np.ndarray] = {}

    def pack(self, plan: Plan, hosts: list[np.ndarray]) -> list[np.ndarray | None]:
        """Copy the plan's small arrays of `hosts` into this replica's buffers."""
        buffers = self._buffers
        packs: list[np.ndarray | None] = []
        for dtype, pack in zip(plan.dtypes, plan.packs, strict=True):
            if pack is None:
                packs.append(None)
                continue
            key = (dtype, pack.size)
            buf = buffers.get(key)
            if buf is None:
                if len(buffers) >= 8:
                    buffers.clear()
                buf = buffers[key] = np.empty(pack.size, dtype=dtype)
            pack.fill_all(hosts, buf)
            packs.append(buf)
        return packs


def arrive(values: list[Any], op: ReduceOp, packs: Packs, handler: Any) -> CollectiveArrival:
    """One replica's all-reduce arrival: host views, signature, plan and packed small arrays."""
    if all(
        type(v) is np.ndarray and v.flags.c_contiguous and v.dtype.kind in NUMERIC_KINDS
        for v in values
    ):
        # Fast path (contiguous NumPy arrays, the common case): no per-array dispatch.
        sig_fast = tuple([(v.shape, v.dtype) for v in values])
        arrival = CollectiveArrival(
            "all_reduce", values, values, sig_fast, no_torch(len(values)), op, handler=handler
        )
    else:
        hosts: list[np.ndarray] | None = []
        torch_mask: list[bool] = []
        sig: list[Any] = []
        for i, raw in enumerate(values):
            value, arr, from_torch = host_view(raw)
            values[i] = value
            torch_mask.append(from_torch)
            if arr is None:
                hosts = None
                be = backend_for(value)
                sig.append((be.shape(value), be.dtype_name(value)))
            else:
                if hosts is not None:
                    hosts.append(arr)
                sig.append((arr.shape, arr.dtype))
        arrival = CollectiveArrival(
            "all_reduce", values, hosts, tuple(sig), tuple(torch_mask), op, handler=handler
        )
    if arrival.arrays is not None:
        plan = plan_for(arrival.sig)
        arrival.plan = plan
        if any(plan.packs):
            arrival.packs = packs.pack(plan, arrival.arrays)
    return arrival


class Reduction:
    """The sum of every replica's arrival: its plan, outputs, pieces of work and results.

    Args:
        arrivals: every replica's arrival, validated to agree, in replica order.
        output: makes the flat output buffers.
    """

    __slots__ = ("arrivals", "n", "op", "outputs", "plan", "results", "work")

    def __init__(self, arrivals: list[CollectiveArrival], output: Output) -> None:
        self.arrivals = arrivals
        self.n = len(arrivals)
        self.op = arrivals[0].op
        self.plan: Plan | None = None
        self.outputs: list[np.ndarray] = []
        #: per torch mask (which values are tensors): the results of that pattern.
        self.results: dict[tuple[bool, ...], list[Any]] = {}
        #: shared work, when the round is large: `work(replica_id)` takes pieces in turn.
        self.work: Callable[[int], None] | None = None
        self._start(output)

    def _start(self, output: Output) -> None:
        arrivals = self.arrivals
        tensors = False
        for a in arrivals:
            if a.arrays is None:
                self._fallback()
                return
            tensors = tensors or a.torch_mask[0]
        plan = arrivals[0].plan
        assert plan is not None
        if (
            len(plan.where) == 1
            and plan.total_bytes < tuning.TUNING.pack_below_bytes
            and not tensors
        ):
            self._one_small(plan)
            return
        self.plan = plan
        self.outputs = [
            output(dt, layout.size) for dt, layout in zip(plan.dtypes, plan.layouts, strict=True)
        ]
        if plan.total_bytes < tuning.TUNING.shared_work_min_bytes or self.n == 1:
            self._reduce([(i, 0, s.length) for i, s in enumerate(plan.segments)])
            self.finish()
            return
        cut = tuning.TUNING
        piece_bytes = min(
            cut.piece_max_bytes, max(cut.piece_min_bytes, plan.total_bytes // (4 * self.n))
        )
        pieces = plan.pieces(piece_bytes)
        # Work sharing: each taker takes the next piece until none is left, so the
        # threads that are awake (the last arriver at once, the others as they wake)
        # share the work, and one slowed by another process takes fewer pieces.
        # next() on an itertools.count is atomic under the GIL.
        taken = itertools.count()
        # At most one worker per CPU: more compute-bound threads than cores only evict
        # each other's accumulator blocks from L2 at every context switch.
        tickets = itertools.count()
        workers = available_cpus()

        def work(replica_id: int) -> None:
            del replica_id
            if next(tickets) >= workers:
                return
            for i in taken:
                if i >= len(pieces):
                    return
                self._reduce(pieces[i : i + 1], blocked=True)

        self.work = work

    def _one_small(self, plan: Plan) -> None:
        """One small NumPy array per replica (a step's loss or metric): the plain chain.

        `plain_sum`: the same adds in the same order as `sum_slice` (bitwise equal),
        without the flat-buffer bookkeeping that pays off only for many or large arrays.
        """
        dtype = plan.dtypes[0]
        inputs = [a.arrays[0] for a in self.arrivals]  # type: ignore[index]
        out = plain_sum(inputs, np.empty(plan.layouts[0].shapes[0], dtype=dtype))
        mean = self.op is ReduceOp.MEAN
        if mean and dtype.kind not in "fc":
            # An integer mean is a float (NumPy's true_divide), a 0-d array for 0-d.
            self.results[ONE_NUMPY] = [NUMPY.freeze(NUMPY.divide(out, self.n))]
            return
        if mean:
            np.true_divide(out, self.n, out=out)
        out.flags.writeable = False  # one buffer, shared by every replica
        self.results[ONE_NUMPY] = [out]

    def _reduce(self, pieces: Sequence[tuple[int, int, int]], blocked: bool = False) -> None:
        reduce_pieces(
            self.plan,  # type: ignore[arg-type]
            self.outputs,
            [a.arrays for a in self.arrivals],  # type: ignore[misc]
            [a.packs for a in self.arrivals],
            self.op is ReduceOp.MEAN,
            pieces,
            blocked,
        )

    def finish(self) -> None:
        """After the work: build the shared results (views of the outputs), once per pattern."""
        # The work closure holds this object: drop it, so that the outputs die with the
        # last result's reference (the buffer pool counts references exactly).
        self.work = None
        plan = self.plan
        if plan is None:
            return
        mean = self.op is ReduceOp.MEAN
        readonly: list[list[np.ndarray] | None] = [None] * len(self.outputs)
        tensors: list[list[Any] | None] = [None] * len(self.outputs)
        for a in self.arrivals:
            key = a.torch_mask
            if key in self.results:
                continue
            values: list[Any] = []
            for i, (g, k) in enumerate(plan.where):
                if key[i]:
                    views = tensors[g]
                    if views is None:
                        import torch

                        views = tensors[g] = plan.layouts[g].unpack(
                            torch.from_numpy(self.outputs[g])
                        )
                    value = views[k]
                    if mean and plan.dtypes[g].kind in "iu":
                        value = torch.true_divide(value, self.n)
                else:
                    views = readonly[g]
                    if views is None:
                        flat = self.outputs[g].view()
                        flat.flags.writeable = False
                        views = readonly[g] = plan.layouts[g].unpack(flat)
                    value = views[k]
                    if mean and plan.dtypes[g].kind in "iu":
                        value = NUMPY.freeze(NUMPY.divide(value, self.n))
                values.append(value)
            self.results[key] = values

    def result(self, torch_mask: tuple[bool, ...]) -> list[Any]:
        """The results for a replica whose values are tensors where `torch_mask` says."""
        return list(self.results[torch_mask])

    def _fallback(self) -> None:
        """Values NumPy cannot add here (CUDA, bfloat16, bool...): their library, in order."""
        results: list[Any] = []
        for i in range(len(self.arrivals[0].values)):
            column = [a.values[i] for a in self.arrivals]
            be = backend_for(column[0])
            total = be.sum_n(column)
            if self.op is ReduceOp.MEAN:
                total = be.divide(total, self.n)
            results.append(be.freeze(total))
        for a in self.arrivals:
            self.results.setdefault(a.torch_mask, results)
