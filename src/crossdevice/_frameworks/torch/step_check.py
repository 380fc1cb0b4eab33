"""One rendezvous per optimizer step: the replicas agree on the step, or it is an error.

With parameters copied per replica (`share_storage=False`), each replica steps its own
optimizer copy, and nothing else in the step makes the replicas meet: a replica that
skips `step()` (`if torch.isfinite(local_loss): opt.step()`) or `zero_grad()` would
silently drift away from the others. So every local replica's `step()` meets the others
in one `merge_call` round, as the shared-storage step always did. A round costs what a
`merge_call` costs: on 2 host replicas of a loaded 2-core machine, `run` of a step that
only meets took 50-100 us more than an empty `run` on replica threads and about 50 us
more on cooperative replicas (medians of interleaved blocks of 200 runs). What it checks:

* a replica that skipped the step leaves the others waiting in `MirroredOptimizer.step()`:
  the rendezvous' usual error, naming the replica that returned or called something else;
* each replica brings how many times it called `zero_grad()` since its last step (or the
  last cross-replica section: the run's start, a `merge_fn`), the optimizer's or that of
  a prepared module it updates: counts that differ are an error naming each replica's;
* optimizer state that the user changed in cross-replica context (`opt.state.clear()`,
  `st["exp_avg"].zero_()` between runs or in a `merge_fn`, where `opt.state` is replica
  0's) is copied from replica 0 to every other replica before the replicas run again.
  This is the mirrored modules' rule for parameters and buffers (`mirroring.py`,
  `sections`): a fingerprint of replica 0's state (its entries, each tensor's identity and
  `_version`) is taken when a cross-replica section starts and compared when it ends.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from crossdevice._frameworks.torch.agreement import PLAIN
from crossdevice._strategies.base import Strategy
from crossdevice._strategies.context import get_replica_context
from crossdevice._strategies.replica import in_section
from crossdevice._sync.call import CallSignature
from crossdevice._values.values import PerReplica

__all__ = ["StepCheck", "fingerprint"]

_STEP_CALL: Final = CallSignature("MirroredOptimizer.step()")
_TENSOR: Final = torch.Tensor


class StepCheck:
    """What the local replicas' optimizer steps must agree on (see the module doc).

    Args:
        strategy: the strategy of the replicas.
        optimizers: every local replica's optimizer (the same one N times when shared).
        shared: whether the replicas store parameters once (one optimizer, one state).
    """

    def __init__(
        self, strategy: Strategy, optimizers: Sequence[torch.optim.Optimizer], shared: bool
    ) -> None:
        self._optimizers = optimizers
        self._shared = shared
        self._zero_grads = [0] * len(optimizers)
        self._seen = fingerprint(optimizers[0])
        if len(optimizers) > 1:
            strategy.extended._sections.add(self)  # held weakly

    def zeroed(self, replica: int) -> None:
        """Count a `zero_grad()` of `replica` inside `strategy.run`."""
        self._zero_grads[replica] += 1

    def meet(self, strategy: Strategy, replica: int, then: Callable[[], Any] | None = None) -> Any:
        """Meet the other local replicas before `replica` steps; `then()` runs once there.

        Returns:
            What `then` returned (None without it).

        Raises:
            RuntimeError: the replicas called `zero_grad()` different numbers of times since
                their last step, or a replica did not come (the rendezvous' error).
        """
        ctx = get_replica_context()
        assert ctx is not None
        count = self._zero_grads[replica]
        self._zero_grads[replica] = 0

        def merge_fn(strategy: Any, counts: Any) -> Any:
            del strategy
            self._check_zero_grads(counts)
            return None if then is None else then()

        extended = strategy.extended
        if then is not None and extended._sections:
            # `then` changes replica 0's parameters: a cross-replica section, as in any
            # merge_fn (mirrored modules see the change; ReplicaContext.merge_call's rule).
            merge_fn = in_section(merge_fn, extended._sections)
        return extended._merge_call_checked(
            ctx.replica_id_in_sync_group, merge_fn, (count,), _STEP_CALL
        )

    def enter_cross_replica(self) -> None:
        """Remember replica 0's state (the replicas agree on it now); recount zero_grad.

        The counts start afresh with each cross-replica section (a run's end, a merge_fn)
        rather than persist across runs: a run that failed halfway leaves no stale count.
        """
        zero_grads = self._zero_grads
        for r in range(len(zero_grads)):
            zero_grads[r] = 0
        if not self._shared:
            self._seen = fingerprint(self._optimizers[0])

    def leave_cross_replica(self) -> None:
        """Copy replica 0's state to the other replicas if it changed meanwhile."""
        if self._shared:
            return
        first = self._optimizers[0]
        now = fingerprint(first)
        if now == self._seen:
            return
        state = first.state_dict()
        for optimizer in self._optimizers[1:]:
            # load_state_dict puts each tensor where the replica's parameter is.
            optimizer.load_state_dict(copy.deepcopy(state))
        self._seen = fingerprint(first)

    def loaded(self) -> None:
        """Every replica's state was set alike (`load_state_dict`, `add_param_group`)."""
        self._seen = fingerprint(self._optimizers[0])

    def _check_zero_grads(self, counts: Any) -> None:
        values = list(counts.values) if isinstance(counts, PerReplica) else [counts]
        if len(set(values)) > 1:
            each = ", ".join(f"replica {r}: {c}" for r, c in enumerate(values))
            raise RuntimeError(
                "MirroredOptimizer.step(): the replicas called zero_grad() different numbers "
                f"of times since their last step ({each}), so their gradients differ. Every "
                "replica must make the same zero_grad() and step() calls: decide on values "
                "every replica agrees on (reduce a per-replica loss or flag first, "
                "crossdevice.get_replica_context().all_reduce('max', x))"
            )


def fingerprint(optimizer: torch.optim.Optimizer) -> list[Any]:
    """What changes when `optimizer.state` changes.

    Its entries, each tensor's identity and version counter (every in-place write bumps
    it), and plain values.

    About 0.2 us per state tensor (Adam: 3 per parameter), taken twice per run.
    """
    state = optimizer.state
    out: list[Any] = [id(state), len(state)]
    append = out.append
    for entry in state.values():
        append(id(entry))
        if type(entry) is not dict:
            continue
        for name, value in entry.items():
            append(name)
            append(id(value))
            if isinstance(value, _TENSOR):
                append(value._version)
            elif isinstance(value, PLAIN):
                append(value)
    return out
