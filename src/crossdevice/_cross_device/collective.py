"""`CollectiveAllReduce`: reductions across the workers of a multi-worker strategy.

Each reduction has three phases, as Gloo's and Horovod's hierarchical all-reduce do:

1. local reduce: the worker adds its own replicas' components in replica order;
2. cross-worker all-reduce: one numbered collective on `torch.distributed` for the whole
   batch, packed by dtype into flat buffers of about `bytes_per_pack` bytes;
3. local broadcast: every local destination gets the result (one read-only buffer for
   host NumPy values).

MEAN divides by the global number of components (workers times local components), so a
value with one component per worker (a host value) divides by the worker count, as TF's
host-side collective group does.
"""

from __future__ import annotations

import os
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any, Final, final

import numpy as np

from crossdevice._arrays import NUMPY, backend_for, is_torch
from crossdevice._arrays.buffer_pool import BufferPool
from crossdevice._comm.devices import algorithms
from crossdevice._core import tuning
from crossdevice._core.options import CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._cross_device import inputs, results
from crossdevice._cross_device.base import CrossDeviceOps
from crossdevice._cross_device.destinations import get_devices_from
from crossdevice._values.values import DistributedValues

__all__ = ["CollectiveAllReduce", "call_site"]

_PACKAGE_DIR: Final = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THREADING_FILE: Final = threading.__file__
_RUNNER_FILE: Final = os.path.join(_PACKAGE_DIR, "_replica", "runner.py")


