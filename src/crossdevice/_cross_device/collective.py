"""`CollectiveAllReduce`: reductions across the workers of a multi-worker strategy.

Each reduction has three phases, as Gloo's and Horovod's hierarchical all-reduce do:

1. local reduce: the worker adds its own replicas' components in replica order;
2. cross-worker all-reduce: one numbered collective on the worker `Communicator` for the
   whole batch, packed by dtype into flat buffers of about `bytes_per_pack` bytes;
3. local broadcast: every local destination gets the result (one read-only buffer for
   host NumPy values).

MEAN divides by the global number of components (workers times local components), so a
value with one component per worker (a host value) divides by the worker count, as TF's
host-side collective group does.

The user's line that asked for a reduction is part of what the workers compare
(`call_site`): the strategy passes it down with the values (`reduce_values_async`).
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, final

import numpy as np

from crossdevice._arrays import NUMPY, backend_for, is_torch, packing
from crossdevice._arrays.buffer_pool import BufferPool
from crossdevice._arrays.handout import hand_out
from crossdevice._comm.devices import algorithms
from crossdevice._comm.protocol import Done, Pending, Then
from crossdevice._core import tuning
from crossdevice._core.options import CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._cross_device import inputs, results
from crossdevice._cross_device.base import CrossDeviceOps
from crossdevice._cross_device.call_site import call_site
from crossdevice._cross_device.destinations import get_devices_from
from crossdevice._cross_device.flat import FlatRoute, FlatRoutes, numpy_dtype, total_numel
from crossdevice._sync.call import CallSignature
from crossdevice._values.values import DistributedValues

if TYPE_CHECKING:
    from crossdevice._comm.workers.communicator import ProcessGroupCommunicator

__all__ = ["CollectiveAllReduce", "call_site"]


def _reduction(
    op: str, leaves: tuple[Any, ...], site: object, timeout: float | None, overlap: bool
) -> Any:
    """The cross-worker `ReduceOptions` of a reduction, remembered (steps repeat them).

    The wire sums; the workers compare the values as the strategy reduces them (op,
    shapes, dtypes: (2, 3) against (3, 2) is a mismatch) and the user's line.
    """
    try:
        return _cached_reduction(op, leaves, site, timeout, overlap)
    except TypeError:  # an unhashable site: made afresh
        return _cached_reduction.__wrapped__(op, leaves, site, timeout, overlap)


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: Any) -> str:
    """`str(dtype)` (`float32`), remembered: NumPy builds the string on every call."""
    return str(dtype)


@functools.lru_cache(maxsize=512)
def _cached_reduction(
    op: str, leaves: tuple[Any, ...], site: object, timeout: float | None, overlap: bool
) -> Any:
    from crossdevice._comm.protocol import ReduceOptions

    signature = CallSignature("all_reduce", op, None, leaves, site=site)
    return ReduceOptions(ReduceOp.SUM, timeout, signature=signature, overlap=overlap)


#: The first of a list of results (a C function: no Python frame).
_FIRST: Final = operator.itemgetter(0)


@final
class CollectiveAllReduce(CrossDeviceOps):
    """All-reduce across workers through a `ProcessGroupCommunicator` (None: one worker).

    Args:
        communicator: the cross-worker communicator, or None for a single worker.
        options: default `CommunicationOptions` (pack size, timeout).
    """

    def __init__(
        self,
        communicator: ProcessGroupCommunicator | None,
        options: CommunicationOptions | None = None,
    ) -> None:
        self._communicator = communicator
        self._options = CommunicationOptions().merge(options)
        self._pool = BufferPool()
        self._last_merge: tuple[Any, CommunicationOptions] | None = None
        self._flat_routes = FlatRoutes(self._flat_route)

    @property
    def _num_between_graph_workers(self) -> int:
        return 1 if self._communicator is None else int(self._communicator.world_size)

    def _local_sum(self, arrays: Sequence[Any]) -> Any:
        # Phase 1, local reduce: in replica order, so results are reproducible. Large host
        # sums go into recycled buffers (they are then reduced in place across workers).
        first = arrays[0]
        if isinstance(first, np.ndarray) and first.nbytes >= tuning.TUNING.donate_min_bytes:
            out = self._pool.take(first.dtype, first.size).reshape(first.shape)
            return NUMPY.sum_n(arrays, out=out)
        return algorithms.sum_n(arrays)

    def _cross_worker(
        self,
        components: list[list[Any]],
        options: CommunicationOptions,
        op: ReduceOp,
        site: object,
        overlap: bool,
    ) -> Pending:
        # Phase 2, cross-worker all-reduce: one numbered collective, issued now; `wait`
        # gives the totals. Every worker splits the same way (same shapes everywhere),
        # so the collectives match.
        comm = self._communicator
        if comm is None or not components:
            return Done([self._local_sum(arrays) for arrays in components])
        firsts = [arrays[0] for arrays in components]
        leaves = tuple((tuple(x.shape), _dtype_name(x.dtype)) for x in firsts)
        reduce = _reduction(op.name, leaves, site, options.timeout_seconds, overlap)
        if all(type(a) is np.ndarray for arrays in components for a in arrays):
            return self._packed(components, options, reduce)
        sums = [self._local_sum(arrays) for arrays in components]
        large = [
            i
            for i, x in enumerate(sums)
            if backend_for(x).nbytes(x) >= tuning.TUNING.donate_min_bytes
        ]
        small = sorted(set(range(len(sums))) - set(large))
        pendings: list[Pending] = []
        if large:
            # Local sums of ours, reduced where they lie (donated).
            pendings.append(comm.all_reduce_async([sums[i] for i in large], reduce, donate=True))
        if small:  # (issuing it completes the one above: one collective is in flight)
            pendings.append(
                comm.batch_all_reduce_async(
                    [sums[i] for i in small], reduce, bytes_per_pack=options.bytes_per_pack
                )
            )

        def totals(*reduced: list[Any]) -> list[Any]:
            out: list[Any] = [None] * len(sums)
            for indices, values in zip([i for i in (large, small) if i], reduced, strict=True):
                for i, x in zip(indices, values, strict=True):
                    out[i] = x
            return out

        return Then(pendings, totals)

    def _packed(
        self, components: list[list[np.ndarray]], options: CommunicationOptions, reduce: Any
    ) -> Pending:
        # Host NumPy values. A large value with one local component (one replica per
        # worker) is sent as it is: no local sum to make, and the transport never writes
        # it (the ring reads it in place; Gloo's in-place all-reduce copies it). The rest
        # are local sums written straight into their slices of recycled packs (one per
        # dtype, about bytes_per_pack each) with room for the inline fingerprint, as the
        # communicator sends them: the pack costs no copy beyond the local sum itself.
        comm = self._communicator
        assert comm is not None
        donate_min = tuning.TUNING.donate_min_bytes
        if len(components) == 1 and len(components[0]) == 1:
            one = components[0][0]
            if one.nbytes >= donate_min and one.flags.c_contiguous and one.flags.writeable:
                # One large value of one replica (the per-step case): sent as it is.
                pending = comm.all_reduce_async([one.reshape(-1)], reduce)
                return Then([pending], lambda reduced: [reduced[0].reshape(one.shape)])

        def alone(i: int) -> bool:
            first = components[i][0]
            return (
                len(components[i]) == 1
                and first.nbytes >= donate_min
                and first.flags.c_contiguous
                and first.flags.writeable
            )

        firsts = [arrays[0] for arrays in components]
        packs = packing.plan(
            [x.dtype for x in firsts],
            [x.shape for x in firsts],
            [x.itemsize for x in firsts],
            options.bytes_per_pack,
            alone,
        )
        donated = [not alone(p.members[0]) for p in packs]
        buffers = [
            comm.pack_buffer(firsts[p.members[0]].dtype, p.size)
            if mine
            else firsts[p.members[0]].reshape(-1)
            for p, mine in zip(packs, donated, strict=True)
        ]

        def parts(i: int) -> list[np.ndarray]:
            return [c.reshape(-1) for c in components[i]]

        def fill(k: int, start: int, stop: int, out: np.ndarray | None = None) -> bool:
            # Elements start:stop of pack k: the local sums of the values they cover,
            # written as the communicator sends them (large packs leave in chunks), into
            # the pack or into `out` (a shared-memory slot). A value alone is there.
            if not donated[k]:
                return False
            dest = buffers[k][start:stop] if out is None else out
            packs[k].fill(parts, start, stop, dest, NUMPY.sum_n)
            return True

        def unpack(reduced: list[np.ndarray]) -> list[Any]:
            out: list[Any] = [None] * len(components)
            for pack, flat in zip(packs, reduced, strict=True):
                for i, value in zip(pack.members, pack.unpack(flat), strict=True):
                    out[i] = value
            return out

        pending = comm.all_reduce_async(
            buffers, reduce, donate=donated, fill=fill if any(donated) else None
        )
        return Then([pending], unpack)

    def reduce_values_async(
        self,
        reduce_op: ReduceOp,
        values: Sequence[DistributedValues],
        destinations: Sequence[Any],
        options: CommunicationOptions,
        site: object,
        overlap: bool = False,
    ) -> Pending:
        """Reduce `values` across every replica of every worker, in one collective.

        `site` is what the workers compare besides the values: the user's line that
        asked (`call_site`), with the value's nest structure for a replica all-reduce.
        The local sums are made and the collective is issued before this returns;
        `wait()` gives the results. The values' components must not change before
        `wait` (some leave only then). `overlap`: the caller computes before it waits
        (`ReduceOptions.overlap`).
        """
        components = [inputs.component_arrays(value) for value in values]
        merged = self._merged(options)
        pending = self._cross_worker(components, merged, reduce_op, site, overlap)
        workers = self._num_between_graph_workers

        def deliver(totals: list[Any]) -> list[Any]:
            out = []
            for value, destination, total in zip(values, destinations, totals, strict=True):
                result = total
                if reduce_op == ReduceOp.MEAN:
                    result = backend_for(total).divide(total, workers * len(value.values))
                out.append(self._deliver(result, value, destination))
            return out

        return Then([pending], deliver)

    def reduce_one_async(
        self,
        reduce_op: ReduceOp,
        value: np.ndarray,
        options: CommunicationOptions,
        site: object,
        overlap: bool = False,
    ) -> Pending:
        """`reduce_values_async` of one host array that is this worker's only component.

        The per-step case of one replica per worker (a loss, a flat gradient buffer): the
        same collective, fingerprint and result as `reduce_values_async` (its three phases
        with one component: no local sum, one destination), without the distributed
        values around it.
        """
        merged = self._merged(options)
        comm = self._communicator
        if comm is None:
            pending: Pending = Done([self._local_sum([value])])
        else:
            # One component: nothing to sum or pack locally. The communicator sends it
            # as it is (a transport that reduces in place copies it first, as a pack
            # would have been filled) and gives it back in its own shape.
            leaves = ((value.shape, _dtype_name(value.dtype)),)
            reduce = _reduction(reduce_op.name, leaves, site, merged.timeout_seconds, overlap)
            pending = comm.all_reduce_async([value], reduce)
        mean = reduce_op == ReduceOp.MEAN
        workers = self._num_between_graph_workers

        def deliver(totals: list[Any]) -> np.ndarray:
            total = totals[0]
            if mean:
                total = NUMPY.divide(total, workers)
            return hand_out(results.owned(total, [value]), copy=False)

        return Then([pending], deliver)

    def _merged(self, options: CommunicationOptions | None) -> CommunicationOptions:
        """`self._options.merge(options)`, remembered for the last `options`.

        Steps repeat their options, and options are immutable: the merge can be shared.
        """
        last = self._last_merge
        if last is not None and last[0] is options:
            return last[1]
        merged = self._options.merge(options)
        self._last_merge = (options, merged)
        return merged

    def reduce_flat_async(
        self,
        reduce_op: ReduceOp,
        parts: Sequence[Any],
        options: CommunicationOptions | None,
        site: object,
        leaves: tuple[Any, ...],
        wire_dtype: Any = None,
    ) -> Pending:
        """All-reduce `parts` end to end as one flat buffer, this worker's only component.

        The gradient bucket of one replica per worker (`crossdevice.torch`): `parts`
        (1-D tensors of one dtype and device) are copied once into one flat buffer,
        which is reduced where it lies (no local sum, no copy out): the result is that
        buffer. On the host it is one of the communicator's recycled buffers with room
        for the inline fingerprint (`pack_buffer`), recycled only once nothing refers
        to it (a gradient kept from an earlier step keeps its buffer). Each element is
        summed as in
        `reduce_values_async` of the values the buffer holds (element-wise sums do not
        depend on how values are laid out in buffers), so results are bitwise equal.
        `leaves` describes those values ((shape, dtype) each), compared across workers
        with `site` as `reduce_values_async` compares its values. Issued now, left in
        flight (`ReduceOptions.overlap`): `wait()` gives the reduced buffer. From
        `TUNING.queue_min_bytes` (every size by default) a bucket that travels through
        Gloo is packed and issued on the communicator's queue thread instead
        (`ProcessGroupCommunicator.submit`), after the buckets before it; one that
        travels through shared memory is issued here (see the tuning's reason).

        `wire_dtype` (a torch dtype narrower than `flat`'s, e.g. `torch.bfloat16`, or a
        half-precision `flat`'s own): each
        worker sends its buffer rounded to it and every worker adds the gathered
        buffers in rank order in float32 (or `flat`'s dtype if wider), then rounds back
        to `flat`'s dtype: half the bytes on the wire, one rounding per worker's value
        and none per addition (DDP's bf16 hook adds in bf16). That path gathers
        synchronously: it completes before this returns.
        """
        comm = self._communicator
        assert comm is not None  # the strategy offers this path only across workers
        if type(parts) is not list and type(parts) is not tuple:
            parts = list(parts)
        first = parts[0]
        route = self._flat_routes.route(reduce_op, options, site, leaves, wire_dtype, first)
        numel = total_numel(parts)
        shared = comm.shared_memory
        if (
            route.reduce is not None
            and numel * first.element_size() >= tuning.TUNING.queue_min_bytes
            and (shared is None or not shared.carries(((first.dtype, numel),)))
        ):
            # Packed, sent and waited for on the queue's thread (`callqueue.py`).
            queued = comm.submit(functools.partial(self._issue_flat, route, parts, numel))
            return Then([queued], route.deliver)
        if route.reduce is None:
            flat = self._pack_flat(route, parts, numel)
            summed = self._compressed_sum(flat, wire_dtype, route.merged, route.signature)
            return Then([Done([summed])], route.deliver)
        return Then([self._issue_flat(route, parts, numel)], route.deliver)

    def reduce_flats_async(
        self,
        reduce_op: ReduceOp,
        like: Any,
        numels: Sequence[int],
        fill: Callable[[int, int, int, Any], None],
        options: CommunicationOptions | None,
        site: object,
        leaves: tuple[Any, ...],
        why: str,
        missing: Callable[[int], bool],
    ) -> Pending | None:
        """Several flat buffers all-reduced as one collective, each filled as it leaves.

        A backward pass's gradient buckets (`crossdevice.torch`'s `PassReduce`): buffer
        j has `numels[j]` elements of `like`'s dtype (a host tensor) and is written by
        `fill(j, start, stop, dest)` (elements `start:stop` into NumPy array `dest`) just
        before that range leaves, on the communicator's queue thread, after the calls
        queued before it; so `fill` may wait for the buffer's data, which the calling
        thread produces: while `missing(j)` says buffer j's data is still to come, a
        collective from the calling thread raises RuntimeError(`why`) (it would wait for
        this one, which waits for it). One
        numbered all-reduce, its buffers reduced where they lie: `wait()` gives them, in
        order, each summed as `reduce_flat_async` sums its one buffer (bitwise alike).
        `leaves` describes every buffer's values, compared across workers with `site`.

        Returns None (nothing issued) where this path does not apply: a buffer that
        travels through shared memory or is issued from the hook
        (`TUNING.queue_min_bytes`), more than `TUNING.pass_max_bytes` in all, or a dtype
        NumPy lacks.
        """
        import torch

        comm = self._communicator
        assert comm is not None  # the strategy offers this path only across workers
        route = self._flat_routes.route(reduce_op, options, site, leaves, None, like)
        cut, shared = tuning.TUNING, comm.shared_memory
        nbytes = [n * like.element_size() for n in numels]
        if (
            route.room_dtype is None
            or route.reduce is None
            or min(nbytes) < cut.queue_min_bytes
            or sum(nbytes) > cut.pass_max_bytes
            or (shared is not None and shared.carries(tuple((like.dtype, n) for n in numels)))
        ):
            return None
        dtype = route.room_dtype
        producer = threading.current_thread()

        def issue() -> Pending:
            rooms = [comm.pack_buffer(dtype, n) for n in numels]

            def write(j: int, start: int, stop: int, out: Any = None) -> bool:
                with comm.awaiting(producer, why, functools.partial(missing, j)):
                    fill(j, start, stop, rooms[j][start:stop] if out is None else out)
                return True

            flats = [torch.from_numpy(room) for room in rooms]
            return comm.all_reduce_async(flats, route.reduce, donate=True, fill=write)

        queued = comm.submit(issue)
        if reduce_op != ReduceOp.MEAN:
            return queued
        workers = self._num_between_graph_workers
        return Then([queued], lambda totals: [backend_for(t).divide(t, workers) for t in totals])

    def _pack_flat(self, route: FlatRoute, parts: list[Any] | tuple[Any, ...], numel: int) -> Any:
        """`parts` end to end in one flat buffer (a recycled host room where NumPy can)."""
        import torch

        if route.room_dtype is None:
            return torch.cat(parts)
        assert self._communicator is not None
        room = self._communicator.pack_buffer(route.room_dtype, numel)
        return torch.cat(parts, out=torch.from_numpy(room))

    def _issue_flat(
        self, route: FlatRoute, parts: list[Any] | tuple[Any, ...], numel: int
    ) -> Pending:
        """Pack `parts` and issue their all-reduce, left in flight where it lies."""
        assert self._communicator is not None
        flat = self._pack_flat(route, parts, numel)
        return self._communicator.all_reduce_async([flat], route.reduce, donate=True)

    def _flat_route(
        self,
        reduce_op: ReduceOp,
        options: CommunicationOptions | None,
        site: object,
        leaves: tuple[Any, ...],
        wire_dtype: Any,
        first: Any,
    ) -> FlatRoute:
        """What `reduce_flat_async` decides for a call like this one (`flat.py`)."""
        merged = self._merged(options)
        signature = None
        reduce = None
        if wire_dtype is not None and (wire_dtype != first.dtype or first.element_size() < 4):
            # Narrower on the wire, or half-precision gradients sent as they are: either
            # way added in float32 (Gloo would add them in their own precision).
            # The workers compare what the rows stand for (op, leaves, call site) as an
            # all-reduce would: a gather alone would add any rows of the same length.
            signature = CallSignature("all_reduce", reduce_op.name, None, leaves, site=site)
        else:
            reduce = _reduction(reduce_op.name, leaves, site, merged.timeout_seconds, True)
        workers = self._num_between_graph_workers

        def mean(totals: list[Any]) -> Any:
            total = totals[0]
            return backend_for(total).divide(total, workers)

        deliver = mean if reduce_op == ReduceOp.MEAN else _FIRST  # no Python frame for SUM
        return FlatRoute(leaves, options, merged, reduce, signature, numpy_dtype(first), deliver)

    def _compressed_sum(
        self,
        flat: Any,
        wire_dtype: Any,
        options: CommunicationOptions,
        signature: CallSignature,
    ) -> Any:
        """Every worker's `flat` sent as `wire_dtype`, added in rank order in float32."""
        import torch

        from crossdevice._comm.protocol import GatherOptions

        comm = self._communicator
        assert comm is not None
        sent = flat.to(wire_dtype).reshape(1, -1)
        rows = comm.all_gather(sent, GatherOptions(0, options.timeout_seconds, signature))
        total = rows[0].to(torch.promote_types(flat.dtype, torch.float32))
        for row in rows[1:]:
            total.add_(row)  # rounded up to total's dtype, added exactly once each
        return total.to(flat.dtype)

    def reduce_implementation(
        self,
        reduce_op: ReduceOp,
        per_replica_value: DistributedValues,
        destinations: Any,
        options: CommunicationOptions,
    ) -> Any:
        """Reduce one value across all replicas of all workers."""
        return self.reduce_values_async(
            reduce_op, [per_replica_value], [destinations], options, call_site()
        ).wait()[0]

    def batch_reduce_implementation(
        self,
        reduce_op: ReduceOp,
        value_destination_pairs: list[tuple[DistributedValues, Any]],
        options: CommunicationOptions,
    ) -> list[Any]:
        """Reduce every pair in one cross-worker collective."""
        values = [v for v, _ in value_destination_pairs]
        destinations = [d for _, d in value_destination_pairs]
        return self.reduce_values_async(
            reduce_op, values, destinations, options, call_site()
        ).wait()

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
            from crossdevice._comm.protocol import GatherOptions

            timeout = self._options.merge(options).timeout_seconds
            local = self._communicator.all_gather(local, GatherOptions(axis, timeout))
        return self._deliver(local, per_replica_value, destinations)

    @staticmethod
    def _deliver(total: Any, value: DistributedValues, destinations: Any) -> Any:
        # Phase 3, local broadcast.
        devices = get_devices_from(destinations)
        like_numpy = not is_torch(inputs.as_array(value.values[0]))
        owned = results.owned(total, [inputs.as_array(c) for c in value.values])
        return results.mirror([owned], [devices[0]], devices, like_numpy=like_numpy)
