"""All-reduce a mirrored module's gradients as backward produces them.

Each replica's parameters are split into buckets of about `bucket_cap_bytes`, in reverse
registration order (roughly the order backward produces gradients, as in DDP's reducer).
A hook on each parameter (`register_post_accumulate_grad_hook`) counts the gradients
ready in its bucket; when the next bucket in order is complete the replica all-reduces
it with `ReplicaContext.all_reduce`, one packed call per bucket, so the replicas' values
are added in replica order and every replica gets bitwise the same gradients. Buckets
are reduced strictly in order on every replica, so replicas whose backward passes visit
parameters in different orders still meet in the same collectives. Whatever is left
when backward ends (parameters that got no gradient this step) is reduced by a callback
the autograd engine runs at the end of the pass; a parameter that no replica used keeps
`grad = None`, as in a single-replica run.

Cooperative replicas take turns on one thread, and torch's autograd engine keeps
per-thread state (its ready queue): a replica that waited inside backward would let
another replica's backward run tasks of the first. There the hooks only count, and the
buckets are reduced as soon as `backward()` returns (`torch.autograd.backward` is
wrapped for that), with the same buckets, order and results.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from crossdevice._core.reduce_op import ReduceOp
from crossdevice._strategies.context import get_replica_context
from crossdevice._sync import waiting as cooperative

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "GradientSync"]

#: Default bucket size. DDP's default is 25 MiB; in one process the reduction of a bucket
#: is a rendezvous of the replica threads, so fewer, larger buckets cost less. Measured
#: with benchmarks/train_step.py (README, Training a PyTorch model).
DEFAULT_BUCKET_CAP_BYTES: Final = 25 << 20


@dataclasses.dataclass(eq=False)
class _Bucket:
    indices: list[int]  # positions in the replica's parameter list


class _ReplicaState:
    """One replica's progress through the buckets of the current backward pass."""

    __slots__ = ("callback_queued", "next_bucket", "ready", "seen", "task")

    def __init__(self, num_params: int, num_buckets: int) -> None:
        self.ready = [0] * num_buckets
        self.seen = [False] * num_params
        self.next_bucket = 0
        self.callback_queued = False
        self.task = -1  # the autograd graph task (backward pass) this state belongs to

    def reset(self) -> None:
        self.ready = [0] * len(self.ready)
        self.seen = [False] * len(self.seen)
        self.next_bucket = 0
        self.callback_queued = False
        self.task = -1


