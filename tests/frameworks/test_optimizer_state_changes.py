"""What `step_check.changes` counts between two fingerprints of an optimizer's state.

Workers compare these counts (`outside_run.py`), so they must depend only on what was
done to the state, never on addresses: every worker doing the same gets the same counts.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest


def _stepped(torch: Any, kind: str = "adam") -> Any:
    """An optimizer over a small model after one step (its state filled)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    if kind == "adam":
        optimizer = torch.optim.Adam(net.parameters())
    else:
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return optimizer


def _counts(torch: Any, edit: Any, kind: str = "adam") -> tuple[int, int, int]:
    from crossdevice._frameworks.torch.step_check import changes, fingerprint

    optimizer = _stepped(torch, kind)
    before = fingerprint(optimizer)
    with torch.no_grad():
        edit(optimizer)
    return changes(before, fingerprint(optimizer))


def test_nothing_done_counts_nothing(torch_module: Any) -> None:
    assert _counts(torch_module, lambda o: None) == (0, 0, 0)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        # Adam: 4 parameters, 3 items each (step, exp_avg, exp_avg_sq)
        (lambda o: o.load_state_dict(copy.deepcopy(o.state_dict())), (0, 12, 12)),
        (lambda o: o.state.clear(), (0, 0, 12)),
        (lambda o: [e["exp_avg"].mul_(0.5) for e in o.state.values()], (4, 0, 0)),
        (lambda o: [e["exp_avg"].mul_(0.5).add_(1) for e in o.state.values()], (8, 0, 0)),
        (lambda o: [e["step"].add_(5) for e in o.state.values()], (4, 0, 0)),
        (lambda o: [e.update(step=5.0) for e in o.state.values()], (0, 4, 0)),
        (lambda o: [e.pop("exp_avg_sq") for e in o.state.values()], (0, 0, 4)),
        (lambda o: o.state.pop(next(iter(o.state))), (0, 0, 3)),
    ],
    ids=["load", "clear", "in_place", "twice_in_place", "step", "plain_step", "pop", "del"],
)
def test_what_was_done_is_counted(torch_module: Any, edit: Any, expected: Any) -> None:
    assert _counts(torch_module, edit) == expected


def test_loading_the_same_checkpoint_counts_alike(torch_module: Any) -> None:
    """Two optimizers in other states (other addresses) load one checkpoint: same counts."""
    torch = torch_module
    from crossdevice._frameworks.torch.step_check import changes, fingerprint

    checkpoint = copy.deepcopy(_stepped(torch, "sgd").state_dict())
    counts = []
    for _ in range(2):
        optimizer = _stepped(torch, "sgd")
        before = fingerprint(optimizer)
        optimizer.load_state_dict(checkpoint)
        counts.append(changes(before, fingerprint(optimizer)))
    assert counts == [(0, 4, 4), (0, 4, 4)]
