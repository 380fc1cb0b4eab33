"""The backward passes of mirrored modules: where they start and end, on every replica.

`torch.autograd.backward` (which `loss.backward()` calls) is replaced while a strategy
with several replicas is in use (`torch_patches`). Inside a replica it marks the
outermost backward pass of the running replica, for every mirrored module of the
strategy (`GradientSync.begin_pass` / `end_pass`), so that:

* nested passes (reentrant activation checkpointing runs backward inside backward)
  belong to the outermost one, and the left-over buckets are reduced once, when it
  returns;
* cooperative replicas reduce after the pass, never inside torch's engine;
* torch's engine runs the pass on the replica's own thread
  (`set_multithreading_enabled(False)`): CUDA passes would otherwise run their gradient
  hooks on torch's device threads, which know nothing of the replica.

It also gives the one-time warning for a DDP habit that is wrong under TF's SUM rule: a
loss that is this replica's *mean* (`cross_entropy(...)`, `.mean()`, a sum divided by
this replica's batch), whose gradients the SUM then multiplies by the number of
replicas (looked for in each replica's first 4 passes, then in its passes 8, 16, ...).
The check looks through sums of terms, negation and constant factors (`loss /
accumulation_steps`, `0.5 * loss`), and stays silent when those factors come to exactly
1/N: `local_mean / num_replicas_in_sync` is the correct TF idiom. It also stays silent on
a step where one replica holds every local example and the others none (a last global
batch of 1 split 1/0): there this replica's batch is the global batch, and its mean is
right (the bug hunt of session 58 found the warning on a correct loss): the replicas of a
looked-at pass post what their losses summed over, and the last one in judges.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Final

import torch

from crossdevice._arrays import torch_patches
from crossdevice._core import context
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._frameworks.torch import step_state
from crossdevice._frameworks.torch.gradients import GradientSync

__all__ = ["refuse_step_in_pass", "register"]

# strategy -> its mirrored modules' gradient syncs, held weakly, in registration order (the
# order every worker's passes end in: the same on all of them)
_SYNCS: weakref.WeakKeyDictionary[Any, tuple[weakref.ref[GradientSync], ...]] = (
    weakref.WeakKeyDictionary()
)
_SYNCS_LOCK: Final = threading.Lock()
_MEAN_REDUCTION: Final = 1  # torch's Reduction::Mean, as saved on loss backward nodes
_SUM_REDUCTION: Final = 2  # torch's Reduction::Sum
_THROUGH: Final = ("AddBackward0", "SubBackward0")  # a sum of terms: look at each
_SCALE: Final = {"MulBackward0": 1, "DivBackward0": -1}  # times/over a constant: its power
_DEPTH: Final = 8  # nodes followed from the loss: a loss expression, not the model


class _Pass(threading.local):
    depth = 0


_PASS: Final = _Pass()


def register(strategy: Any, sync: GradientSync) -> None:
    """Tell the backward passes of `strategy`'s replicas about `sync` (held weakly)."""
    with _SYNCS_LOCK:
        alive = tuple(ref for ref in _SYNCS.get(strategy, ()) if ref() is not None)
        if not any(ref() is sync for ref in alive):
            alive += (weakref.ref(sync),)
        _SYNCS[strategy] = alive
    extended = strategy.extended
    if getattr(extended, "_worker_communicator", None) is not None:
        # The last step of a pass over the data has no next backward to carry its state:
        # the end of the pass compares it (`_StepSync.ended`).
        extended._final_state = functools.partial(_final_state, weakref.ref(strategy))


def _final_state(strategy_ref: weakref.ref[Any]) -> Any:
    """A context for a collective that carries the state a next backward would carry."""
    strategy = strategy_ref()
    if strategy is None:
        return contextlib.nullcontext()
    return step_state.workers_agree(strategy, _live_syncs(strategy), 0)


def _live_syncs(strategy: Any) -> list[GradientSync]:
    """`strategy`'s mirrored modules' gradient syncs that reduce, in registration order."""
    return [s for ref in _SYNCS.get(strategy, ()) if (s := ref()) is not None and s.enabled]


