"""A run that fails ends with its own exception, and the next run starts from agreed state.

When a run ends, the mirror checks and combines what the replicas changed (buffers a
forward changed, parameters written in place). After a replica raised, those checks saw
a forward cut off between a replica's BatchNorm update and its combining, and raised
their own error "during handling of" the real one: `except ValueError` no longer caught
it, and the message blamed correct code (bug hunt of session 61, across workers). The
library's rule: an exception in one replica reaches the caller as itself.
"""

from __future__ import annotations

from typing import Any

import pytest

import crossdevice as cd
from tests.frameworks.helpers import mirrored
from tests.frameworks.workers import failed_forward
from tests.multi_worker.harness import run_workers
from tests.strategies.conftest import replica_execution

MODES = ["threads", "cooperative"]


def _failing_model(torch: Any, fail: list[bool], raised: list[BaseException]) -> Any:
    """Linear, BatchNorm, a float buffer no aggregation declares, then a layer that raises
    on the last replica while `fail[0]` (after BatchNorm and the buffer changed)."""

    class Peak(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("peak", torch.zeros(()))

        def forward(self, x: Any) -> Any:
            ctx = cd.get_replica_context()
            if fail[0]:
                self.peak.fill_(float(ctx.replica_id_in_sync_group))  # differs per replica
                if ctx.replica_id_in_sync_group == ctx.num_replicas_in_sync - 1:
                    raised.append(ValueError("bad batch on the last replica"))
                    raise raised[-1]
            return x

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), Peak(), torch.nn.Linear(4, 1)
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("replicas", [2, 4])
def test_an_error_in_one_replicas_forward_reaches_the_caller_as_itself(
    torch: Any, cdt: Any, mode: str, replicas: int
) -> None:
    """The last replica raises after its BatchNorm updated and a buffer changed; the
    others wait in the combining of the buffers. The caller gets that ValueError itself,
    and the next run trains with buffers every replica agrees on."""
    fail, raised = [True], []
    with replica_execution(mode):
        strategy = mirrored(replicas)
        with strategy.scope():
            net = _failing_model(torch, fail, raised)
            model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        x = torch.randn(4 * replicas, 3)

        def step(xb: Any) -> None:
            optimizer.zero_grad()
            model(xb).sum().backward()
            optimizer.step()

        (batch,) = strategy.experimental_distribute_dataset([x])
        with pytest.raises(ValueError, match="bad batch on the last replica") as info:
            strategy.run(step, args=(batch,))
        assert info.value is raised[0]
        assert info.value.__context__ is None  # raised during the handling of nothing
        for name in ("1.running_mean", "1.running_var", "2.peak"):
            first = model.replicas[0].get_buffer(name)
            for replica in model.replicas[1:]:
                torch.testing.assert_close(replica.get_buffer(name), first, rtol=0, atol=0)
        fail[0] = False
        strategy.run(step, args=(batch,))
    for name in ("1.running_mean", "1.running_var", "2.peak"):
        first = model.replicas[0].get_buffer(name)
        for replica in model.replicas[1:]:
            torch.testing.assert_close(replica.get_buffer(name), first, rtol=0, atol=0)
    for params in zip(*(r.parameters() for r in model.replicas), strict=True):
        for other in params[1:]:
            torch.testing.assert_close(other, params[0], rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_an_error_before_a_replicas_in_place_write_reaches_the_caller_as_itself(
    torch: Any, cdt: Any, mode: str
) -> None:
    """Every replica scales a weight in place (allowed: alike on every replica), but
    replica 1 raises first. Its ValueError reaches the caller, not the check that the
    replicas wrote the weight unequally; every replica then has replica 0's weight."""
    fail, raised = [True], []
    with replica_execution(mode):
        strategy = mirrored(2)
        with strategy.scope():
            torch.manual_seed(0)
            net = torch.nn.Linear(3, 1)
            model = cdt.prepare(net, share_storage=False)

        def step() -> None:
            replica = cd.get_replica_context().replica_id_in_sync_group
            if fail[0] and replica == 1:
                raised.append(ValueError("replica 1 stops before writing"))
                raise raised[-1]
            with torch.no_grad():
                model.module.weight.mul_(0.5)

        with pytest.raises(ValueError, match="replica 1 stops before writing") as info:
            strategy.run(step)
        assert info.value is raised[0]
        assert info.value.__context__ is None
        first, second = (r.weight for r in model.replicas)
        torch.testing.assert_close(second, first, rtol=0, atol=0)
        fail[0] = False
        strategy.run(step)  # the replicas' writes are counted from agreed values again
    first, second = (r.weight for r in model.replicas)
    torch.testing.assert_close(second, first, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_a_run_inside_an_except_block_is_still_checked(torch: Any, cdt: Any, mode: str) -> None:
    """A run called while the caller handles an exception did not fail itself: the checks
    at its end still raise (here: a weight written in place by replica 0 only, with an
    optimizer step's merge between)."""
    with replica_execution(mode):
        strategy = mirrored(2)
        with strategy.scope():
            torch.manual_seed(0)
            net = torch.nn.Linear(3, 1)
            model, optimizer = cdt.prepare(
                net, torch.optim.SGD(net.parameters(), lr=0.1), share_storage=False
            )

        def step() -> None:
            optimizer.zero_grad()
            model(torch.ones(2, 3)).sum().backward()
            optimizer.step()
            if cd.get_replica_context().replica_id_in_sync_group == 0:
                with torch.no_grad():
                    model.module.weight.mul_(0.5)

        try:
            raise KeyError("handled by the caller")
        except KeyError:
            with pytest.raises(RuntimeError, match="by some replicas only") as info:
                strategy.run(step)
    assert isinstance(info.value.__context__, KeyError)


@pytest.mark.multiprocess
def test_an_error_in_one_workers_replica_reaches_both_workers_as_itself(
    torch_module: Any,
) -> None:
    """Two workers of two replicas each, BatchNorm: worker 1's replica 1 raises at step 1
    while its replica 0 has updated BatchNorm and waits in the combining. Worker 1 raises
    that ValueError, worker 0 the WorkerFailedError naming it; before, both raised a
    RuntimeError blaming "buffers changed outside a forward" (bug hunt of session 61)."""
    del torch_module
    waited, failed = (r.unwrap() for r in run_workers(failed_forward, 2, args=(2,)))
    assert failed["type"] == "ValueError", failed
    assert failed["message"] == "user error in step on worker 1", failed
    assert failed["context"] is None, failed
    assert waited["type"] == "WorkerFailedError", waited
    assert "raised ValueError: user error in step on worker 1" in waited["message"], waited
