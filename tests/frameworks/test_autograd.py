"""Differentiable collectives (TF's gradient rules) and SyncBatchNorm.

`torch.autograd.gradcheck` runs inside every replica in lockstep: one replica at a time
is "under test" with its input reaching the collective; the others feed a constant
that depends on their gradcheck input only through `0 * x` and scale their output by
0, so they join every forward and backward collective without perturbing the tested
replica's numbers or adding to its gradient.
"""

from __future__ import annotations

from typing import Any

import pytest

import crossdevice as cd
from tests.frameworks.helpers import mirrored
from tests.strategies.conftest import replica_execution


def _gradcheck_each_replica(torch: Any, n: int, collective: Any) -> list[bool]:
    strategy = mirrored(n)

    def step() -> Any:
        ctx = cd.get_replica_context()
        replica = ctx.replica_id_in_sync_group
        generator = torch.Generator().manual_seed(replica)
        results = []
        for tested in range(n):
            x = torch.randn(2, 3, dtype=torch.float64, generator=generator, requires_grad=True)
            if replica == tested:

                def fn(t: Any) -> Any:
                    return collective(ctx, t)
            else:
                constant = torch.randn(2, 3, dtype=torch.float64, generator=generator)

                def fn(t: Any, c: Any = constant) -> Any:
                    return collective(ctx, c + 0 * t) * 0

            results.append(torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-7))
        return results

    with replica_execution("threads"):
        return [ok for r in strategy.experimental_local_results(strategy.run(step)) for ok in r]


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("n", [2, 3])
def test_all_reduce_gradcheck(torch_module: Any, op: str, n: int) -> None:
    oks = _gradcheck_each_replica(torch_module, n, lambda ctx, t: ctx.all_reduce(op, t))
    assert all(oks)
    assert len(oks) == n * n


@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather_gradcheck(torch_module: Any, axis: int) -> None:
    oks = _gradcheck_each_replica(torch_module, 3, lambda ctx, t: ctx.all_gather(t, axis))
    assert all(oks)


def test_all_reduce_gradient_is_the_all_reduce_of_gradients(torch_module: Any) -> None:
    torch = torch_module
    strategy = mirrored(3)

    def step() -> Any:
        ctx = cd.get_replica_context()
        r = ctx.replica_id_in_sync_group
        x = torch.ones(2, requires_grad=True)
        (y,) = ctx.all_reduce("sum", [x * (r + 1)])  # y = 6 * 1 on every replica
        (y * (r + 1)).sum().backward()  # upstream gradient r + 1
        return x.grad, y.requires_grad

    with replica_execution("threads"):
        out = strategy.experimental_local_results(strategy.run(step))
    for r, (grad, requires_grad) in enumerate(out):
        assert requires_grad
        # d/dx_r sum_j (j+1) * sum_k (k+1) x_k = (r+1) * (1+2+3)
        torch.testing.assert_close(grad, torch.full((2,), 6.0 * (r + 1)))


def test_all_gather_of_uneven_parts_slices_the_gradient(torch_module: Any) -> None:
    torch = torch_module
    strategy = mirrored(2)

    def step() -> Any:
        ctx = cd.get_replica_context()
        r = ctx.replica_id_in_sync_group
        x = torch.ones(r + 1, requires_grad=True)  # parts of size 1 and 2
        gathered = ctx.all_gather(x, 0)
        (gathered * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        return x.grad

    with replica_execution("threads"):
        first, second = strategy.experimental_local_results(strategy.run(step))
    torch.testing.assert_close(first, torch.tensor([2.0]))  # both replicas' upstream 1
    torch.testing.assert_close(second, torch.tensor([4.0, 6.0]))


def test_cooperative_backward_through_a_collective_is_refused(torch_module: Any) -> None:
    torch = torch_module
    with replica_execution("cooperative"):
        strategy = mirrored(2)

        def step() -> None:
            x = torch.ones(2, requires_grad=True)
            cd.get_replica_context().all_reduce("sum", x).sum().backward()

        with pytest.raises(RuntimeError, match=r"set_replica_execution\('threads'\)"):
            strategy.run(step)
        assert strategy.run(lambda: 1) == 1  # the strategy stays usable


def test_no_grad_collectives_stay_plain(torch_module: Any) -> None:
    torch = torch_module
    strategy = mirrored(2)

    def step() -> Any:
        with torch.no_grad():
            return cd.get_replica_context().all_reduce("sum", torch.ones(2, requires_grad=True))

    out = strategy.experimental_local_results(strategy.run(step))
    assert not out[0].requires_grad


@pytest.mark.parametrize("mode", ["threads", "cooperative"])
def test_sync_batchnorm_equals_one_device_on_the_global_batch(torch_module: Any, mode: str) -> None:
    import crossdevice.torch as cdt

    torch = torch_module
    torch.manual_seed(0)
    x = torch.randn(8, 3, 4, 4, dtype=torch.float64)
    reference = torch.nn.BatchNorm2d(3, momentum=0.5).double()
    with torch.no_grad():
        reference.weight.uniform_()
        reference.bias.uniform_()
    expected = reference(x)
    strategy = mirrored(2)
    with strategy.scope():
        layers = cdt.convert_sync_batchnorm(
            torch.nn.Sequential(torch.nn.BatchNorm2d(3, momentum=0.5).double())
        )
        with torch.no_grad():
            layers[0].weight.copy_(reference.weight)
            layers[0].bias.copy_(reference.bias)
        sync = cdt.MirroredModule(layers)

    def step() -> Any:
        r = cd.get_replica_context().replica_id_in_sync_group
        with torch.no_grad():
            return sync(x[4 * r : 4 * r + 4])

    with replica_execution(mode):
        out = strategy.experimental_local_results(strategy.run(step))
    torch.testing.assert_close(torch.cat(out), expected)
    for replica in sync.replicas:
        assert isinstance(replica[0], cdt.SyncBatchNorm)
        torch.testing.assert_close(replica[0].running_mean, reference.running_mean)
        torch.testing.assert_close(replica[0].running_var, reference.running_var)


def test_sync_batchnorm_gradients_match_one_device(torch_module: Any) -> None:
    import crossdevice.torch as cdt

    torch = torch_module
    torch.manual_seed(1)
    x = torch.randn(6, 2, 3, dtype=torch.float64)
    weights = torch.randn(6, 2, 3, dtype=torch.float64)
    strategy = mirrored(3)
    with strategy.scope():
        model = cdt.MirroredModule(cdt.convert_sync_batchnorm(torch.nn.BatchNorm1d(2).double()))

    def step() -> Any:
        r = cd.get_replica_context().replica_id_in_sync_group
        part = slice(2 * r, 2 * r + 2)
        inputs = x[part].clone().requires_grad_(True)
        model.zero_grad()
        (model(inputs) * weights[part]).sum().backward()
        return inputs.grad, model.module.weight.grad.clone()

    with replica_execution("threads"):
        out = strategy.experimental_local_results(strategy.run(step))
    ref_x = x.clone().requires_grad_(True)
    ref = torch.nn.BatchNorm1d(2).double()
    (ref(ref_x) * weights).sum().backward()
    torch.testing.assert_close(torch.cat([o[0] for o in out]), ref_x.grad)
    for _, weight_grad in out:
        torch.testing.assert_close(weight_grad, ref.weight.grad)
