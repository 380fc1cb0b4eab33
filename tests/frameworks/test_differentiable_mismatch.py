"""Replicas whose differentiable collectives disagree get an error, never a combined sum.

An all-reduce of values that require grad goes through autograd, and its backward pass
all-reduces the upstream gradients (TF's rule). Collectives pair by order, so a replica
whose values required grad while another's did not, or a replica running backward
through its all-reduce while another made a plain all-reduce of the same shapes, summed
unrelated values silently (both replicas' results wrong, no error), or, when the
structures differed, got a misleading "different nest structures" error. Each of these
collectives now says what it is for (`_core/purpose.py`): replicas compare it, workers
compare it with the user's line that asked for the forward one.
"""

from __future__ import annotations

from typing import Any

import pytest

import crossdevice as cd
from tests.frameworks.differentiable_workers import mismatched_collective
from tests.frameworks.helpers import mirrored
from tests.multi_worker.harness import run_workers
from tests.strategies.conftest import replica_execution


def _run(torch: Any, n: int, step: Any, mode: str = "threads") -> Any:
    strategy = mirrored(n)
    with replica_execution(mode):
        return strategy.experimental_local_results(strategy.run(step))


@pytest.mark.parametrize("mode", ["threads", "cooperative"])
@pytest.mark.parametrize("nest", ["one", "list"])
@pytest.mark.parametrize("n", [2, 3])
def test_values_requiring_grad_on_one_replica_only_are_an_error(
    torch_module: Any, n: int, nest: str, mode: str
) -> None:
    torch = torch_module
    w = torch.ones(2, dtype=torch.float64, requires_grad=True)

    def step() -> Any:
        ctx = cd.get_replica_context()
        t = w * 2
        if ctx.replica_id_in_sync_group == n - 1:
            t = t.detach()
        return ctx.all_reduce("sum", t if nest == "one" else [t, t * 3])

    with pytest.raises(ValueError, match=r"differentiable collective.*require grad") as info:
        _run(torch, n, step, mode)
    assert f"replica {n - 1}: a collective the step function made" in str(info.value)
    assert "nest structures" not in str(info.value)


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_backward_through_a_collective_never_meets_another_replicas_collective(
    torch_module: Any, collective: str
) -> None:
    torch = torch_module
    w = torch.ones(2, dtype=torch.float64, requires_grad=True)

    def step() -> Any:
        ctx = cd.get_replica_context()
        if collective == "all_reduce":
            out = ctx.all_reduce("sum", [w * 2, w * 3])[0]
        else:
            out = ctx.all_gather(w * 2, 0)
        if ctx.replica_id_in_sync_group == 0:
            out.sum().backward()  # its backward pass all-reduces (2,) or (2,) gradients
            return w.grad
        return ctx.all_reduce("sum", torch.full((2,), 5.0, dtype=torch.float64))

    with pytest.raises(ValueError, match="replica 0: the backward pass of a differentiable"):
        _run(torch, 2, step)


def test_agreeing_differentiable_collectives_still_train(torch_module: Any) -> None:
    torch = torch_module
    w = torch.ones(2, dtype=torch.float64, requires_grad=True)

    def step() -> Any:
        ctx = cd.get_replica_context()
        scale = 1.0 + ctx.replica_id_in_sync_group
        total = ctx.all_reduce("sum", w * scale).sum()
        (grad,) = torch.autograd.grad(total, [w])
        return grad

    # TF's rule: the upstream gradient (1 on each replica) is all-reduced (2), then goes
    # through each replica's own scale (1 + r).
    grads = _run(torch, 2, step)
    assert [g.tolist() for g in grads] == [[2.0, 2.0], [4.0, 4.0]]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("case", "what"),
    [("requires_grad", "a differentiable collective"), ("backward", "the backward pass")],
)
def test_across_workers_it_is_a_mismatch_on_every_worker(
    torch_module: Any, case: str, what: str
) -> None:
    del torch_module
    env = {"CROSSDEVICE_SHARED_MEMORY": "0"}
    results = run_workers(mismatched_collective, 2, args=(case,), env=env, timeout=90)
    for result in results:
        assert result.error_type == "CollectiveMismatchError", result.describe()
        assert what in (result.error_message or ""), result.describe()
        # Both sides name the user's line that asked for the collective, not torch's.
        assert "differentiable_workers.py" in (result.error_message or "")
        assert "function.py" not in (result.error_message or "")
