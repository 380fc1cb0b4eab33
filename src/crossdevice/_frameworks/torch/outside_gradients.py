"""Gradients changed on replica 0 outside `strategy.run` reach every replica's `.grad`.

A program may run the backward pass in one `run`, change the reduced gradients outside
`run` (`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`, `p.grad.mul_(0.5)`,
`p.grad = None`) and step in the next `run`. Outside `run` a mirrored module reads as
replica 0's copy, so only replica 0's gradients changed: with a copy per replica
(`share_storage=False`, every GPU layout) the other replicas stepped with the
unclipped ones and the copies drifted apart, silently (the bug hunt of session 55).

`GradientMirror` records replica 0's gradients (object and version counter) when
cross-replica code starts (a run or a `merge_fn` ended) and, when it ends (the next run
starts), gives every other replica what changed, bitwise, as `call_once` does
(`once_gradients`):

* changed in place: copied into the replica's own `.grad` (nothing to copy where it
  views the same memory, as with shared storage);
* set to None: None on every replica (the step skips it, as in plain torch);
* replaced or given where there was none (`p.grad = p.grad * 2`): left alone; the step
  refuses a gradient that backward did not reduce (`step_check`), as inside `run`.

Writes through `.data` bump no version counter and go unseen, as everywhere in the
mirror. Cost: reading replica 0's gradients and their counters at each end of the
cross-replica code, about 10 us per 100 parameters; the references are dropped when
the run starts, so memory freed outside `run` (`p.grad = None`) is freed then.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from crossdevice._frameworks.torch.once_gradients import _take

__all__ = ["GradientMirror"]


class GradientMirror:
    """Replica 0's gradients when cross-replica code starts; `follow()` when it ends.

    Args:
        params: every local replica's parameters, in one order (two replicas or more).
    """

    def __init__(self, params: Sequence[Sequence[torch.nn.Parameter]]) -> None:
        self._params = params
        self._grads: list[torch.Tensor | None] = []
        self._versions: list[int] = []

    def record(self) -> None:
        """Remember replica 0's gradients (the replicas agree on them now)."""
        grads = [p.grad for p in self._params[0]]
        self._grads = grads
        self._versions = [-1 if g is None else g._version for g in grads]

    def follow(self) -> None:
        """Give every replica replica 0's gradients where cross-replica code changed them."""
        grads, versions = self._grads, self._versions
        self._grads, self._versions = [], []
        if not grads:
            return
        for k, param in enumerate(self._params[0]):
            grad, old = param.grad, grads[k]
            if grad is not old:
                if grad is None:
                    for params in self._params[1:]:
                        params[k].grad = None
                continue  # replaced: the step refuses it (`step_check`)
            if grad is None or grad._version == versions[k]:
                continue
            for params in self._params[1:]:
                _take(params[k], grad)