def refuse_step_in_pass() -> None:
    """Raise if the calling replica is inside its backward pass (an optimizer step there).

    torch's optimizer-in-backward idiom steps from `register_post_accumulate_grad_hook`:
    each parameter as soon as its gradient is accumulated, before the pass has reduced
    it across replicas. That step would apply the replica's own gradient; said as such
    (the bug hunt of session 57: the error blamed `no_sync()`).
    """
    if _PASS.depth:
        raise RuntimeError(
            "optimizer.step() was called during this replica's backward pass (from a "
            "gradient hook: torch's optimizer-in-backward idiom, "
            "register_post_accumulate_grad_hook), before the pass reduced the gradients "
            "across replicas: it would apply this replica's gradient only. Call "
            "optimizer.step() after loss.backward() returns (the gradients are all-reduced "
            "as backward completes them, so there is no memory to save by stepping inside)"
        )


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(*args: Any, **kwargs: Any) -> Any:
        return _backward(original, args, kwargs)

    backward.__doc__ = original.__doc__
    backward.__wrapped__ = original  # type: ignore[attr-defined]
    torch_patches.on_dynamo(lambda: _skipped(backward))
    return backward


def _backward(original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    if _PASS.depth:
        _PASS.depth += 1  # a nested pass (reentrant checkpoint) is the outermost's
        try:
            return original(*args, **kwargs)
        finally:
            _PASS.depth -= 1
    frame = context.current_frame()
    if frame is None or frame.replica_context is None:
        return original(*args, **kwargs)
    replica = frame.local_replica_id
    assert replica is not None
    syncs = _live_syncs(frame.strategy)
    if syncs:
        tensors = args[0] if args else kwargs.get("tensors")
        _warn_local_mean(tensors, syncs, frame.strategy, replica)
    for sync in syncs:
        sync.begin_pass(replica)
    _PASS.depth = 1
    threads = torch._C._is_multithreading_enabled()
    torch._C._set_multithreading_enabled(False)
    try:
        # Across workers the pass's gradients carry its optimizers' state (`step_state`).
        with step_state.workers_agree(frame.strategy, syncs, replica):
            try:
                result = original(*args, **kwargs)
            finally:
                _PASS.depth = 0
                torch._C._set_multithreading_enabled(threads)
            for sync in syncs:  # every module's last buckets go before any waits
                sync.flush_pass(replica)
            for sync in syncs:  # collectives: cooperative replicas may switch here
                sync.end_pass(replica)
    except BaseException as err:
        for sync in syncs:  # (a pass that ended already: nothing to do)
            sync.abort_pass(replica, err)
        raise
    return result


def _skipped(backward: Callable[..., Any]) -> None:
    import torch._dynamo

    torch._dynamo.decorators.skip(backward)


def _ready_for_dynamo() -> None:
    """Keep backward passes of a compiled step out of torch.compile's graphs.

    A compiled training step (`@torch.compile` around zero_grad, forward, `backward()`
    and the optimizer's step) calls the patched `torch.autograd.backward` from traced
    code. It reads this thread's replica and runs collectives, and its gradient hooks
    do too: dynamo skips the patch's frame and runs the pass eagerly, hooks included
    (traced, it failed on the weak references: the bug hunt of session 54). A compiled
    model's own backward graph still runs compiled, inside the pass.
    """
    global _backward
    import torch._dynamo

    _backward = torch._dynamo.disable(_backward)  # type: ignore[no-untyped-call]


torch_patches.on_dynamo(_ready_for_dynamo)


#: Taken to mark a model warned: "once per model" with several replica threads.
_WARNED_LOCK: Final = threading.Lock()


#: A replica's first passes whose loss is looked at; after them, its passes 2**k only.
_ALWAYS_LOOKED_AT: Final = 4


def _looked_at(sync: GradientSync, replica: int) -> bool:
    """Whether this pass of `replica` through `sync`'s model has its loss looked at.

    Counts the replica's passes. Reading a fresh graph's nodes from Python costs 40-60 us
    a pass on the tutorial CNN (every node object made anew, after the forward pass took
    the caches): each replica's passes 1-4, then 8, 16, 32, ...: the habit shows in the
    first pass; a loss changed later is still found, at the next power of two.
    """
    passes = sync.mean_loss_passes
    passes[replica] += 1
    n = passes[replica]
    return n <= _ALWAYS_LOOKED_AT or n & (n - 1) == 0


def _warn_local_mean(tensors: Any, syncs: list[GradientSync], strategy: Any, replica: int) -> None:
    pending = [
        s
        for s in syncs
        if s.op is ReduceOp.SUM and not s.warned_mean_loss and _looked_at(s, replica)
    ]
    if not pending:
        return
    roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or ())
    n = strategy.num_replicas_in_sync
    kind = None
    loss = roots[0] if roots else None
    for root in roots:
        found = _local_mean(getattr(root, "grad_fn", None), 1.0, n)
        # A local mean not scaled by exactly 1/N; silent where a factor is unreadable.
        if found is not None and found[1] is not None and abs(abs(found[1]) * n - 1) > 1e-6:
            kind, loss = found[0], root
            break
    # Only the models this loss trains: another model on the strategy (prepared with
    # the other rule, or trained by another loss) is not this loss's business.
    suspects = _in_graph(roots, pending, replica) if kind is not None else []
    held = [weakref.ref(s) for s in suspects]  # a waiting pass keeps no model alive
    counts = _loss_counts(getattr(loss, "grad_fn", None))
    with _WARNED_LOCK:  # replica threads find it at once: one of them warns
        row = _posted(strategy, replica, len(pending[0].mean_loss_passes), (kind, counts, held))
        if row is None:
            return  # the pass's last replica judges
        pending = [s for s in _judged(row) if not s.warned_mean_loss]
        for sync in pending:
            sync.warned_mean_loss = True
        kind = next((entry[0] for entry in row if entry[0] is not None), None)
    if not pending:
        return
    warnings.warn(
        f"the loss passed to backward is this replica's mean ({kind}), but a mirrored "
        f"module sums its gradients over the {n} replicas in sync (TF's rule, "
        f"gradient_reduction='sum'): each step is {n} times plain torch's on the same "
        "global batch. Scale the loss by the global batch instead, "
        "crossdevice.torch.compute_average_loss(per_example_loss, global_batch_size=B), "
        "or prepare(..., gradient_reduction='mean') for DDP's rule. (Given once per model.)",
        UserWarning,
        stacklevel=4,
    )