def call_site() -> tuple[str, str, int] | None:
    """The user's line that asked for this reduction: file name, function, line.

    Every worker runs the same program, so the same reduction comes from the same line
    everywhere; two reductions of equal shapes issued in a different order on two
    workers differ here (the fault campaign's swapped all-reduces). Only the file's base
    name counts: workers may install the program in different directories.

    The walk stops at the replica runner: below it lies whatever thread happens to run
    a merge (the caller's or a replica's), which differs from worker to worker. A
    reduction with no user frame above the runner (an internal merge) has no site.
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name == _RUNNER_FILE:
            return None
        if not name.startswith(_PACKAGE_DIR) and name != _THREADING_FILE:
            if name.startswith("<frozen"):
                return None
            return os.path.basename(name), frame.f_code.co_name, frame.f_lineno
        frame = frame.f_back
    return None


@final
class CollectiveAllReduce(CrossDeviceOps):
    """All-reduce across workers through a `ProcessGroupCommunicator` (None: one worker).

    Args:
        communicator: the cross-worker communicator, or None for a single worker.
        options: default `CommunicationOptions` (pack size, timeout).
    """

    def __init__(self, communicator: Any, options: CommunicationOptions | None = None) -> None:
        self._communicator = communicator
        self._options = CommunicationOptions().merge(options)
        self._pool = BufferPool()
        #: Set by the strategy from a replica thread just before a replica all-reduce.
        self.replica_call_site: object = False

    @property
    def _num_between_graph_workers(self) -> int:
        return 1 if self._communicator is None else int(self._communicator.world_size)

    def _local_sums(self, values: Sequence[DistributedValues]) -> list[Any]:
        # Phase 1, local reduce: in replica order, so results are reproducible. Large host
        # sums go into recycled buffers (they are then reduced in place across workers).
        return [self._local_sum(inputs.component_arrays(value)) for value in values]

    def _local_sum(self, arrays: Sequence[Any]) -> Any:
        first = arrays[0]
        if isinstance(first, np.ndarray) and first.nbytes >= tuning.TUNING.donate_min_bytes:
            out = self._pool.take(first.dtype, first.size).reshape(first.shape)
            return NUMPY.sum_n(arrays, out=out)
        return algorithms.sum_n(arrays)

    def _signature(self, op: ReduceOp, arrays: Sequence[Any], site: object) -> Any:
        # The fingerprint sees the values as the strategy reduces them (op, shapes,
        # dtypes), not only the packs' byte counts: (2, 3) against (3, 2) is a mismatch.
        from crossdevice._comm.workers.communicator import Signature
        from crossdevice._comm.workers.fingerprint import cached_digest

        shapes = tuple((tuple(backend_for(x).shape(x)), str(x.dtype)) for x in arrays)
        try:
            structure = cached_digest((site,))
        except TypeError:  # an unhashable site: digest it afresh
            from crossdevice._comm.workers.fingerprint import digest

            structure = digest((site,))
        return Signature(op.name.lower(), cached_digest(shapes), structure)

    def _cross_worker(
        self,
        values: Sequence[DistributedValues],
        options: CommunicationOptions,
        op: ReduceOp = ReduceOp.SUM,
        site: object = None,
    ) -> list[Any]:
        # Phase 2, cross-worker all-reduce. Large local sums are fresh arrays of ours: they
        # are reduced in place (donated), as they are, and computed while the fingerprints
        # travel. Small ones are packed by dtype into flat buffers of about
        # bytes_per_pack. Every worker splits the same way (same shapes everywhere), so
        # the collectives match.
        components = [inputs.component_arrays(value) for value in values]
        if self._communicator is None or not values:
            return [self._local_sum(arrays) for arrays in components]
        merged = self._options.merge(options)
        if all(type(a) is np.ndarray for arrays in components for a in arrays):
            return self._packed(components, merged, op, site)
        large = [
            i
            for i, arrays in enumerate(components)
            if backend_for(arrays[0]).nbytes(arrays[0]) >= tuning.TUNING.donate_min_bytes
        ]
        small = sorted(set(range(len(values))) - set(large))
        out: list[Any] = [None] * len(values)
        if large:
            templates = [components[i][0] for i in large]
            reduced = self._communicator.all_reduce(
                templates,
                ReduceOp.SUM,
                donate=True,
                options=merged,
                signature=self._signature(op, templates, site),
                produce=lambda: [self._local_sum(components[i]) for i in large],
            )
            for i, x in zip(large, reduced, strict=True):
                out[i] = x
        if small:
            chosen = [self._local_sum(components[i]) for i in small]
            reduced = self._communicator.batch_all_reduce(
                chosen, ReduceOp.SUM, options=merged, signature=self._signature(op, chosen, site)
            )
            for i, x in zip(small, reduced, strict=True):
                out[i] = x
        return out

    def _packed(
        self,
        components: list[list[np.ndarray]],
        options: CommunicationOptions,
        op: ReduceOp,
        site: object,
    ) -> list[Any]:
        # Host NumPy values: each local sum is written straight into its slice of a
        # recycled pack (one per dtype, about bytes_per_pack each) that has room for the
        # inline fingerprint, so the pack costs no copy beyond the local sum itself (with
        # one replica, the API's copy) and one Gloo op per pack carries data and check.
        from crossdevice._comm.workers.wire import group_by_size

        comm = self._communicator
        groups: dict[np.dtype, list[int]] = {}
        for i, arrays in enumerate(components):
            groups.setdefault(arrays[0].dtype, []).append(i)
        packs: list[list[int]] = []
        for members in groups.values():
            sizes = [components[i][0].nbytes for i in members]
            packs.extend(
                [members[j] for j in pack] for pack in group_by_size(sizes, options.bytes_per_pack)
            )
        buffers = [
            comm.pack_buffer(components[p[0]][0].dtype, _total(components, p)) for p in packs
        ]

        def fill(k: int, start: int, stop: int, out: np.ndarray | None = None) -> None:
            # Elements start:stop of pack k: the local sums of the values they cover,
            # written as the communicator sends them (large packs leave in chunks), into
            # the pack or into `out` (a shared-memory slot).
            dest = buffers[k][start:stop] if out is None else out
            offset = 0
            for i in packs[k]:
                size = components[i][0].size
                a, b = max(start, offset), min(stop, offset + size)
                if a < b:
                    flats = [c.reshape(-1)[a - offset : b - offset] for c in components[i]]
                    NUMPY.sum_n(flats, out=dest[a - start : b - start])
                offset += size

        firsts = [arrays[0] for arrays in components]
        reduced = comm.all_reduce(
            buffers,
            ReduceOp.SUM,
            donate=True,
            options=options,
            signature=self._signature(op, firsts, site),
            fill=fill,
        )
        out: list[Any] = [None] * len(components)
        for pack, flat in zip(packs, reduced, strict=True):
            offset = 0
            for i in pack:
                first = components[i][0]
                out[i] = flat[offset : offset + first.size].reshape(first.shape)
                offset += first.size
        return out

    def reduce_implementation(
        self,
        reduce_op: ReduceOp,
        per_replica_value: DistributedValues,
        destinations: Any,
        options: CommunicationOptions,
    ) -> Any:
        """Reduce one value across all replicas of all workers."""
        return self.batch_reduce_implementation(
            reduce_op, [(per_replica_value, destinations)], options
        )[0]

    def batch_reduce_implementation(
        self,
        reduce_op: ReduceOp,
        value_destination_pairs: list[tuple[DistributedValues, Any]],
        options: CommunicationOptions,
    ) -> list[Any]:
        """Reduce every pair in one cross-worker collective."""
        values = [v for v, _ in value_destination_pairs]
        # The replicas' own call site when they asked (ReplicaContext.all_reduce: its merge
        # may run on any thread, whose stack would differ), else the caller's.
        site = call_site() if self.replica_call_site is False else self.replica_call_site
        self.replica_call_site = False
        totals = self._cross_worker(values, options, reduce_op, site)
        workers = self._num_between_graph_workers
        out = []
        for (value, destinations), total in zip(value_destination_pairs, totals, strict=True):
            result = total
            if reduce_op == ReduceOp.MEAN:
                result = backend_for(total).divide(total, workers * len(value.values))
            out.append(self._deliver(result, value, destinations))
        return out

    def _gather_implementation(
        self,
        per_replica_value: DistributedValues,
        destinations: Any,
        axis: int,
        options: CommunicationOptions,
    ) -> Any:
        """Concatenate the local components, then every worker's, in replica order."""
        arrays = inputs.component_arrays(per_replica_value, gather_axis=axis)
        local = backend_for(arrays[0]).concat(arrays, axis)
        if self._communicator is not None:
            local = self._communicator.all_gather(local, axis, options=self._options.merge(options))
        return self._deliver(local, per_replica_value, destinations)

    @staticmethod
    def _deliver(total: Any, value: DistributedValues, destinations: Any) -> Any:
        # Phase 3, local broadcast.
        devices = get_devices_from(destinations)
        like_numpy = not is_torch(inputs.as_array(value.values[0]))
        owned = results.owned(total, [inputs.as_array(c) for c in value.values])
        return results.mirror([owned], [devices[0]], devices, like_numpy=like_numpy)


def _total(components: list[list[np.ndarray]], pack: list[int]) -> int:
    return sum(components[i][0].size for i in pack)
