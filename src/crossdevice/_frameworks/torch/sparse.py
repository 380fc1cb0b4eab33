"""Sparse gradients (`nn.Embedding(sparse=True)`, `nn.EmbeddingBag(sparse=True)`).

A sparse COO gradient has no fixed size: each replica's holds the rows its own batch
looked up. Such a parameter is kept out of the dense buckets (`gradient_state.make_layout`)
and reduced on its own when the outermost backward pass returns, after the module's dense
buckets, as torch DDP gives each sparse parameter a bucket of its own: every replica's
indices and values are gathered in replica order (the global batch order, across workers
too: `ReplicaContext.all_gather`, whose sizes may differ per replica and per worker) and
coalesced. So the reduced gradient is plain torch's on the global batch: the sum of the
rows looked up (under `gradient_reduction="mean"`, divided by the replicas in sync, as
the dense buckets' mean is), with every row any replica touched, even one whose net
gradient is zero (`SparseAdam` still updates it, as plain torch's does).

Every replica computes the same coalesce of the same gathered data, so every replica's
`.grad` is bitwise the same: each its own tensor, with shared storage too (an in-place
change of a sparse tensor replaces its values rather than writing into them, so there
is no one buffer to share; the one optimizer step there reads replica 0's, which a
change made once for all replicas, `call_once` or torch's clipping, is made to).
A replica whose pass gave the parameter no gradient contributes nothing; where no
replica had one, `.grad` stays as it was, as for a dense parameter. A parameter whose
gradient became dense on some replica (a weight tied to a dense layer) gets the dense
sum on every replica. The gathered data travels in the gradient's own dtype
(`prepare(gradient_dtype=)` compresses the dense buckets only).

Which parameters make sparse gradients is known at `prepare`: those of each submodule
with `sparse=True` (`mark`, from `setup.check_mirrorable`), looked up by the original
module's own parameters, which are replica 0's.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Final

import torch

from crossdevice._core.reduce_op import ReduceOp
from crossdevice._frameworks.torch.buckets import stepped
from crossdevice._frameworks.torch.gradient_state import ReplicaState
from crossdevice._strategies.context import get_replica_context

__all__ = ["assign", "mark", "marked", "reduce", "reduce_into", "refuse_unmarked"]

# id(parameter) -> the parameter (weakly), for the parameters of sparse=True submodules
# of modules being prepared (a finalizer removes the entry).
_MARKED: dict[int, weakref.ref[torch.nn.Parameter]] = {}

#: What a replica says of each parameter's gradient (`reduce`'s flags).
_NONE: Final = 0  # no gradient: contributes nothing
_SPARSE: Final = 1
_DENSE: Final = 2  # a dense gradient of a sparse parameter (a tied weight): the sum is dense


def mark(module: torch.nn.Module) -> None:
    """Remember the parameters of `module`'s submodules built with `sparse=True`."""
    for submodule in module.modules():
        if getattr(submodule, "sparse", False) is True:
            for param in submodule.parameters(recurse=False):
                _MARKED[id(param)] = weakref.ref(param)
                weakref.finalize(param, _MARKED.pop, id(param), None)


def marked(params: Sequence[torch.nn.Parameter]) -> frozenset[int]:
    """The positions in `params` of parameters that `mark` saw (sparse gradients)."""
    found = set()
    for index, param in enumerate(params):
        ref = _MARKED.get(id(param))
        if ref is not None and ref() is param:
            found.add(index)
    return frozenset(found)


def reduce_into(
    state: ReplicaState,
    params: Sequence[torch.nn.Parameter],
    indices: Sequence[int],
    op: ReduceOp,
    steps: int,
) -> None:
    """Reduce the running replica's gradients of `params[i] for i in indices` into `.grad`."""
    if not indices:
        return
    ctx = get_replica_context()
    assert ctx is not None  # passes and steps reduce inside a replica
    mine = [params[i] for i in indices]
    reduced = reduce(ctx, op, [p.grad for p in mine], mine, steps)
    assign(state, params, indices, reduced)


