"""The gradient hooks refuse what they cannot reduce, with errors that say what to do.

`GradientSync._on_grad_ready` runs once per parameter per backward pass; its per-step
case is a short path (issue #26), and these are the gradients that leave it: a parameter
frozen after the pass's layout was made, a second gradient after its bucket was reduced,
and a replica running backward through another replica's copy.
"""

from __future__ import annotations

from typing import Any

import pytest

import crossdevice as cd
from tests.frameworks.helpers import mirrored, mlp
from tests.strategies.conftest import replica_execution

MODES = ["threads", "cooperative"]


def _prepared(torch: Any, cdt: Any, net: Any, **options: Any) -> tuple[Any, Any]:
    strategy = mirrored(2)
    with strategy.scope():
        model, _ = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), **options)
    return strategy, model


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_frozen_between_forward_and_backward_is_refused(
    torch: Any, cdt: Any, mode: str
) -> None:
    with replica_execution(mode):
        strategy, model = _prepared(torch, cdt, mlp(torch))

        def step() -> None:
            loss = model(torch.ones(4, 6)).sum()
            first = next(iter(model.parameters()))
            first.requires_grad_(False)  # after forward: the graph still reaches it
            try:
                loss.backward()
            finally:
                first.requires_grad_(True)

        with pytest.raises(RuntimeError, match=r"'0\.weight' .* did not require grad when"):
            strategy.run(step)


def test_a_second_gradient_after_its_bucket_was_reduced_is_refused(torch: Any, cdt: Any) -> None:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 6)
    # A bucket per parameter: the bucket is reduced before the checkpoint's recomputed
    # pass adds the parameter's second gradient. (Cooperative replicas reduce when the
    # pass ends: the second gradient is simply part of what they reduce.)
    with replica_execution("threads"):
        strategy, model = _prepared(torch, cdt, layer, bucket_cap_bytes=1)

        def step() -> None:
            x = torch.ones(4, 6, requires_grad=True)
            h = checkpoint(model, x, use_reentrant=True)
            model(h).sum().backward()

        with pytest.raises(RuntimeError, match=r"'(weight|bias)' .* second gradient .* reentrant"):
            strategy.run(step)


def test_backward_through_another_replicas_copy_is_refused(torch: Any, cdt: Any) -> None:
    with replica_execution("threads"):
        strategy, model = _prepared(torch, cdt, mlp(torch))
        loss = model.replicas[0](torch.ones(4, 6)).sum()  # replica 0's graph, made outside

        def step() -> None:
            if cd.get_replica_context().replica_id_in_sync_group == 1:
                loss.backward()

        with pytest.raises(RuntimeError, match=r"replica 1 ran backward through replica 0's"):
            strategy.run(step)


def _grad_stat(torch: Any) -> Any:
    """A module keeping an average of its output gradient's norm, from a backward hook."""

    class GradStat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(6, 3)
            self.register_buffer("gnorm", torch.zeros(()))
            self.lin.register_full_backward_hook(self._hook)

        def _hook(self, module: Any, grad_in: Any, grad_out: Any) -> None:
            with torch.no_grad():
                self.gnorm.mul_(0.9).add_(0.1 * grad_out[0].norm())

        def forward(self, x: Any) -> Any:
            return self.lin(x) / (1 + self.gnorm)

    return GradStat()


def test_a_buffer_a_backward_hook_changes_is_not_blamed_on_the_forward(
    torch: Any, cdt: Any
) -> None:
    # Each replica's hook sees its own slice's gradient: the values differ, undeclared.
    # The error named "the forward pass" and told the user to change the buffer outside
    # it, which the hook did.
    strategy, model = _prepared(torch, cdt, _grad_stat(torch))

    def step() -> None:
        replica = cd.get_replica_context().replica_id_in_sync_group
        x = torch.full((4, 6), 1.0 + replica).requires_grad_()
        model(x).sum().backward()

    with pytest.raises(RuntimeError, match=r"outside the mirrored module's forward \(a backward"):
        strategy.run(step)
