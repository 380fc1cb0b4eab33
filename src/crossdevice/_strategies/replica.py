"""`ReplicaContext`: the `tf.distribute.Strategy` API inside a replica.

The functions that say which strategy and replica context are current live in
`crossdevice._strategies.context`; this module knows the context of one replica only, so
the strategies can build replica contexts without importing those accessors (which know
the default strategy).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from crossdevice._comm.protocol import Done, Pending
from crossdevice._core import context, nest, validate
from crossdevice._core.options import CommunicationOptions
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op
from crossdevice._cross_device.call_site import call_site

if TYPE_CHECKING:
    from crossdevice._strategies.base import Strategy

__all__ = ["ReplicaContext", "all_reduce_async", "in_section"]


class ReplicaContext:
    """The `tf.distribute.Strategy` API inside a replica (`tf.distribute.ReplicaContext`).

    Get it with `crossdevice.get_replica_context()` inside a function passed to
    `strategy.run`. Collective methods (`all_reduce`, `all_gather`, `merge_call`) must be
    called by every replica, in the same order.

    Args:
        strategy: the strategy running this replica.
        replica_id_in_sync_group: the replica's id among all replicas in sync.
    """

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int) -> None:
        if isinstance(replica_id_in_sync_group, bool) or not isinstance(
            replica_id_in_sync_group, int
        ):
            raise ValueError(
                "replica_id_in_sync_group can only be an integer, got "
                f"{type(replica_id_in_sync_group).__name__}: {replica_id_in_sync_group!r}"
            )
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group

    @property
    def strategy(self) -> Strategy:
        """The current strategy."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas over which values are aggregated."""
        return int(self._strategy.num_replicas_in_sync)

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id, in `range(num_replicas_in_sync)`."""
        return self._replica_id

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices this replica runs on, as a tuple of strings."""
        return self._strategy.extended._replica_devices(self._replica_id)

    def _check_current(self) -> None:
        frame = context.current_frame()
        if frame is None:
            # The default replica context: replica 0 of the default strategy.
            current = self if self._strategy.extended._is_default and not self._replica_id else None
        else:
            current = frame.replica_context
        if current is not self:
            raise RuntimeError(
                "Mismatching ReplicaContext: this method must be called in the replica "
                "context it belongs to (inside the `strategy.run` function that got it from "
                "`get_replica_context()`), not from another thread or context"
            )

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Merge `args` across replicas and run `merge_fn` once in cross-replica context.

        Arguments that are the same object on every replica stay as they are; the others
        become `PerReplica` values. `merge_fn(strategy, *args, **kwargs)` runs once, and
        each replica gets back its own component of the result (`Mirrored` and
        `PerReplica` values are unpacked).

        Args:
            merge_fn: called as `merge_fn(strategy, *args, **kwargs)`.
            args: positional per-replica arguments (a list or tuple).
            kwargs: keyword per-replica arguments.

        Returns:
            The return value of `merge_fn`, with per-replica values unpacked.
        """
        validate.function(merge_fn, "ReplicaContext.merge_call")
        if not isinstance(args, list | tuple):
            raise ValueError(
                f"merge_call args must be a list or tuple, got {type(args).__name__}: {args!r}"
            )
        self._check_current()
        extended = self._strategy.extended
        if extended._sections:
            merge_fn = in_section(merge_fn, extended._sections)
        return extended._merge_call(
            self._replica_id, merge_fn, tuple(args), dict(kwargs or {}), always_wrap=False
        )

    def all_reduce(
        self, reduce_op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None
    ) -> Any:
        """All-reduce a nest of arrays across replicas; every replica gets the result.

        The whole nest is reduced in one batched call. Example with two replicas:
        replica 0 passes `{'a': 1, 'b': [40, 1]}`, replica 1 `{'a': 3, 'b': [2, 98]}`;
        SUM gives `{'a': 4, 'b': [42, 99]}` and MEAN `{'a': 2, 'b': [21, 49.5]}` on both.

        Args:
            reduce_op: `ReduceOp.SUM`, `ReduceOp.MEAN`, or `"sum"`/`"mean"`.
            value: a nest of arrays, the same structure and shapes on every replica.
            options: a `CommunicationOptions`.

        Returns:
            The reduced nest (host results may be read-only arrays shared by replicas).
        """
        op = self._checked(reduce_op, value, options, "ReplicaContext.all_reduce")
        extended = self._strategy._extended
        if type(value) is not np.ndarray:  # a NumPy array never requires grad
            differentiable, leaves, structure = _needs_grad(value)
            if differentiable:
                # TF's all_reduce is differentiable: route tensors that require grad
                # through an autograd function whose backward all-reduces the gradients.
                from crossdevice._arrays import torch_autograd

                leaves = [_as_tensor(x) for x in leaves]
                reduce = self._reduce_list(options)
                reduced = torch_autograd.all_reduce(reduce, op, leaves, call_site())
                return nest.unflatten(structure, reduced)
        return extended._replica_all_reduce(self._replica_id, op, value, options)

    def all_gather(self, value: Any, axis: int, options: CommunicationOptions | None = None) -> Any:
        """Concatenate a nest of arrays from every replica along `axis`.

        Sizes may differ along `axis` only.

        Args:
            value: a nest of arrays.
            axis: the axis to concatenate along.
            options: a `CommunicationOptions`.

        Returns:
            The gathered nest, the same on every replica.
        """
        self._check_current()
        # Checked here, before this replica meets its peers: every leaf's rank is known.
        for leaf in nest.flatten(value)[0]:
            validate.axes(axis, np.ndim(leaf), "ReplicaContext.all_gather", several=False)
        axis = int(axis)
        extended = self._strategy.extended
        differentiable, leaves, structure = _needs_grad(value)
        if differentiable:
            # Differentiable, as TF's: the gradient is this replica's slice of the
            # SUM all-reduce of the upstream gradients.
            from crossdevice._arrays import torch_autograd

            def gather(xs: list[Any], gather_axis: int) -> list[Any]:
                return extended._replica_all_gather(self._replica_id, xs, gather_axis, options)

            leaves = [_as_tensor(x) for x in leaves]
            reduce = self._reduce_list(options)
            index = self._replica_id
            gathered = torch_autograd.all_gather(
                gather, reduce, ReduceOp.SUM, leaves, axis, index, call_site()
            )
            return nest.unflatten(structure, gathered)
        return extended._replica_all_gather(self._replica_id, value, axis, options)

    def _checked(self, reduce_op: ReduceOp | str, value: Any, options: Any, where: str) -> ReduceOp:
        """The reduce op of an all-reduce whose arguments and context were checked."""
        op = as_reduce_op(reduce_op)
        validate.reducible(value, where)
        if options is not None and not isinstance(options, CommunicationOptions):
            raise ValueError(f"options must be a CommunicationOptions or None, got {options!r}")
        frame = context.current_frame()
        if frame is None or frame.replica_context is not self:  # not this replica's own
            self._check_current()
        return op

    def _reduce_list(
        self, options: CommunicationOptions | None
    ) -> Callable[[ReduceOp, list[Any]], list[Any]]:
        """This replica's plain all-reduce of a list (what the autograd functions call)."""
        extended = self._strategy.extended

        def reduce(op: ReduceOp, xs: list[Any]) -> list[Any]:
            return extended._replica_all_reduce(self._replica_id, op, xs, options)

        return reduce

    def __enter__(self) -> ReplicaContext:
        self._frame = context.Frame(self._strategy, self, self._replica_id)
        context.push_frame(self._frame)
        return self

    def __exit__(self, *exc: object) -> None:
        context.pop_frame(self._frame)

    def __repr__(self) -> str:
        return (
            f"<crossdevice.ReplicaContext replica_id_in_sync_group={self._replica_id} "
            f"of {type(self._strategy).__name__}>"
        )


