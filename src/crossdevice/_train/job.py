"""The job a checkpoint belongs to: its workers, and the few collectives saving needs.

Only the chief (worker 0) writes; every worker takes part in a save, because reading a
sync-on-read variable and gathering the workers' random states are collectives. These
go through `strategy.reduce` of small host arrays in cross-replica context, the
strategy's public collectives, so that nothing here depends on how workers talk.
"""

from __future__ import annotations

import contextlib
import json
import struct
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Final

import numpy as np

from crossdevice._core.errors import CollectiveTimeoutError, WorkerFailedError
from crossdevice._core.reduce_op import ReduceOp

__all__ = [
    "any_worker",
    "barrier",
    "collective_call",
    "gather_states",
    "gather_texts",
    "sum_over_workers",
    "torch_world_size",
    "worker_position",
]

_HEADER: Final = struct.Struct("<q")
#: UTF-8 bytes of each worker's row in `gather_texts`: a checkpoint's name and path fit.
_TEXT_WIDTH: Final = 512


def worker_position(strategy: Any) -> tuple[int, int]:
    """`(number of workers, this worker's index)` of `strategy`'s job; `(1, 0)` in one process."""
    if strategy.num_replicas_in_sync == 1:  # the default strategy has no worker_devices
        return 1, 0
    local = len(strategy.extended.worker_devices)
    workers = strategy.num_replicas_in_sync // local
    if workers <= 1:
        return 1, 0
    return workers, strategy.extended._replica_id_offset // local


def torch_world_size() -> int:
    """The number of workers of torch.distributed's default group (1 when there is none)."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available():
        return 1
    dist = torch.distributed
    return int(dist.get_world_size()) if dist.is_initialized() else 1


@contextlib.contextmanager
def collective_call(call: str, name: str) -> Iterator[None]:
    """Say, when a peer fails or ends in it, that `call` is collective: all workers make it.

    A worker that left `call` out (a save on the chief only: `if rank == 0: save()`) is
    seen by the others as a peer that ended or stalled in some all-reduce; the error
    keeps its type and text, led by what this worker was doing and what to do.
    """
    try:
        yield
    except (WorkerFailedError, CollectiveTimeoutError) as err:
        raise type(err)(
            f"{call} did not finish: {name} is collective, so every worker must call it, at "
            "the same point of the program (not the chief alone: a peer that skips it leaves "
            f"this worker waiting in it); here a peer did not take part: {err}"
        ) from err


def sum_over_workers(strategy: Any, array: np.ndarray) -> np.ndarray:
    """The sum over the workers of each worker's `array` (cross-replica context)."""
    workers, _ = worker_position(strategy)
    if workers == 1:
        return array
    return np.asarray(strategy.reduce(ReduceOp.SUM, array, axis=None))


def barrier(strategy: Any) -> None:
    """Return once every worker has called it."""
    sum_over_workers(strategy, np.zeros(1, np.int32))


def any_worker(strategy: Any, flag: bool) -> bool:
    """Whether `flag` is set on any worker (every worker gets the same answer)."""
    return bool(sum_over_workers(strategy, np.asarray([int(flag)], np.int32))[0] > 0)


def _pack(state: Mapping[str, np.ndarray]) -> np.ndarray:
    header = json.dumps({key: int(np.asarray(v).size) for key, v in state.items()}).encode()
    body = b"".join(np.asarray(v, dtype=np.uint8).tobytes() for v in state.values())
    return np.frombuffer(_HEADER.pack(len(header)) + header + body, dtype=np.uint8)


def _unpack(row: np.ndarray) -> dict[str, np.ndarray]:
    raw = row.astype(np.uint8).tobytes()
    (size,) = _HEADER.unpack_from(raw)
    offset = _HEADER.size + size
    state = {}
    for key, count in json.loads(raw[_HEADER.size : offset]).items():
        state[key] = np.frombuffer(raw[offset : offset + count], dtype=np.uint8).copy()
        offset += count
    return state


def gather_states(strategy: Any, state: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Every worker's `state` (named `uint8` arrays), in worker order, on every worker."""
    workers, index = worker_position(strategy)
    if workers == 1:
        return [dict(state)]
    packed = _pack(state)
    sizes = np.zeros(workers, np.int64)
    sizes[index] = packed.size
    sizes = sum_over_workers(strategy, sizes).astype(np.int64)
    rows = np.zeros((workers, int(sizes.max())), np.int32)
    rows[index, : packed.size] = packed
    rows = sum_over_workers(strategy, rows)
    return [_unpack(rows[w, : sizes[w]]) for w in range(workers)]


def gather_texts(strategy: Any, text: str) -> list[str]:
    """Every worker's `text` (cut to 512 UTF-8 bytes), in worker order, in one collective."""
    workers, index = worker_position(strategy)
    if workers == 1:
        return [text]
    raw = text.encode()[:_TEXT_WIDTH]
    rows = np.zeros((workers, _TEXT_WIDTH), np.int32)
    rows[index, : len(raw)] = np.frombuffer(raw, np.uint8)
    rows = sum_over_workers(strategy, rows)
    return [bytes(row.astype(np.uint8)).rstrip(b"\0").decode(errors="replace") for row in rows]
