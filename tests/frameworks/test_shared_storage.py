"""Host replicas store the parameters and the optimizer state once.

With every local replica on the CPU, a prepared model's replicas have their own
`Parameter` objects over one storage, and the optimizer steps once per step while the
replicas wait. The results are bitwise those of per-replica copies (share_storage=False),
on threads and on cooperative replicas.
"""

from __future__ import annotations

from typing import Any

import pytest

import crossdevice as cd
from tests.frameworks.helpers import (
    bn_dropout_model,
    global_batches,
    global_loss,
    load_example,
    mirrored,
    mlp,
    replica_batch,
)
from tests.strategies.conftest import replica_execution

MODES = ["threads", "cooperative"]


def _train(torch: Any, cdt: Any, make: Any, data: list[Any], mode: str, shared: bool) -> Any:
    with replica_execution(mode):
        torch.manual_seed(0)
        strategy = mirrored(4)
        with strategy.scope():
            net = make()
            model, optimizer = cdt.prepare(
                net, torch.optim.Adam(net.parameters(), lr=1e-2), share_storage=shared
            )
        batch = len(data[0][1])

        def step(x: Any, y: Any) -> Any:
            optimizer.zero_grad()
            per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            cdt.compute_average_loss(per_example, global_batch_size=batch).backward()
            optimizer.step()

        torch.manual_seed(1)
        for x, y in strategy.experimental_distribute_dataset(data):
            strategy.run(step, args=(x, y))
    assert model.shares_storage is shared
    return model, optimizer


def _images(torch: Any, steps: int, shape: tuple[int, ...]) -> list[Any]:
    generator = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(16, *shape, generator=generator),
            torch.randint(0, 10, (16,), generator=generator),
        )
        for _ in range(steps)
    ]