#: A strategy's looked-at passes: per local replica, its number of posts; per pass
#: (counted so), each replica's (local mean found, what its loss summed over, its models).
_BOARDS: weakref.WeakKeyDictionary[Any, tuple[list[int], dict[int, dict[int, Any]]]] = (
    weakref.WeakKeyDictionary()
)
#: Passes kept waiting for a replica that does not post (it skipped a backward).
_KEPT_PASSES: Final = 8


def _posted(strategy: Any, replica: int, replicas: int, entry: Any) -> list[Any] | None:
    """Post `replica`'s entry for its pass; all the pass's entries once the last is in.

    Called under `_WARNED_LOCK`. The local replicas look at the same passes of a step
    (their pass counts advance together), so the n-th post of each is the same step's.
    """
    counts, rows = _BOARDS.setdefault(strategy, ([0] * replicas, {}))
    if len(counts) != replicas:  # the strategy's replicas changed: start over
        counts[:] = [0] * replicas
        rows.clear()
    index = counts[replica]
    counts[replica] += 1
    row = rows.setdefault(index, {})
    row[replica] = entry
    for old in [k for k in rows if k < index - _KEPT_PASSES]:
        del rows[old]
    if len(row) < replicas:
        return None
    del rows[index]
    return list(row.values())


def _judged(row: list[Any]) -> list[GradientSync]:
    """The models of the pass's replicas whose local mean is not the step's global mean.

    A replica's mean over its batch is the global batch's mean when it holds every local
    example (its counts are the sum of all replicas'): the others had empty slices; and
    a replica with an empty slice adds no gradient, whatever its loss divides by. With
    another worker's replicas holding the rest, that step stays silent (a later one warns).
    Where some replica's counts are unreadable, a local mean warns, as it always did.
    """
    all_counts = [entry[1] for entry in row]
    total = None
    if all(all_counts) and len({len(c) for c in all_counts}) == 1:
        total = tuple(sum(column) for column in zip(*all_counts, strict=True))
    found: list[GradientSync] = []
    for kind, counts, suspects in row:
        if kind is None or counts[:1] == (0,) or (total is not None and counts == total):
            continue  # an empty batch: no gradient, whatever it is divided by
        found += [s for ref in suspects if (s := ref()) is not None and s not in found]
    return found


def _loss_counts(node: Any, depth: int = 0) -> tuple[int, ...]:
    """What the loss at `node` summed or averaged over: (first size, terms); () if unknown.

    Followed as `_local_mean` follows a loss: through sums of terms, negation and
    constant factors, to the first sum or mean (the first term's, in a sum of terms).
    """
    if node is None or depth > _DEPTH:
        return ()
    name = type(node).__name__
    if name.startswith("Mean"):
        sizes = tuple(getattr(node, "_saved_self_sym_sizes", ()))
        return (sizes[0], math.prod(sizes)) if sizes else ()
    counts = _summed_counts(node, _MEAN_REDUCTION) or _summed_counts(node)
    if counts or not (name in _THROUGH or name == "NegBackward0" or name in _SCALE):
        return counts
    for child, _ in node.next_functions:
        found = _loss_counts(child, depth + 1)
        if found:
            return found
    return ()