def reduce(
    ctx: Any,
    op: ReduceOp,
    grads: Sequence[torch.Tensor | None],
    params: Sequence[torch.nn.Parameter],
    steps: int,
) -> list[torch.Tensor | None]:
    """Every replica's gradients of `params`, gathered and reduced; the same on every replica.

    One `all_gather` for them all: each parameter's indices and values, flat (replicas
    agree on every axis but the gathered one), then each replica's flags (what its
    gradient was, and its sparse dimensions).

    Args:
        ctx: the running replica's context.
        op: SUM or MEAN (the sum divided by the replicas in sync).
        grads: this replica's gradient of each parameter not reduced yet (None: none).
        params: the parameters (shapes, dtypes, devices).
        steps: the optimizer steps taken so far, compared across workers (`stepped`).

    Returns:
        Each parameter's reduced gradient, coalesced (dense where a replica's was), or
        None where no replica had one.
    """
    leaves: list[torch.Tensor] = []
    flags: list[int] = []
    for grad, param in zip(grads, params, strict=True):
        if grad is None:
            leaves += [param.new_zeros(0, dtype=torch.int64), param.new_zeros(0)]
            flags += [_NONE, 0]
            continue
        kind = _SPARSE if grad.is_sparse else _DENSE
        local = grad.detach() if kind == _SPARSE else grad.detach().to_sparse(1)
        leaves += [local._indices().t().reshape(-1), local._values().reshape(-1)]
        flags += [kind, local.sparse_dim()]
    own = torch.tensor([flags], dtype=torch.int64, device=params[0].device)
    with stepped(ctx, steps):
        gathered = ctx.all_gather([*leaves, own], axis=0)
    every = gathered[-1].cpu().tolist()  # one row per replica, in replica order
    out: list[torch.Tensor | None] = []
    for k, param in enumerate(params):
        kinds = {(row[2 * k], row[2 * k + 1]) for row in every if row[2 * k] != _NONE}
        if not kinds:
            out.append(None)
            continue
        indices, values = gathered[2 * k : 2 * k + 2]
        out.append(_combine(op, ctx.num_replicas_in_sync, indices, values, kinds, param))
    return out


def _combine(
    op: ReduceOp,
    n: int,
    indices: torch.Tensor,
    values: torch.Tensor,
    kinds: set[tuple[int, int]],
    param: torch.Tensor,
) -> torch.Tensor:
    """One parameter's gathered indices and values as its coalesced sum (or mean)."""
    sparse_dims = {dims for _, dims in kinds}
    if len(sparse_dims) != 1:
        raise RuntimeError(
            "the replicas' sparse gradients of one parameter of a mirrored module have "
            f"different sparse dimensions, {sorted(sparse_dims)}; expected the same on "
            "every replica (one lookup of the same parameter)"
        )
    (dims,) = sparse_dims
    total = torch.sparse_coo_tensor(
        indices.reshape(-1, dims).t(),
        values.reshape(-1, *param.shape[dims:]),
        param.shape,
        check_invariants=False,
    ).coalesce()
    if op is ReduceOp.MEAN:  # as the dense buckets' mean: the sum, then one division
        total = torch.sparse_coo_tensor(
            total._indices(),
            torch.true_divide(total._values(), n),
            param.shape,
            is_coalesced=True,
            check_invariants=False,
        )
    if any(kind == _DENSE for kind, _ in kinds):  # a replica's gradient was dense
        return total.to_dense()
    return total


def assign(
    state: ReplicaState,
    params: Sequence[torch.nn.Parameter],
    indices: Sequence[int],
    reduced: Sequence[torch.Tensor | None],
) -> None:
    """`reduce`'s results become `.grad`, each added to its agreed part (`GradientSync._assign`)."""
    for index, result in zip(indices, reduced, strict=True):
        param = params[index]
        base = state.base[index]
        state.base[index] = None
        if result is None:
            param.grad = base  # no replica had a gradient: as it was before
            state.synced[index] = base is not None
            continue
        total = result
        if base is not None:
            with torch.no_grad():
                total = base + result
            if total.is_sparse:
                total = total.coalesce()
        param.grad = total
        state.produced[index] = weakref.ref(total)
        state.produced_version[index] = total._version
        state.produced_shared[index] = False
        state.synced[index] = True


def refuse_unmarked(
    names: Sequence[str], params: Sequence[torch.nn.Parameter], bucket: Sequence[int]
) -> None:
    """Raise a clear error where a dense bucket holds a sparse gradient `mark` never saw.

    (A parameter used through `F.embedding(..., sparse=True)` in a module with no
    `sparse=True` submodule, or a deep copy of a mirrored module.)
    """
    for index in bucket:
        grad = params[index].grad
        if grad is not None and grad.is_sparse:
            raise RuntimeError(
                f"parameter {names[index]!r} of a mirrored module received a sparse "
                "gradient, but prepare saw no submodule with sparse=True holding it, so it "
                "went into a dense gradient bucket; expected a sparse=True submodule "
                "(nn.Embedding, nn.EmbeddingBag) owning the parameter when prepare runs. "
                "Prepare the original model (not a deep copy of a mirrored one), or "
                "build the lookup with sparse=False"
            )
