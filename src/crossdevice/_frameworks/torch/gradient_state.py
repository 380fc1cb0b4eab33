"""What `GradientSync` keeps: the buckets of the trainable parameters, and each replica's pass.

Each replica's trainable parameters are split into buckets of about `bucket_cap_bytes`,
in reverse registration order (roughly the order backward produces gradients, as in
DDP's reducer); a layout is made once per set of `requires_grad` flags. A replica's
state holds the backward pass in flight and what each of its `.grad` holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from crossdevice._arrays.packing import group_by_size
from crossdevice._frameworks.torch.buckets import FlatPlan
from crossdevice._frameworks.torch.pass_reduce import PassReduce

__all__ = ["Layout", "ReplicaState", "make_layout"]


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """The buckets for one set of trainable parameters."""

    buckets: list[list[int]]  # positions in the replica's parameter list, reduction order
    bucket_of: list[int]  # bucket of each parameter, -1 for a frozen or sparse one
    sizes: list[int]  # how many parameters each bucket holds
    # The trainable parameters with sparse gradients, reduced on their own (`sparse.py`).
    sparse: tuple[int, ...] = ()
    # (replica, bucket) -> the bucket's flat all-reduce layout, made at its first use.
    flat: dict[tuple[int, int], FlatPlan] = dataclasses.field(default_factory=dict)
    # (replica, bucket) -> the replica's parameters of the bucket, in bucket order.
    members: dict[tuple[int, int], list[torch.nn.Parameter]] = dataclasses.field(
        default_factory=dict
    )
    # replica -> its buckets' plans and their leaves end to end, for one all-reduce a pass.
    passes: dict[int, tuple[list[FlatPlan], tuple[Any, ...]]] = dataclasses.field(
        default_factory=dict
    )


def make_layout(
    params: Sequence[torch.nn.Parameter],
    mask: Sequence[bool],
    cap: int,
    sparse: frozenset[int] = frozenset(),
) -> Layout:
    """The buckets of the trainable parameters: reverse order, cut under `cap` bytes.

    The parameters in `sparse` (sparse gradients) go in no bucket: `Layout.sparse`.

    `group_by_size(..., cap=True)`: a bucket never holds more than `cap` bytes unless one
    parameter alone does. Parameters are not grouped by dtype or device first (DDP's
    reducer does; these buckets never were): a mixed bucket takes
    `ReplicaContext.all_reduce`'s path (`buckets.flat_reducible`), which packs by dtype
    itself, and grouping would move the bucket boundaries of existing models.
    """
    order = [i for i in reversed(range(len(params))) if mask[i] and i not in sparse]
    nbytes = [params[i].numel() * params[i].element_size() for i in order]
    buckets = [[order[k] for k in bucket] for bucket in group_by_size(nbytes, cap, cap=True)]
    bucket_of = [-1] * len(params)
    for b, bucket in enumerate(buckets):
        for index in bucket:
            bucket_of[index] = b
    trainable_sparse = tuple(i for i in sorted(sparse) if mask[i])
    return Layout(buckets, bucket_of, [len(b) for b in buckets], trainable_sparse)


#: What `produced` holds before any reduction: calling it gives None.
_NONE: Final = type(None)


class ReplicaState:
    """One replica's gradients: the pass in flight and what each `.grad` holds."""

    __slots__ = (
        "base",
        "deferred",
        "held",
        "hooked",
        "in_pass",
        "layout",
        "next_bucket",
        "passing",
        "pending",
        "produced",
        "produced_shared",
        "produced_version",
        "ready",
        "seen",
        "synced",
        "touched",
    )

    def __init__(self, num_params: int) -> None:
        self.in_pass = False
        self.deferred = False  # reduce only when the pass ends (cooperative replicas)
        self.hooked = False  # a gradient arrived in this pass
        self.layout: Layout | None = None
        self.ready: list[int] = []
        self.seen = [False] * num_params
        self.next_bucket = 0
        # Bucket all-reduces issued in this pass, in order, not yet given to `.grad`.
        self.pending: list[tuple[list[int], Any]] = []
        # Collectives this thread had started when the pass's first bucket left, while
        # `GradientSync` watches whether backward starts any (None: not watching).
        self.held: int | None = None
        # The pass's buckets as one all-reduce (`pass_reduce.py`), once its first left.
        self.passing: PassReduce | None = None
        # The agreed part of .grad, taken out while a pass accumulates the local part.
        self.base: list[torch.Tensor | None] = [None] * num_params
        # .grad holds the agreed value in `produced` (weakly: zero_grad() frees its buffer
        # for the next step), maybe changed in place (clipping, zero_grad(set_to_none=False)).
        self.synced = [False] * num_params
        self.produced: list[Callable[[], torch.Tensor | None]] = [_NONE] * num_params
        self.produced_version = [0] * num_params
        # The produced gradient lies in the one buffer every replica's gradient views.
        self.produced_shared = [False] * num_params
        # Autograd accumulated into the parameter since the last optimizer step.
        self.touched = [False] * num_params