MODELS = {
    "mlp": (mlp, lambda torch: global_batches(torch, 50)),
    "bn_dropout": (
        bn_dropout_model,
        lambda torch: _images(torch, 50, (1, 8, 8)),
    ),
    "example_cnn": (
        lambda torch: load_example("custom_training_loop").create_model(),
        lambda torch: _images(torch, 50, (1, 8, 8)),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_shared_storage_trains_bitwise_like_per_replica_copies(
    torch: Any, cdt: Any, name: str, mode: str
) -> None:
    make_model, make_data = MODELS[name]
    data = make_data(torch)
    shared, shared_optimizer = _train(torch, cdt, lambda: make_model(torch), data, mode, True)
    copies, _ = _train(torch, cdt, lambda: make_model(torch), data, mode, False)
    for a, b in zip(
        shared.replicas[0].state_dict().values(),
        copies.replicas[0].state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b)
    first = [p.data_ptr() for p in shared.replicas[0].parameters()]
    for replica in shared.replicas[1:]:  # one storage, several Parameter objects
        assert [p.data_ptr() for p in replica.parameters()] == first
        assert all(
            a is not b
            for a, b in zip(replica.parameters(), shared.replicas[0].parameters(), strict=True)
        )
    assert len({id(o) for o in shared_optimizer.replicas}) == 1  # one optimizer, one state


def _sgd_on_two_replicas(torch: Any, cdt: Any) -> tuple[Any, Any, Any, Any]:
    """A prepared MLP and SGD on 2 replicas sharing storage, and one replica's batch."""
    strategy = mirrored(2)
    with strategy.scope():
        net = mlp(torch)
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return strategy, model, optimizer, replica_batch(torch)


@pytest.mark.parametrize("mode", MODES)
def test_an_in_place_write_to_a_shared_parameter_inside_run_is_an_error(
    torch: Any, cdt: Any, mode: str
) -> None:
    with replica_execution(mode):
        strategy, model, optimizer, (x, y) = _sgd_on_two_replicas(torch, cdt)

        def decay_by_hand() -> None:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()
            optimizer.step()
            with torch.no_grad():
                model[0].weight.mul_(0.99)  # every replica would scale the one tensor

        with pytest.raises(
            RuntimeError, match=r"parameter '0\.weight' .* changed in place inside strategy\.run"
        ):
            strategy.run(decay_by_hand)

        def once() -> None:  # the same change, made once for all replicas
            cdt.call_once(lambda: model[0].weight.data.mul_(0.5))

        before = model[0].weight.detach().clone()
        strategy.run(once)
        assert torch.equal(model.replicas[1][0].weight, before * 0.5)


def test_an_optimizer_that_needs_a_closure_keeps_per_replica_copies(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        net = mlp(torch)
        model, _ = cdt.prepare(net, torch.optim.LBFGS(net.parameters()))
        assert not model.shares_storage
        other = mlp(torch)
        with pytest.raises(ValueError, match=r"LBFGS\.step needs a closure.*share_storage=False"):
            cdt.prepare(other, torch.optim.LBFGS(other.parameters()), share_storage=True)
        with pytest.raises(TypeError, match="share_storage must be None, True or False"):
            cdt.prepare(mlp(torch), share_storage="yes")
    assert cd.get_replica_context() is not None


@pytest.mark.parametrize("mode", MODES)
def test_one_reduced_gradient_is_clipped_once_like_plain_torch(
    torch: Any, cdt: Any, mode: str
) -> None:
    from tests.frameworks.helpers import assert_trains_like

    torch.set_default_dtype(torch.float64)
    data = global_batches(torch, 5)
    plain = mlp(torch)
    start = [p.detach().clone() for p in plain.parameters()]
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    for x, y in data:
        opt.zero_grad()
        global_loss(torch, plain, x, y).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        torch.nn.utils.clip_grad_value_(plain.parameters(), 0.01)
        opt.step()
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            net = mlp(torch)
            model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
        norms = []

        def step(x: Any, y: Any) -> Any:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()
            # Every replica clips; the one gradient is clipped once.
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            optimizer.step()
            return norm

        for x, y in strategy.experimental_distribute_dataset(data):
            norms.append(strategy.experimental_local_results(strategy.run(step, args=(x, y))))
            grads = [r[0].weight.grad for r in model.replicas]
            assert len({g.data_ptr() for g in grads}) == 1  # one buffer for every replica
            assert len({id(g) for g in grads}) == 4  # a tensor of its own each
    assert all(len({float(n) for n in each}) == 1 for each in norms)
    assert_trains_like(torch, plain, model, start)


@pytest.mark.parametrize("mode", MODES)
def test_changing_the_one_gradient_on_every_replica_is_an_error(
    torch: Any, cdt: Any, mode: str
) -> None:
    with replica_execution(mode):
        strategy, model, optimizer, (x, y) = _sgd_on_two_replicas(torch, cdt)

        def halve() -> None:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()
            model[0].weight.grad.mul_(0.5)  # lands on the one gradient once per replica
            optimizer.step()

        with pytest.raises(RuntimeError, match=r"gradient of '0\.weight' was changed in place"):
            strategy.run(halve)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [False, True], ids=["copies", "shared"])
def test_two_step_clipping_trains_like_plain_torch(
    torch: Any, cdt: Any, mode: str, shared: bool
) -> None:
    from tests.frameworks.helpers import assert_trains_like

    torch.set_default_dtype(torch.float64)

    def step(model: Any, optimizer: Any, x: Any, y: Any) -> None:
        optimizer.zero_grad()
        global_loss(torch, model, x, y).backward()
        params = list(model.parameters())  # torch's two-step API: the norm, then the clip
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(params, 0.05, norm)
        optimizer.step()

    data = global_batches(torch, 4)
    plain = mlp(torch)
    start = [p.detach().clone() for p in plain.parameters()]
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    for x, y in data:
        step(plain, plain_optimizer, x, y)
    with replica_execution(mode):
        strategy = mirrored(2)
        with strategy.scope():
            net = mlp(torch)
            prepared = cdt.prepare(
                net, torch.optim.SGD(net.parameters(), lr=0.5), share_storage=shared
            )
        for x, y in strategy.experimental_distribute_dataset(data):
            strategy.run(step, args=(*prepared, x, y))
    assert_trains_like(torch, plain, prepared[0], start)


def _clipped_by_hand_trains_like_plain_torch(
    torch: Any, cdt: Any, mode: str, shared: bool, clip: Any
) -> None:
    """SGD with momentum, `clip(params)` after backward over `params`, the parameters of
    the model taken before `prepare` (replica 0's); equals plain torch's on 4 replicas."""
    from tests.frameworks.helpers import assert_trains_like

    torch.set_default_dtype(torch.float64)
    data = global_batches(torch, 6)

    def step(model: Any, optimizer: Any, params: list[Any], x: Any, y: Any) -> None:
        optimizer.zero_grad()
        global_loss(torch, model, x, y).backward()
        clip(params)
        optimizer.step()

    plain = mlp(torch)
    start = [p.detach().clone() for p in plain.parameters()]
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
    for x, y in data:
        step(plain, plain_optimizer, list(plain.parameters()), x, y)
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            net = mlp(torch)
            params = list(net.parameters())  # the original's: replica 0's
            sgd = torch.optim.SGD(params, lr=0.5, momentum=0.9)
            model, optimizer = cdt.prepare(net, sgd, share_storage=shared)
        for x, y in strategy.experimental_distribute_dataset(data):
            strategy.run(step, args=(model, optimizer, params, x, y))
    assert_trains_like(torch, plain, model, start)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [False, True], ids=["copies", "shared"])
def test_clipping_parameters_taken_before_prepare_trains_like_plain_torch(
    torch: Any, cdt: Any, mode: str, shared: bool
) -> None:
    """`params = list(net.parameters())` before `prepare` are replica 0's: with a copy per
    replica, every replica clipped replica 0's gradients (4 times) and left its own
    unclipped, the replicas 0.5 apart after 6 steps (bug hunt). Each now clips its own."""
    _clipped_by_hand_trains_like_plain_torch(
        torch, cdt, mode, shared, lambda params: torch.nn.utils.clip_grad_norm_(params, 0.05)
    )


@pytest.mark.parametrize("mode", MODES)
def test_total_norm_of_gradients_taken_before_prepare_trains_like_plain_torch(
    torch: Any, cdt: Any, mode: str
) -> None:
    """Torch's two-step clipping over parameters taken before `prepare`, with a copy per
    replica: `get_total_norm([p.grad for p in params])` read replica 0's gradients on
    every replica, so a replica later than replica 0 (cooperative turns; here a sleep)
    took the norm of gradients replica 0 had clipped already, and did not clip its own
    (the bug hunt of session 53). Each now reads its own copy's gradients."""
    import time

    def clip(params: list[Any]) -> None:
        ctx = cd.get_replica_context()
        if ctx is not None and ctx.replica_id_in_sync_group > 0:
            time.sleep(0.02)  # replica 0 clips first
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, 0.05, norm)

    _clipped_by_hand_trains_like_plain_torch(torch, cdt, mode, False, clip)