def _in_graph(roots: list[Any], syncs: list[GradientSync], replica: int) -> list[GradientSync]:
    """The `syncs` whose parameters (`replica`'s) the graph of `roots` accumulates into.

    Walks the whole graph, so only once a local mean was found (a warning is due).
    """
    owner = {id(p): s for s in syncs for p in s.params(replica)}
    found: list[GradientSync] = []
    seen: set[Any] = set()  # the node objects themselves: held, their ids stay theirs
    stack = [getattr(root, "grad_fn", None) for root in roots]
    while stack and len(found) < len(syncs):
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        sync = owner.get(id(getattr(node, "variable", None)))
        if sync is not None and sync not in found:
            found.append(sync)
        stack.extend(child for child, _ in node.next_functions)
    return [s for s in syncs if s in found]


def _local_mean(
    node: Any, factor: float | None, replicas: int, depth: int = 0
) -> tuple[str, float | None] | None:
    """What makes `node`'s output a local mean, and the constant factor applied to it.

    A mean-reduced loss, `.mean()`, or a sum divided by the number of terms it summed
    or by the summed tensor's first size (`loss.sum() / len(x)`, `cross_entropy(o, y,
    reduction="sum") / len(o)`, `mse_loss(o, t, reduction="sum") / o.numel()`), seen
    through sums of terms, negation and multiplication or division by a constant; the
    factor is None where a constant is unreadable (on an accelerator: reading it would
    wait for the device). A divisor that is also the global batch (the first size times
    `replicas`) is the SUM rule's, whatever else it equals: `o.sum() / global_batch`
    where `o` has as many columns as there are replicas.
    """
    if node is None or depth > _DEPTH:
        return None
    name = type(node).__name__
    if name.startswith("Mean"):
        return "Tensor.mean", factor
    if getattr(node, "_saved_reduction", None) == _MEAN_REDUCTION:
        return f"{name.removesuffix('Backward0')} with reduction='mean'", factor
    if name in _THROUGH:
        for child, _ in node.next_functions:
            found = _local_mean(child, factor, replicas, depth + 1)
            if found:
                return found
        return None
    if name == "NegBackward0":
        return _local_mean(node.next_functions[0][0], factor, replicas, depth + 1)
    power = _SCALE.get(name)
    if power is None:
        return None
    (left, _), (right, _) = node.next_functions
    if right is None and left is not None:  # x * c, x / c
        child, constant = left, _constant(node, "_saved_other")
    elif left is None and right is not None and power == 1:  # c * x
        child, constant = right, _constant(node, "_saved_self")
    else:
        return None  # both differentiable (a learned weight), or a constant over x
    scaled = None if factor is None or constant is None else factor * constant**power
    if power == -1 and constant is not None:
        counts = _summed_counts(child)
        if counts and constant in counts and constant != counts[0] * replicas:
            return f"a sum divided by this replica's batch, {constant:g}", factor
    return _local_mean(child, scaled, replicas, depth + 1)


def _summed_counts(node: Any, reduction: int = _SUM_REDUCTION) -> tuple[int, ...]:
    """What `node` summed over: (its first size, its number of terms); else ().

    `x.sum()`: the summed tensor's first size and element count. A loss with
    reduction='sum': its input's first size and its number of terms, which for
    `nll_loss` (`cross_entropy`) is one per example and position, not per class: its
    input holds log-probabilities, (batch, classes, ...).
    """
    name = type(node).__name__
    if name == "SumBackward0" and reduction == _SUM_REDUCTION:
        sizes = tuple(getattr(node, "_saved_self_sym_sizes", ()))
        return (sizes[0], math.prod(sizes)) if sizes else ()
    if getattr(node, "_saved_reduction", None) != reduction:
        return ()
    try:
        sizes = tuple(node._saved_self.shape)
    except (AttributeError, RuntimeError):  # none saved, or freed by an earlier backward
        return ()
    if not sizes:
        return ()
    if name.startswith("NllLoss"):  # (classes,) alone: one term
        return (sizes[0], math.prod(sizes) // sizes[1]) if len(sizes) > 1 else (1, 1)
    return (sizes[0], math.prod(sizes))


def _constant(node: Any, name: str) -> float | None:
    """The constant operand `name` of a product or quotient, if a host scalar."""
    try:
        value = getattr(node, name)
    except RuntimeError:  # freed by an earlier backward
        return None
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.device.type != "cpu":
        return None
    number = float(value)
    return number if number else None


torch_patches.register(torch_patches.Patch(lambda: torch.autograd, "backward", _wrap))
