"""Where a distributed dataset's local replicas sit: devices, worker, and the wrapping rule.

`Layout` checks the devices and the worker's place in the job, and turns one nest per
local replica into the nest of `PerReplica` values a step hands out (TF's input_lib
`_create_per_replica` with `_always_wrap`: plain with one local replica on a single
worker). `empty_like` makes the empty batch of a replica without data for a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from crossdevice._arrays import backend_for, is_array, is_torch
from crossdevice._core import nest
from crossdevice._core.devices import canonicalize
from crossdevice._values.values import PerReplica

__all__ = ["Layout", "empty_like"]


def _check_devices(devices: Sequence[str]) -> tuple[str, ...]:
    if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(
            "devices must be a non-empty sequence of device strings, one per local replica "
            f"(e.g. ('CPU:0', 'CPU:1')), got {devices!r}"
        )
    return tuple(canonicalize(d) for d in devices)


def _check_workers(num_workers: int, worker_index: int) -> None:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    if (
        isinstance(worker_index, bool)
        or not isinstance(worker_index, int)
        or not 0 <= worker_index < num_workers
    ):
        raise ValueError(
            f"worker_index must be an int in [0, num_workers={num_workers}), got {worker_index!r}"
        )


def _place(tree: Any, device: str, fetch_to_device: bool) -> Any:
    """Move every array of `tree` to `device` (host arrays on CPU devices stay put)."""
    if not fetch_to_device:
        return tree
    host = _is_host(device)
    return nest.map_structure(lambda x: _place_leaf(x, device, host), tree)


def _is_host(device: str) -> bool:
    """Whether `device` keeps arrays in host memory (a CPU device: `to_device` keeps them)."""
    return "GPU" not in device


def _place_leaf(x: Any, device: str, host: bool) -> Any:
    """One component moved to `device`; on a host device, a host array as it is."""
    if host and (type(x) is np.ndarray or (is_torch(x) and x.device.type == "cpu")):
        return x  # what `to_device` returns, without asking the backend per step
    return backend_for(x).to_device(x, device) if is_array(x) else x


def empty_like(tree: Any, replica: int) -> Any:
    """The empty batch (leading dimension 0) shaped like the per-replica batch `tree`."""

    def empty(x: Any) -> Any:
        if (isinstance(x, np.ndarray) or is_torch(x)) and len(x.shape) > 0:
            return x[0:0]
        raise ValueError(
            f"replica {replica} has no data for this step and its peers' batches cannot be "
            f"emptied: expected every component to have a leading batch dimension, got {x!r}. "
            "Batch the per-replica datasets (e.g. with a per-replica batch size from "
            "InputContext.get_per_replica_batch_size) so a short last step can be padded"
        )

    return nest.map_structure(empty, tree)


class Layout:
    """Where the local replicas sit: devices, worker, and the wrapping rule."""

    def __init__(
        self,
        devices: Sequence[str],
        num_workers: int,
        worker_index: int,
        fetch_to_device: bool,
    ) -> None:
        self.devices = _check_devices(devices)
        _check_workers(num_workers, worker_index)
        self.num_workers = num_workers
        self.worker_index = worker_index
        self.fetch_to_device = fetch_to_device
        self.num_local = len(self.devices)
        self.num_global = num_workers * self.num_local
        first = worker_index * self.num_local
        self.replica_ids = range(first, first + self.num_local)
        # TF `_always_wrap`: multi-worker, or more than one local device.
        self.wrap = num_workers > 1 or self.num_local > 1
        self._host = tuple(_is_host(d) for d in self.devices)

    def regroup(self, per_replica: Sequence[Any]) -> Any:
        """One nest per local replica → one nest of `PerReplica` (or the plain nest)."""
        placed = [
            _place(tree, device, self.fetch_to_device)
            for tree, device in zip(per_replica, self.devices, strict=True)
        ]
        if not self.wrap:
            return placed[0]
        structure, columns = nest.flatten_columns(
            placed,
            lambda first, i, spec: (
                "the per-replica batches of one step must share one structure; expected "
                f"{first} (replica 0), got {spec} for local replica {i}"
            ),
        )
        return self._wrap_columns(structure, columns)

    def regroup_leaves(self, structure: Any, columns: Sequence[Sequence[Any]]) -> Any:
        """`regroup` of one batch split by `split_batch_leaves`: leaf k's slices in column k.

        The per-replica nests share `structure` by construction: nothing to compare.
        """
        if self.fetch_to_device:
            places = list(zip(self.devices, self._host, strict=True))
            columns = [
                tuple(
                    _place_leaf(x, device, host)
                    for x, (device, host) in zip(column, places, strict=True)
                )
                for column in columns
            ]
        if not self.wrap:
            return nest.unflatten(structure, [column[0] for column in columns])
        return self._wrap_columns(structure, columns)

    def _wrap_columns(self, structure: Any, columns: Sequence[Sequence[Any]]) -> Any:
        # The devices are this layout's canonical ones, one per component.
        wrapped = [PerReplica._from_parts(tuple(column), self.devices) for column in columns]
        return nest.unflatten(structure, wrapped)
