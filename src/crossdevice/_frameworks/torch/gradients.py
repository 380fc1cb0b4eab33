"""All-reduce a mirrored module's gradients as backward produces them.

Each replica's trainable parameters are split into buckets of about `bucket_cap_bytes`,
in reverse registration order (roughly the order backward produces gradients, as in
DDP's reducer). A hook on each parameter (`register_post_accumulate_grad_hook`) counts
the gradients ready in its bucket; when the next bucket in order is complete the replica
issues its all-reduce (`buckets.py`: `ReplicaContext.all_reduce`'s collective, or across
workers with one replica each a flat buffer reduced where it lies, `.grad` views into
it), one call per bucket, so the replicas' values are added in replica order and every
replica gets bitwise the same gradients. Buckets are issued strictly in order on every
replica, so replicas whose backward passes visit parameters in different orders still
meet in the same collectives. What is left when the outermost backward pass returns
(parameters that got no gradient) is issued then (`backward.py` tracks the passes); a
parameter that no replica used keeps what it had, as in a single-replica run.

Across workers a bucket's all-reduce stays in flight while backward computes the next
buckets; the outermost backward pass waits for all of them, in order, before it returns
(so `.grad` is complete after `loss.backward()`, as with DDP, and an error of any
collective, a mismatch between workers included, is raised by that `backward()`).
Between replicas of one process a reduction completes when it is issued, and `.grad`
is set at once (with shared storage a replica's local bucket goes as soon as it is
reduced).

What is reduced is the gradient not reduced yet, never the whole `.grad`: when a pass
starts, a gradient that an earlier reduction produced (the agreed part) is taken out of
`.grad` and added back to the reduced result. So any number of `backward()` calls per
step, with or without `no_sync()`, gives plain torch's accumulated gradient under SUM
and MEAN alike. (DDP reduces the accumulated `.grad`; under its MEAN rule an agreed part
averages to itself, under TF's SUM rule it would be counted once per replica.)

The buckets follow `requires_grad`: each pass uses the layout of the parameters that
require grad when it starts, so freezing or unfreezing a layer between steps changes
what is reduced on every replica alike (the torch layer gives every replica replica 0's
flags before a step, `module.py`).

Cooperative replicas take turns on one thread, and torch's autograd engine keeps
per-thread state: a replica that waited inside backward would let another replica's
backward run tasks of the first. There the hooks only count, and the buckets are reduced
when the outermost `backward()` returns, with the same buckets, order and results.

Parameters with sparse gradients (`Embedding(sparse=True)`) are in no bucket: each pass's
are gathered and coalesced when the outermost pass returns, after the buckets (`sparse.py`).
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from crossdevice._core.environment import env_switch
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._frameworks.torch import buckets, owners, pass_reduce, sparse
from crossdevice._frameworks.torch.buckets import FlatPlan
from crossdevice._frameworks.torch.gradient_state import Layout, ReplicaState, make_layout
from crossdevice._frameworks.torch.pass_reduce import PassReduce
from crossdevice._frameworks.torch.storage import own_view
from crossdevice._strategies.context import get_replica_context
from crossdevice._sync import waiting as cooperative

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "SHARED_BUCKET_CAP_BYTES", "GradientSync"]

#: Default bucket size. DDP's default is 25 MiB; in one process the reduction of a bucket
#: is a rendezvous of the replica threads, so fewer, larger buckets cost less. Measured
#: with benchmarks/train_step.py (README, Training a PyTorch model).
DEFAULT_BUCKET_CAP_BYTES: Final = 25 << 20
#: Default bucket size where replicas store parameters once (host replicas): each replica
#: holds its local gradients of the bucket in flight until the bucket is reduced, so the
#: bucket bounds that memory; 8 MiB took the 25M-parameter MLP's peak from 1.09 to
#: 1.04 GB (plain torch 0.85 GB) at no measurable cost (benchmarks/host_memory.py).
SHARED_BUCKET_CAP_BYTES: Final = 8 << 20

_REQUIRES_GRAD: Final = operator.attrgetter("requires_grad")


class GradientSync:
    """Bucketed, in-order gradient all-reduce for the replicas of one mirrored module.

    Args:
        params: `params[i]` is replica `i`'s list of parameters (same order, shapes and
            dtypes on every replica), trainable or not.
        names: each parameter's name, for errors.
        op: how replicas' gradients combine: SUM (TF's rule: scale the loss by the global
            batch) or MEAN (DDP's rule: each replica's mean loss).
        bucket_cap_bytes: the largest bucket, in bytes (a parameter larger than that is
            a bucket of its own).
        replica_index: returns the local replica running now (None outside a replica).
        num_replicas_in_sync: the strategy's replica count (1: nothing to reduce).
        shared: the replicas' parameters share storage: keep one reduced gradient for
            every replica where the strategy can (`.grad` of each replica is its own
            tensor over that one buffer), and refuse an in-place change of it made by
            every replica (it would land on the one buffer once per replica).
    """

    def __init__(
        self,
        params: Sequence[Sequence[torch.nn.Parameter]],
        names: Sequence[str],
        op: ReduceOp,
        bucket_cap_bytes: int,
        replica_index: Callable[[], int | None],
        num_replicas_in_sync: int,
        shared: bool = False,
    ) -> None:
        self._params = [list(p) for p in params]
        self.shared = shared and len(self._params) > 1
        self._names = list(names)
        self._op = op
        self._cap = bucket_cap_bytes
        self._replica_index = replica_index
        self.enabled = num_replicas_in_sync > 1
        self._layouts: dict[tuple[bool, ...], Layout] = {}
        self._sparse = sparse.marked(self._params[0])  # sparse gradients: in no bucket
        self._states = [ReplicaState(len(self._params[0])) for _ in self._params]
        self._no_sync = [0] * len(self._params)
        #: Optimizer steps each replica took on these parameters (compared across workers).
        self.steps = [0] * len(self._params)
        # Hooks per replica and parameter; torch refuses one on a frozen parameter, so a
        # parameter gets its hook when a pass first finds it trainable.
        self._handles: list[list[Any]] = [[None] * len(p) for p in self._params]
        #: The dtype gradients travel in between workers (`prepare(gradient_dtype=)`);
        #: None: their own. Summed in float32 either way.
        self.gradient_dtype: torch.dtype | None = None
        self._flat = True  # try the flat bucket path (`buckets.py`) until a strategy refuses
        # One all-reduce per pass (`pass_reduce.py`): 0 until a pass of ours showed that
        # backward starts no collective of its own once a bucket left (then 1), -1 never.
        self._passes = 0 if env_switch(pass_reduce.ENV, default=True) else -1
        #: The one-time warning about a local mean loss under the SUM rule was given.
        self.warned_mean_loss = False
        #: Each replica's backward passes, for that warning's schedule (`backward`).
        self.mean_loss_passes = [0] * len(self._params)
        if self.enabled:
            for replica in range(len(self._params)):
                self._hook_trainable(replica)
        owners.register(self, self._params)  # for code given parameters by hand

    @property
    def op(self) -> ReduceOp:
        """How the replicas' gradients combine."""
        return self._op

    def params(self, replica: int) -> list[torch.nn.Parameter]:
        """Replica `replica`'s parameters, in the order every replica shares."""
        return self._params[replica]

    def bucket_sizes(self) -> list[int]:
        """The number of parameters in each bucket, in reduction order (replica 0's flags)."""
        return [len(b) for b in self._layout(0).buckets]

    def no_sync(self, replica: int) -> _NoSync:
        """Context manager: backward passes inside only accumulate local gradients."""
        return _NoSync(self, replica)

    def _hook_trainable(self, replica: int) -> None:
        handles = self._handles[replica]
        for index, param in enumerate(self._params[replica]):
            if handles[index] is None and param.requires_grad:
                handles[index] = param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    self._hook(replica, index)
                )

    # --- layouts --------------------------------------------------------------------------
    def _layout(self, replica: int) -> Layout:
        params = self._params[replica]
        mask = tuple(map(_REQUIRES_GRAD, params))  # no Python frame per parameter
        layout = self._layouts.get(mask)
        if layout is None:
            layout = self._layouts[mask] = make_layout(params, mask, self._cap, self._sparse)
        if self.enabled and layout is not self._states[replica].layout:
            self._hook_trainable(replica)  # a parameter unfrozen since the last pass
        return layout

    # --- passes (called by backward.py on the replica's thread) ----------------------------
    def begin_pass(self, replica: int) -> None:
        """The replica's outermost backward pass starts: take agreed parts out of `.grad`."""
        state = self._states[replica]
        layout = self._layout(replica)
        state.layout = layout
        state.ready = [0] * len(layout.buckets)
        state.seen = [False] * len(state.seen)
        state.next_bucket = 0
        state.hooked = False
        state.held = None
        state.deferred = cooperative.in_cooperative_replica()
        state.in_pass = True
        params = self._params[replica]
        for index, synced in enumerate(state.synced):
            if synced:
                state.synced[index] = False
                grad = params[index].grad
                if grad is not None:
                    state.base[index] = grad
                    params[index].grad = None

    def flush_pass(self, replica: int) -> None:
        """The outermost pass returned: what is left goes (`end_pass` then waits for it).

        Every module's before any waits: a pass's one all-reduce (`pass_reduce.py`) waits
        on the queue for its last buckets, and another module's may be queued behind it.
        """
        state = self._states[replica]
        if state.hooked and not self._no_sync[replica]:
            self._reduce_ready(replica, final=True)
        if state.held is not None:  # a pass watched from its first bucket on
            held, state.held = state.held, None
            if self._passes == 0:
                self._passes = 1 if pass_reduce.started_here(get_replica_context()) == held else -1

    def end_pass(self, replica: int) -> None:
        """The outermost pass returned: reduce what is left, restore untouched parts."""
        state = self._states[replica]
        try:
            if state.hooked and not self._no_sync[replica]:
                self._reduce_ready(replica, final=True)
                self._finish(replica)
                if state.layout is not None and state.layout.sparse:
                    self._reduce_sparse(replica, state.layout.sparse)
        except BaseException as err:
            self.abort_pass(replica, err)
            raise
        finally:
            state.pending, state.passing = [], None
            state.in_pass = False
            self._restore_bases(replica)

    def abort_pass(self, replica: int, error: BaseException) -> None:
        """The pass raised `error`: leave the state clean for the next step."""
        state = self._states[replica]
        if not state.in_pass:
            return  # ended already
        state.in_pass = False
        # Buckets issued before the error are left unread: the step's error reaches the
        # strategy, which tells the other workers (their collectives end with it); the
        # pass's all-reduce, waiting for buckets that will not come, ends with it.
        if state.passing is not None:
            state.passing.abandon(error)
        state.pending, state.passing, state.held = [], None, None
        self._restore_bases(replica)

    def _restore_bases(self, replica: int) -> None:
        state = self._states[replica]
        if self._no_sync[replica]:
            # Still accumulating locally: the agreed part is added by the next reduction.
            return
        params = self._params[replica]
        for index, base in enumerate(state.base):
            if base is not None and params[index].grad is None:
                params[index].grad = base  # nothing new arrived: it stays as it was
                state.base[index] = None
                state.synced[index] = True

    # --- hooks ----------------------------------------------------------------------------
    def _hook(self, replica: int, index: int) -> Callable[[torch.Tensor], None]:
        # A partial, not a closure: one Python frame per gradient, not two.
        if index in self._sparse:
            return functools.partial(self._on_sparse_grad, replica, index)
        return functools.partial(self._on_grad_ready, replica, index)

    def _on_grad_ready(self, replica: int, index: int, param: Any = None) -> None:
        state = self._states[replica]
        current = self._replica_index()
        if current != replica or not state.in_pass or self._no_sync[replica]:
            self._unusual_gradient(state, replica, index, current)
            return
        # The per-gradient case: this replica's own pass, reducing.
        state.touched[index] = True
        layout = state.layout
        assert layout is not None
        bucket = layout.bucket_of[index]
        if bucket < state.next_bucket:  # frozen (-1), or its bucket was reduced already
            self._refuse_late_gradient(index, bucket)
        state.hooked = True
        if not state.seen[index]:
            state.seen[index] = True
            state.ready[bucket] += 1
        if not state.deferred:
            # `_reduce_ready`'s own first test, here: most gradients complete no bucket.
            b = state.next_bucket
            sizes = layout.sizes
            if b < len(sizes) and state.ready[b] >= sizes[b]:
                self._reduce_ready(replica, final=False)

    def _on_sparse_grad(self, replica: int, index: int, param: Any = None) -> None:
        """A sparse gradient: counted (`_unusual_gradient`); the pass's end reduces it."""
        self._unusual_gradient(self._states[replica], replica, index, self._replica_index())

    def _unusual_gradient(
        self, state: ReplicaState, replica: int, index: int, current: int | None
    ) -> None:
        """A gradient outside this replica's own reducing pass: refused, or only counted."""
        if current is not None and current != replica:
            raise RuntimeError(
                f"replica {current} ran backward through replica {replica}'s copy of a "
                "mirrored module; inside strategy.run call the mirrored module itself "
                "(it picks the running replica's copy), not a copy taken from it"
            )
        state.touched[index] = True
        if not state.in_pass:
            if current is None:
                # backward outside `strategy.run`: there are no peers to meet. The
                # gradient stays local, and MirroredOptimizer.step() refuses it.
                state.synced[index] = False
                return
            raise RuntimeError(
                f"a backward pass reached parameter {self._names[index]!r} of a mirrored "
                "module without going through torch.autograd.backward (loss.backward() "
                "does), so its gradients cannot be reduced; call loss.backward() or "
                "torch.autograd.backward inside strategy.run"
            )
        if self._no_sync[replica]:
            return  # accumulate only; the next backward outside no_sync reduces it
        # In a pass, but not on the replica's own thread (None: outside any replica), or
        # a sparse gradient: counted; the pass's end reduces it.
        assert state.layout is not None
        if index in state.layout.sparse:
            state.hooked = True
            return
        bucket = state.layout.bucket_of[index]
        if bucket < state.next_bucket:
            self._refuse_late_gradient(index, bucket)
        state.hooked = True
        if not state.seen[index]:
            state.seen[index] = True
            state.ready[bucket] += 1

    def _refuse_late_gradient(self, index: int, bucket: int) -> None:
        if bucket < 0:
            raise RuntimeError(
                f"parameter {self._names[index]!r} of a mirrored module got a gradient but "
                "did not require grad when this backward pass started; change "
                "requires_grad between steps, not between forward and backward"
            )
        raise RuntimeError(
            f"parameter {self._names[index]!r} of a mirrored module received a second "
            "gradient in one backward pass after its bucket was reduced (a parameter "
            "used both inside and outside a reentrant checkpoint, or overlapping "
            "retain_graph passes); use torch.utils.checkpoint(..., "
            "use_reentrant=False), or accumulate inside model.no_sync()"
        )

    def _reduce_ready(self, replica: int, final: bool) -> None:
        state = self._states[replica]
        assert state.layout is not None
        buckets = state.layout.buckets
        while state.next_bucket < len(buckets):
            b = state.next_bucket
            if not final and state.ready[b] < len(buckets[b]):
                return
            state.next_bucket += 1
            try:
                self._reduce_bucket(replica, b)
            except Exception:
                sparse.refuse_unmarked(self._names, self._params[replica], buckets[b])
                raise

    def _reduce_bucket(self, replica: int, b: int) -> None:
        """Issue bucket `b`'s all-reduce; `_finish` gives the parameters its results."""
        state = self._states[replica]
        assert state.layout is not None
        layout = state.layout
        bucket = layout.buckets[b]
        like = self._members(layout, replica, b)
        grads = [p.grad for p in like]  # only the parts not reduced yet
        passing = state.passing
        if passing is not None:  # a later bucket of the pass's one all-reduce
            parts = layout.flat[(replica, b)].checked_parts(grads, like)
            if parts is None:  # a gradient that needs the graph, in a graph-free pass
                error = RuntimeError(
                    f"gradient bucket {b} cannot join its backward pass's all-reduce: a "
                    "gradient requires grad (create_graph=True in a backward nested in this "
                    "one) or a parameter changed shape since the pass began; run such a "
                    f"backward on its own, or set {pass_reduce.ENV}=0 on every worker"
                )
                passing.abandon(error)
                raise error
            passing.offer(b, parts)
            state.pending.append((bucket, passing.share(b)))
            return
        ctx = get_replica_context()
        assert ctx is not None  # passes only begin inside a replica
        pending = None
        if self._flat and not self.shared:
            # The per-step case: the bucket's plan, still fitting, in one pass (`FlatPlan`).
            plan = layout.flat.get((replica, b))
            parts = plan.checked_parts(grads, like) if plan is not None else None
            if parts is None:
                plan = self._flat_plan(ctx, layout, replica, b, like)
                if plan is not None and not buckets.needs_graph(grads):
                    parts = plan.parts(grads, like)
            if parts is not None:
                assert plan is not None
                wire, steps = self.gradient_dtype, self.steps[replica]
                if self._passes >= 0 and b == 0 and len(layout.buckets) > 1 and wire is None:
                    if self._passes == 1:
                        state.passing = self._issue_pass(ctx, layout, replica, parts)
                        if state.passing is not None:
                            state.pending.append((bucket, state.passing.share(0)))
                            return
                    else:  # watch this pass: does backward start collectives of its own?
                        state.held = pass_reduce.started_here(ctx)
                pending = buckets.issue_flat(ctx, self._op, grads, like, wire, plan, parts, steps)
                self._flat = pending is not None  # the strategy's layout does not change
        if pending is None:
            pending = buckets.issue(ctx, self._op, grads, like, self.shared, self.steps[replica])
        if not state.pending and pending.done():
            # Complete already (replicas of one process): `.grad` now, so the local
            # gradients go as the bucket does (shared storage's memory bound).
            self._assign(replica, bucket, pending.wait())
        else:
            state.pending.append((bucket, pending))

    def _issue_pass(
        self, ctx: Any, layout: Layout, replica: int, parts: list[torch.Tensor]
    ) -> PassReduce | None:
        """The pass's buckets as one all-reduce, bucket 0's `parts` in (`pass_reduce.py`).

        None (nothing issued) where a bucket has no flat plan of bucket 0's dtype, or the
        strategy no such path.
        """
        plans: list[FlatPlan] = []
        for b in range(len(layout.buckets)):
            plan = self._flat_plan(ctx, layout, replica, b, self._members(layout, replica, b))
            if plan is None or (plans and plan.dtype != plans[0].dtype):
                return None
            plans.append(plan)
        kept = layout.passes.get(replica)
        if kept is None or any(a is not b for a, b in zip(kept[0], plans, strict=True)):
            # What the workers compare, one object step after step (the route's key).
            kept = layout.passes[replica] = (plans, tuple(x for p in plans for x in p.leaves))
        passing = pass_reduce.issue(ctx, self._op, *kept, parts, self.steps[replica])
        if passing is None:
            self._passes = -1  # the strategy has no such path: its layout does not change
        return passing

    def _members(self, layout: Layout, replica: int, b: int) -> list[torch.nn.Parameter]:
        """The replica's parameters of bucket `b`, in bucket order."""
        like = layout.members.get((replica, b))
        if like is None:
            like = layout.members[(replica, b)] = [
                self._params[replica][i] for i in layout.buckets[b]
            ]
        return like

    def _flat_plan(
        self, ctx: Any, layout: Layout, replica: int, b: int, like: list[torch.nn.Parameter]
    ) -> FlatPlan | None:
        """Bucket `b`'s flat layout (`buckets.FlatPlan`), or None where it has none.

        Made once per bucket and kept while its parameters keep their shapes and dtype
        (a module cast to another dtype gets new plans).
        """
        plan = layout.flat.get((replica, b))
        if plan is not None and plan.fits(like):
            return plan
        if not hasattr(ctx.strategy.extended, "_replica_reduce_flat_async"):
            self._flat = False  # no strategy of this module's offers the path
            return None
        if not buckets.uniform(like):
            return None  # several dtypes or devices: `ReplicaContext.all_reduce` packs them
        plan = layout.flat[(replica, b)] = FlatPlan(like)
        return plan

    def _reduce_sparse(self, replica: int, indices: Sequence[int]) -> None:
        """Gather and reduce the sparse gradients of `indices`; they become `.grad`."""
        state, params, steps = self._states[replica], self._params[replica], self.steps[replica]
        sparse.reduce_into(state, params, indices, self._op, steps)

    def _finish(self, replica: int) -> None:
        """Wait for the pass's bucket all-reduces, in order; their results become `.grad`."""
        state = self._states[replica]
        pending, state.pending = state.pending, []
        for bucket, reduction in pending:
            self._assign(replica, bucket, reduction.wait())

    def _assign(self, replica: int, bucket: list[int], result: buckets.Reduced) -> None:
        params = self._params[replica]
        state = self._states[replica]
        bases, produced, versions = state.base, state.produced, state.produced_version
        reduced, users, one_buffer = result
        # One read of the flags, not one 0-d tensor and comparison per parameter.
        used = users.tolist()
        for k, index in enumerate(bucket):
            param = params[index]
            base = bases[index]
            if used[k] == 0:
                param.grad = base  # no replica had a gradient: as it was before
                bases[index] = None
                state.synced[index] = base is not None
                continue
            if base is None:
                grad = own_view(reduced[k]) if one_buffer else reduced[k]
            else:
                bases[index] = None
                with torch.no_grad():
                    # The agreed part: out of place where it lies in the replicas' buffer.
                    grad = base + reduced[k] if one_buffer else base.add_(reduced[k])
            param.grad = grad
            produced[index] = weakref.ref(grad)
            versions[index] = grad._version
            state.produced_shared[index] = one_buffer and base is None
            state.synced[index] = True

    # --- the optimizer step ---------------------------------------------------------------
    def check_step(self, replica: int, indices: Sequence[int]) -> list[int]:
        """Parameters among `indices` whose gradient must be reduced before a step.

        Returns those whose `.grad` was set by hand (no backward accumulated into them
        since the last step, e.g. from `torch.func`); the caller reduces them.

        Raises:
            RuntimeError: a gradient that autograd accumulated but nothing reduced
                (`no_sync` without a last backward outside it, a backward outside
                `strategy.run`), or a reduced gradient replaced by another tensor.
        """
        state = self._states[replica]
        params = self._params[replica]
        by_hand = []
        for index in indices:
            grad = params[index].grad
            if grad is None:
                continue
            name = self._names[index]
            if state.synced[index] and grad is state.produced[index]():
                shared = state.produced_shared[index]
                if shared and replica and grad._version != state.produced_version[index]:
                    raise RuntimeError(
                        f"the gradient of {name!r} was changed in place on replica {replica} "
                        "inside strategy.run: the replicas keep one reduced gradient, so "
                        "every replica's change lands on it once per replica. Clip through "
                        "torch.nn.utils (clip_grad_norm_, clip_grad_value_, clip_grads_with_"
                        "norm_: once for all replicas; not a name imported before the first "
                        "run, torch's own function), change it in crossdevice.torch.call_once"
                        "(fn), or prepare the model with share_storage=False"
                    )
                continue
            if state.synced[index] and state.touched[index]:
                raise RuntimeError(
                    f"the gradient of {name!r} was replaced after backward reduced it "
                    "(p.grad = ...): the optimizer cannot tell whether the new tensor is "
                    "the same on every replica. Change gradients in place (clip_grad_norm_, "
                    "p.grad.clamp_(...), p.grad.mul_(...))"
                )
            if state.touched[index]:
                raise RuntimeError(
                    f"the gradient of {name!r} was accumulated by a backward pass that "
                    "never reduced it across replicas (inside model.no_sync() with no "
                    "backward outside it, or a backward outside strategy.run): the step "
                    "would apply this replica's gradient only. Run the step's last "
                    "backward inside strategy.run, outside no_sync()"
                )
            by_hand.append(index)
        return by_hand

    def reduce_by_hand(self, replica: int, indices: Sequence[int]) -> None:
        """All-reduce hand-set gradients (`check_step`) in place of `.grad`."""
        params = self._params[replica]
        state = self._states[replica]
        ctx = get_replica_context()
        assert ctx is not None
        if self._sparse:  # every replica's `indices` are alike: so are these
            self._reduce_sparse(replica, [i for i in indices if i in self._sparse])
            indices = [i for i in indices if i not in self._sparse]
        reduced = ctx.all_reduce(self._op, [params[i].grad for i in indices]) if indices else []
        for index, grad in zip(indices, reduced, strict=True):
            params[index].grad = grad
            state.produced[index] = weakref.ref(grad)
            state.produced_version[index] = grad._version
            state.produced_shared[index] = False
            state.synced[index] = True

    def new_step(self, replica: int, indices: Sequence[int]) -> None:
        """These parameters were stepped or their gradients cleared: a new step starts.

        Gradients zeroed in place since (`zero_grad(set_to_none=False)`, every replica
        alike) count as this sync's own: zeros written once or N times are zeros.
        """
        state = self._states[replica]
        params = self._params[replica]
        for index in indices:
            state.touched[index] = False
            grad = params[index].grad
            if grad is not None and grad is state.produced[index]():
                state.produced_version[index] = grad._version


class _NoSync:
    def __init__(self, sync: GradientSync, replica: int) -> None:
        self._sync = sync
        self._replica = replica

    def __enter__(self) -> None:
        self._sync._no_sync[self._replica] += 1

    def __exit__(self, *exc: object) -> None:
        self._sync._no_sync[self._replica] -= 1