def all_reduce_async(
    ctx: ReplicaContext,
    reduce_op: ReduceOp | str,
    value: Any,
    options: CommunicationOptions | None = None,
) -> Pending:
    """`ctx.all_reduce(reduce_op, value, options)` issued now; `wait()` gives its result.

    For a replica that can reduce one part of its work (a gradient bucket) as soon as it
    is ready and go on computing: the collective is the one `all_reduce` makes (the same
    fingerprint, checks and numbering), left in flight across workers, and `wait()`
    returns bitwise what `all_reduce` would have returned. Every replica issues the same
    all-reduces in the same order, as with `all_reduce`.

    - `wait()` is bounded by the collective's timeout and raises what ended it, as
      itself (`CollectiveMismatchError`, `WorkerFailedError`, `CollectiveTimeoutError`),
      each time it is asked; `done()` says whether `wait` would return at once.
    - At most one cross-worker collective is in flight: issuing the next one (another
      `all_reduce_async`, any all-reduce, gather or merge) first completes this one.
      Issue in order, wait in any order.
    - `value` must not change before `wait()` returns (parts of it may leave only then).
    - Within one process (replicas on threads, one device), and for values that require
      grad (routed through autograd as `all_reduce` does), it completes before it
      returns: there is nothing across processes to overlap.

    Args:
        ctx: the calling replica's context (`get_replica_context()`).
        reduce_op: `ReduceOp.SUM`, `ReduceOp.MEAN`, or `"sum"`/`"mean"`.
        value: a nest of arrays, the same structure and shapes on every replica.
        options: a `CommunicationOptions`.

    Returns:
        A pending all-reduce: `wait()` returns the reduced nest, `done()` whether it has.
    """
    op = ctx._checked(reduce_op, value, options, "all_reduce_async")
    if type(value) is not np.ndarray and _needs_grad(value)[0]:
        return Done(ctx.all_reduce(op, value, options))
    return ctx._strategy.extended._replica_all_reduce_async(ctx._replica_id, op, value, options)


def _needs_grad(value: Any) -> tuple[bool, list[Any], Any]:
    """(route through autograd?, leaves, structure) for a replica collective's value."""
    if "torch" not in sys.modules or isinstance(value, np.ndarray | np.generic):
        return False, [], None
    from crossdevice._arrays import torch_autograd

    leaves, structure = nest.flatten(value)
    return torch_autograd.needs_grad(leaves), leaves, structure


def _as_tensor(x: Any) -> Any:
    torch = sys.modules["torch"]
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def in_section(merge_fn: Callable[..., Any], sections: Any) -> Callable[..., Any]:
    """`merge_fn` as a cross-replica section (`sections`): listeners see it start and end."""

    def section(strategy: Any, *args: Any, **kwargs: Any) -> Any:
        sections.enter()
        try:
            result = merge_fn(strategy, *args, **kwargs)
        except BaseException as error:
            try:
                sections.leave()
            except Exception as also:  # merge_fn's own error is the one to raise
                error.add_note(f"bringing every replica to replica 0's state failed too: {also!r}")
            raise
        sections.leave()
        return result

    return section
