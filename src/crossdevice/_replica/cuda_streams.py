"""CUDA device and stream of each GPU replica, and the ordering of merge_calls against them.

A replica on `GPU:k` runs under `torch.cuda.device(p)` (p: the CUDA device behind `GPU:k`)
and a CUDA stream, as torch's `parallel_apply` and TF's replica threads do; without it,
anything a step creates without an explicit device lands on GPU 0. The stream is the
caller's current stream of that device; a logical GPU (`set_logical_gpu_devices`) has a
stream of its own, as each of TF's logical GPUs has.

CUDA work is asynchronous and ordered per stream only. Three hand-offs cross streams, and
each is ordered with CUDA events here (ProcessGroupNCCL's rule: the collective waits on
the caller's stream, the caller's stream waits on the collective):

* run start: a replica's own stream waits for the caller's stream (which made the inputs);
* merge_call: `merge_fn` runs on one replica's thread, whose current streams are not the
  other replicas'. Each replica records an event on its current stream when it arrives;
  the merging thread's streams wait for all of them before `merge_fn`, and each replica's
  stream waits for the merge's streams when it resumes. So a collective never reads an
  input before the replica's kernels wrote it, and a replica never reads a result before
  the collective wrote it, whatever streams the user's step switches to.
* run end: the caller's streams wait for the replicas' own streams.

Nothing here synchronises the host: events are recorded and waited on by the GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from crossdevice._core import nest
from crossdevice._core.devices import DeviceSpec, get_logical_gpu_devices, physical_gpu_index

__all__ = ["CudaReplicas", "CudaRun", "cuda_device", "cuda_replicas"]


def _local_gpu(device: str) -> int | None:
    spec = DeviceSpec.from_string(device)
    if spec.device_type == "GPU" and spec.job in (None, "localhost"):
        return physical_gpu_index(spec.device_index or 0)
    return None


def cuda_device(device: str) -> contextlib.AbstractContextManager[Any]:
    """`torch.cuda.device(p)` for a local GPU device (p: its CUDA device), else nothing.

    Tensors created inside with `device="cuda"` land on the GPU of `device`, as TF ops
    under `tf.device(device)` do.
    """
    index = _local_gpu(device)
    if index is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(index)


def cuda_replicas(replica_devices: Sequence[str]) -> CudaReplicas | None:
    """The CUDA plan for these replica devices, or None when none of them is a GPU."""
    indices = [_local_gpu(device) for device in replica_devices]
    if all(i is None for i in indices):
        return None
    return CudaReplicas(indices, own_streams=get_logical_gpu_devices() is not None)


class CudaReplicas:
    """Per runner: the CUDA device of each replica (None for host replicas).

    Args:
        indices: the physical CUDA device of each replica, None for a host replica.
        own_streams: give each GPU replica a stream of its own (logical GPUs: several
            replicas share one card and must not share its stream).
    """

    def __init__(self, indices: Sequence[int | None], own_streams: bool) -> None:
        self.indices = tuple(indices)
        self._own_streams = own_streams
        self._streams: list[Any] | None = None

    def start(self) -> CudaRun:
        """Called by the caller of `run`, on its thread: the plan of one run."""
        import torch

        caller = {i: torch.cuda.current_stream(i) for i in set(self.indices) if i is not None}
        if self._own_streams and self._streams is None:
            self._streams = [
                torch.cuda.Stream(i) if i is not None else None  # type: ignore[no-untyped-call]
                for i in self.indices
            ]
        streams = self._streams or [caller[i] if i is not None else None for i in self.indices]
        started: dict[int, Any] = {}
        if self._own_streams:
            for index, stream in caller.items():
                started[index] = stream.record_event()
        return CudaRun(torch, self.indices, streams, caller, started, self._own_streams)


class CudaRun:
    """One run's CUDA state: see the module docstring for what is ordered."""

    def __init__(
        self,
        torch: Any,
        indices: tuple[int | None, ...],
        streams: Sequence[Any],
        caller: dict[int, Any],
        started: dict[int, Any],
        own_streams: bool = False,
    ) -> None:
        self._torch = torch
        self._own_streams = own_streams
        self._indices = indices
        self._streams = streams
        self._caller = caller
        self._started = started
        self._ended: list[Any] = [None] * len(indices)
        self._arrived: list[Any] = [None] * len(indices)
        self._merged: dict[int, Any] = {}
        self._devices = sorted({i for i in indices if i is not None})

    @contextlib.contextmanager
    def replica(self, replica_id: int) -> Iterator[None]:
        """Around replica `replica_id`'s function, on its thread: its device and stream."""
        index = self._indices[replica_id]
        if index is None:
            yield
            return
        torch = self._torch
        stream = self._streams[replica_id]
        with torch.cuda.device(index), torch.cuda.stream(stream):
            started = self._started.get(index)
            if started is not None:
                stream.wait_event(started)
            try:
                yield
            finally:
                if stream is not self._caller[index]:
                    self._ended[replica_id] = stream.record_event()

    def finish(self) -> None:
        """After the run, on the caller's thread: its streams wait for the replicas' own."""
        for replica_id, event in enumerate(self._ended):
            if event is not None:
                index = self._indices[replica_id]
                assert index is not None
                self._caller[index].wait_event(event)
                self._ended[replica_id] = None

    def arrive(self, replica_id: int) -> None:
        """Replica `replica_id` enters a merge_call: mark where its stream has got to."""
        index = self._indices[replica_id]
        if index is not None:
            self._arrived[replica_id] = self._torch.cuda.current_stream(index).record_event()

    def resume(self, replica_id: int, result: Any) -> None:
        """Replica `replica_id` leaves a merge_call: its stream waits for the merge.

        With streams of their own (logical GPUs), the result's tensors were allocated on
        the merging replica's stream; they are recorded on this replica's too, so the
        caching allocator does not hand their memory out again while this stream may
        still use it (torch's `record_stream` rule).
        """
        index = self._indices[replica_id]
        if index is None:
            return
        stream = self._torch.cuda.current_stream(index)
        merged = self._merged.get(index)
        if merged is not None:
            stream.wait_event(merged)
        if self._own_streams:
            tensor = self._torch.Tensor
            for leaf in _tensors_in(result):
                if isinstance(leaf, tensor) and leaf.is_cuda and leaf.get_device() == index:
                    leaf.record_stream(stream)

    def merging(self, merge: Callable[[list[Any]], list[Any]]) -> Callable[[list[Any]], list[Any]]:
        """`merge` ordered after every replica's arrival, with its end marked per device."""
        torch = self._torch

        def ordered(inputs: list[Any]) -> list[Any]:
            for replica_id, event in enumerate(self._arrived):
                index = self._indices[replica_id]
                if event is not None and index is not None:
                    torch.cuda.current_stream(index).wait_event(event)
            try:
                return merge(inputs)
            finally:
                self._merged = {
                    i: torch.cuda.current_stream(i).record_event() for i in self._devices
                }

        return ordered


def _tensors_in(result: Any) -> list[Any]:
    """The leaves of a merge_call result, with the components of distributed values."""
    leaves, _ = nest.flatten(result)
    out: list[Any] = []
    for leaf in leaves:
        components = getattr(leaf, "values", None)
        if isinstance(components, tuple):  # a DistributedValues
            out.extend(components)
        else:
            out.append(leaf)
    return out