class GradientSync:
    """Bucketed, in-order gradient all-reduce for the replicas of one mirrored module.

    Args:
        params: `params[i]` is replica `i`'s list of trainable parameters (same order,
            shapes and dtypes on every replica).
        op: how replicas' gradients combine: SUM (TF's rule: scale the loss by the global
            batch) or MEAN (DDP's rule: each replica's mean loss).
        bucket_cap_bytes: the largest bucket, in bytes (a parameter larger than that is
            a bucket of its own).
        replica_index: returns the local replica running now (None outside a replica).
        num_replicas_in_sync: the strategy's replica count (1: nothing to reduce).
    """

    def __init__(
        self,
        params: Sequence[Sequence[torch.nn.Parameter]],
        op: ReduceOp,
        bucket_cap_bytes: int,
        replica_index: Callable[[], int | None],
        num_replicas_in_sync: int,
    ) -> None:
        self._params = [list(p) for p in params]
        self._op = op
        self._replica_index = replica_index
        self._enabled = num_replicas_in_sync > 1
        self._buckets = _make_buckets(self._params[0], bucket_cap_bytes)
        self._bucket_of = [0] * len(self._params[0])
        for b, bucket in enumerate(self._buckets):
            for index in bucket.indices:
                self._bucket_of[index] = b
        self._states = [
            _ReplicaState(len(self._params[0]), len(self._buckets)) for _ in self._params
        ]
        self._no_sync = [0] * len(self._params)
        self._handles: list[Any] = []
        if self._enabled:
            for replica, replica_params in enumerate(self._params):
                for index, param in enumerate(replica_params):
                    self._handles.append(
                        param.register_post_accumulate_grad_hook(self._hook(replica, index))  # type: ignore[no-untyped-call]
                    )
            _install_backward_wrapper()

    def bucket_sizes(self) -> list[int]:
        """The number of parameters in each bucket, in reduction order."""
        return [len(b.indices) for b in self._buckets]

    def no_sync(self, replica: int) -> _NoSync:
        """Context manager: backward passes inside only accumulate local gradients."""
        return _NoSync(self, replica)

    # --- hooks ----------------------------------------------------------------------------
    def _hook(self, replica: int, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(replica, index)

        return hook

    def _on_grad_ready(self, replica: int, index: int) -> None:
        if self._no_sync[replica]:
            return
        current = self._replica_index()
        if current is None:
            # backward outside `strategy.run`: there are no peers to meet. The gradients
            # stay local, and MirroredOptimizer.step() refuses to run outside `run`.
            return
        if current != replica:
            raise RuntimeError(
                f"replica {current} ran backward through replica {replica}'s copy of a "
                "mirrored module; inside strategy.run call the mirrored module itself "
                "(it picks the running replica's copy), not a copy taken from it"
            )
        state = self._states[replica]
        task = torch._C._current_graph_task_id()
        if state.task != task:
            # A new backward pass; a pass that raised half-way left its state behind.
            state.reset()
            state.task = task
        if state.seen[index]:
            raise RuntimeError(
                "a mirrored module's parameter received a gradient twice in one backward "
                "pass without the first being reduced; this happens with "
                "retain_graph=True backward passes that overlap. Run one backward per "
                "step, or accumulate inside `model.no_sync()`"
            )
        state.seen[index] = True
        state.ready[self._bucket_of[index]] += 1
        coop = cooperative.in_cooperative_replica()
        if not state.callback_queued:
            state.callback_queued = True
            if coop:
                _PENDING.items.append((self, replica))
            else:
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self._finish(replica)
                )
        if not coop:
            self._reduce_ready(replica, final=False)

    def _reduce_ready(self, replica: int, final: bool) -> None:
        state = self._states[replica]
        while state.next_bucket < len(self._buckets):
            b = state.next_bucket
            if not final and state.ready[b] < len(self._buckets[b].indices):
                return
            state.next_bucket += 1
            self._reduce_bucket(replica, self._buckets[b])

    def _finish(self, replica: int) -> None:
        try:
            self._reduce_ready(replica, final=True)
        finally:
            self._states[replica].reset()

    def _reduce_bucket(self, replica: int, bucket: _Bucket) -> None:
        params = self._params[replica]
        state = self._states[replica]
        grads = []
        used = torch.zeros(len(bucket.indices), dtype=torch.float32)
        for k, index in enumerate(bucket.indices):
            param = params[index]
            grad = param.grad
            if grad is None or not state.seen[index]:
                # No gradient from this replica's backward: it adds zeros, and the
                # parameter takes the sum of the others'.
                grads.append(torch.zeros_like(param))
            else:
                grads.append(grad)
                used[k] = 1.0
        ctx = get_replica_context()
        assert ctx is not None  # _on_grad_ready checked that a replica is running
        reduced = ctx.all_reduce(self._op, [*grads, used])
        users = reduced[-1]
        with torch.no_grad():
            for k, index in enumerate(bucket.indices):
                param = params[index]
                if users[k] == 0:
                    param.grad = None  # no replica used it: as in a single-replica run
                else:
                    param.grad = reduced[k]


class _NoSync:
    def __init__(self, sync: GradientSync, replica: int) -> None:
        self._sync = sync
        self._replica = replica

    def __enter__(self) -> None:
        self._sync._no_sync[self._replica] += 1

    def __exit__(self, *exc: object) -> None:
        self._sync._no_sync[self._replica] -= 1


def _make_buckets(params: Sequence[torch.nn.Parameter], cap: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    size = 0
    current: list[int] = []
    for index in reversed(range(len(params))):
        nbytes = params[index].numel() * params[index].element_size()
        if current and size + nbytes > cap:
            buckets.append(_Bucket(current))
            current, size = [], 0
        current.append(index)
        size += nbytes
    if current:
        buckets.append(_Bucket(current))
    return buckets


# --- cooperative replicas: reduce once backward has returned --------------------------------
class _Pending(threading.local):
    """Per thread: the (sync, replica) pairs whose buckets wait for backward to return.

    Cooperative replicas share their thread, but one replica's backward always returns
    before another's starts (a replica does not yield inside it), so one list serves.
    """

    def __init__(self) -> None:
        self.items: list[tuple[GradientSync, int]] = []


_PENDING = _Pending()
_WRAPPED: dict[str, Any] = {}
_WRAP_LOCK = threading.Lock()


def _install_backward_wrapper() -> None:
    with _WRAP_LOCK:
        if "backward" in _WRAPPED:
            return
        original = torch.autograd.backward
        _WRAPPED["backward"] = original

        def backward(*args: Any, **kwargs: Any) -> Any:
            try:
                result = original(*args, **kwargs)
            except BaseException:
                items, _PENDING.items = _PENDING.items, []
                for sync, replica in items:
                    sync._states[replica].reset()
                raise
            items = _PENDING.items
            if items:
                _PENDING.items = []
                for sync, replica in items:
                    sync._finish(replica)
            return result

        backward.__doc__ = original.__doc__
        backward.__wrapped__ = original  # type: ignore[attr-defined]
        torch.autograd.backward = backward
