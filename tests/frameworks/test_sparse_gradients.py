"""Sparse gradients (`Embedding(sparse=True)`, `EmbeddingBag(sparse=True)`) train like torch.

Each replica's sparse gradient is gathered, in replica order, and coalesced: the reduced
gradient is plain torch's on the global batch, every row any replica looked up included
(a row with zero net gradient too: SparseAdam still updates it). Compared with plain
torch on the same global batches in float64 (replicas' parameters and gradients bitwise
equal to each other, within 1e-12 of plain torch) for SGD, Adagrad and SparseAdam with
Adam for the dense layers, on replica threads and cooperative replicas, with shared
storage and with copies, and across 2 workers.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from tests.frameworks.helpers import assert_trains_like, mirrored
from tests.frameworks.sparse_workers import (
    GLOBAL,
    loss_of,
    optimizers_for,
    plain_step,
    plain_training,
    replica_step,
    run_replicas,
    slices,
    sparse_net,
    sparse_training,
)
from tests.multi_worker.harness import run_workers
from tests.strategies.conftest import replica_execution

pytestmark = [
    pytest.mark.usefixtures("float64"),
    # torch's own Adagrad and SparseAdam build sparse tensors that say so, plain torch too.
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled"),
]

MODES = ["threads", "cooperative"]
STORAGE = pytest.mark.parametrize("shared", [False, True], ids=["copies", "shared"])


def _prepare(torch: Any, cdt: Any, strategy: Any, net: Any, kind: str, **options: Any) -> Any:
    with strategy.scope():
        prepared = cdt.prepare(net, *optimizers_for(torch, kind, net), **options)
    return prepared[0], list(prepared[1:])


def _assert_gradients_agree(torch: Any, model: Any) -> None:
    """Every replica's `.grad` is bitwise replica 0's (sparse ones coalesced)."""
    first = [p.grad for p in model.replicas[0].parameters()]
    for replica in model.replicas[1:]:
        for a, b in zip(first, (p.grad for p in replica.parameters()), strict=True):
            assert (a is None) == (b is None)
            if a is None:
                continue
            assert a.is_sparse == b.is_sparse
            if a.is_sparse:
                assert a.is_coalesced()
                assert b.is_coalesced()
                assert torch.equal(a._indices(), b._indices())
                assert torch.equal(a._values(), b._values())
            else:
                assert torch.equal(a, b)


def _train(
    torch: Any,
    cdt: Any,
    kind: str,
    replicas: int,
    mode: str,
    shared: bool,
    data: list[Any] | None = None,
    passes: str = "one",
    zero_in_place: bool = False,
    net: Any = None,
    reduction: str = "sum",
    **options: Any,
) -> None:
    """Train `sparse_net` (or `net`) on `replicas` and in plain torch; compare."""
    net = sparse_net(torch) if net is None else net
    plain = copy.deepcopy(net)
    start = [p.detach().clone() for p in plain.parameters()]
    data = slices(torch, replicas, 4) if data is None else data
    divisor = GLOBAL if reduction == "sum" else GLOBAL // replicas
    with replica_execution(mode):
        strategy = mirrored(replicas)
        options.update(share_storage=shared, gradient_reduction=reduction)
        model, optimizers = _prepare(torch, cdt, strategy, net, kind, **options)

        def step(piece: Any, i: int) -> None:
            set_to_none = not (zero_in_place and i % 2)
            replica_step(torch, model, optimizers, piece, passes, set_to_none, divisor)

        run_replicas(strategy, data, step)
    plain_optimizers = optimizers_for(torch, kind, plain)
    for i, pieces in enumerate(data):
        plain_step(torch, plain, plain_optimizers, pieces, passes, not (zero_in_place and i % 2))
    assert_trains_like(torch, plain, model, start)
    _assert_gradients_agree(torch, model)
    grad = model.replicas[0].emb.weight.grad
    assert grad is not None
    assert grad.is_sparse
    expected = plain.emb.weight.grad.coalesce()
    assert torch.equal(grad._indices(), expected._indices())
    np.testing.assert_allclose(grad._values().numpy(), expected._values().numpy(), atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
@STORAGE
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "sparse_adam"])
def test_a_sparse_embedding_trains_like_torch(
    torch: Any, cdt: Any, kind: str, replicas: int, shared: bool, mode: str
) -> None:
    """A sparse embedding and dense layers: SGD and Adagrad over both (a parameter group
    each), SparseAdam for the embedding with Adam for the dense layers. On 3 replicas
    each dense parameter is a bucket of its own."""
    cap = 64 if replicas == 3 else None
    _train(torch, cdt, kind, replicas, mode, shared, bucket_cap_bytes=cap)


@pytest.mark.parametrize("mode", MODES)
@STORAGE
@pytest.mark.parametrize("passes", ["two", "no_sync"])
@pytest.mark.parametrize("zero_in_place", [False, True], ids=["to_none", "in_place"])
def test_two_backward_passes_per_step(
    torch: Any, cdt: Any, passes: str, zero_in_place: bool, shared: bool, mode: str
) -> None:
    """Two micro-batches per step, both reduced or the first inside `no_sync`: what the
    first reduced is not reduced again (under SUM it would count once per replica);
    odd steps clear the gradients in place (an empty sparse gradient, added to)."""
    _train(
        torch,
        cdt,
        "sparse_adam",
        2,
        mode,
        shared,
        passes=passes,
        zero_in_place=zero_in_place,
        bucket_cap_bytes=64,
    )


@pytest.mark.parametrize("mode", MODES)
@STORAGE
@pytest.mark.parametrize("dense", [True, False], ids=["not_called", "no_rows"])
def test_a_replica_without_lookups(
    torch: Any, cdt: Any, dense: bool, shared: bool, mode: str
) -> None:
    """At step 1 one replica's slice has no ids: with dense layers its pass never calls
    the embedding (no gradient: it contributes nothing), without it looks up no rows (an
    empty gradient)."""
    for replica in (0, 2):
        data = slices(torch, 3, 3, no_lookups=replica)
        net = sparse_net(torch, dense=dense)
        _train(torch, cdt, "sgd" if dense else "sparse_adam", 3, mode, shared, data, net=net)


@pytest.mark.parametrize("mode", MODES)
@STORAGE
def test_gradient_reduction_mean(torch: Any, cdt: Any, shared: bool, mode: str) -> None:
    """Under DDP's rule each replica's loss is its own mean: the sparse sum is divided
    by the replicas in sync, as the dense buckets' is."""
    _train(torch, cdt, "adagrad", 3, mode, shared, reduction="mean")


@STORAGE
@pytest.mark.parametrize("kind", ["sgd", "sparse_adam"])
def test_an_embedding_bag(torch: Any, cdt: Any, kind: str, shared: bool) -> None:
    _train(torch, cdt, kind, 2, "threads", shared, net=sparse_net(torch, bag=True))


def _lookups(torch: Any, cdt: Any, mode: str, shared: bool, batches: list[Any]) -> Any:
    """Train an `Embedding(8, 2, sparse=True)` with SparseAdam on 2 replicas and in plain
    torch; each of `batches` is one (ids, weights) per replica, the loss the weighted
    sum of the rows looked up. Returns the last step's reduced gradient."""
    torch.manual_seed(0)
    net = torch.nn.Embedding(8, 2, sparse=True)
    plain = copy.deepcopy(net)
    start = [p.detach().clone() for p in plain.parameters()]
    with replica_execution(mode):
        strategy = mirrored(2)
        with strategy.scope():
            model, optimizer = cdt.prepare(
                net, torch.optim.SparseAdam(net.parameters(), lr=0.1), share_storage=shared
            )

        def step(piece: Any) -> None:
            ids, weights = piece
            optimizer.zero_grad()
            (model(ids) * weights[:, None]).sum().backward()
            optimizer.step()

        for pieces in batches:
            values = strategy.experimental_distribute_values_from_function(
                lambda ctx, pieces=pieces: pieces[ctx.replica_id_in_sync_group]
            )
            strategy.run(step, args=(values,))
    plain_optimizer = torch.optim.SparseAdam(plain.parameters(), lr=0.1)
    for pieces in batches:
        plain_optimizer.zero_grad()
        sum((plain(ids) * weights[:, None]).sum() for ids, weights in pieces).backward()
        plain_optimizer.step()
    assert_trains_like(torch, plain, model, start)
    _assert_gradients_agree(torch, model)
    return model.replicas[1].weight.grad


@pytest.mark.parametrize("mode", MODES)
@STORAGE
def test_an_index_on_one_replica_only(torch: Any, cdt: Any, shared: bool, mode: str) -> None:
    """Row 5 is looked up by replica 1 only, row 6 by replica 0 only: every replica's
    gradient holds both, with the one replica's value."""
    t = torch.tensor
    batch = [(t([1, 6, 1]), t([1.0, 2.0, 3.0])), (t([5, 1]), t([0.5, -1.0]))]
    grad = _lookups(torch, cdt, mode, shared, [batch, batch])
    assert grad._indices().tolist() == [[1, 5, 6]]
    assert grad._values().tolist() == [[3.0, 3.0], [0.5, 0.5], [2.0, 2.0]]


@pytest.mark.parametrize("mode", MODES)
@STORAGE
def test_a_row_with_zero_net_gradient_is_still_updated(
    torch: Any, cdt: Any, shared: bool, mode: str
) -> None:
    """At step 2 row 3's gradients cancel across the replicas (+1, -1): the reduced
    gradient keeps the row with zeros, as plain torch's does, so SparseAdam moves it on
    its momentum (a sum that dropped the row would leave it where it was)."""
    t = torch.tensor
    first = [(t([3, 0]), t([1.0, 1.0])), (t([3]), t([2.0]))]
    cancelling = [(t([3, 0]), t([1.0, 1.0])), (t([3]), t([-1.0]))]
    grad = _lookups(torch, cdt, mode, shared, [first, cancelling])
    assert grad._indices().tolist() == [[0, 3]]
    assert grad._values().tolist() == [[1.0, 1.0], [0.0, 0.0]]


@STORAGE
def test_a_tied_weight_gets_the_dense_sum(torch: Any, cdt: Any, shared: bool) -> None:
    """A sparse embedding's weight also used densely (tied to the output layer): its
    gradient is dense on every replica, as in plain torch, and the sum is too."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(6, 3, sparse=True)

        def forward(self, ids: Any, x: Any) -> Any:
            return self.emb(ids).sum(1) @ self.emb.weight.T[:, :5] + x[:, :1]

    torch.manual_seed(0)
    net = Tied()
    data = [[(i % 6, x, y) for i, x, y in pieces] for pieces in slices(torch, 2, 3)]
    plain = copy.deepcopy(net)
    start = [p.detach().clone() for p in plain.parameters()]
    strategy = mirrored(2)
    with strategy.scope():
        model, optimizer = cdt.prepare(
            net, torch.optim.SGD(net.parameters(), lr=0.1), share_storage=shared
        )
    run_replicas(strategy, data, lambda piece, i: replica_step(torch, model, [optimizer], piece))
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for pieces in data:
        plain_step(torch, plain, [plain_optimizer], pieces)
    assert_trains_like(torch, plain, model, start)
    _assert_gradients_agree(torch, model)
    assert not model.replicas[0].emb.weight.grad.is_sparse


@pytest.mark.parametrize("mode", MODES)
@STORAGE
def test_a_sparse_gradient_set_by_hand_is_reduced_at_the_step(
    torch: Any, cdt: Any, shared: bool, mode: str
) -> None:
    """`p.grad = g` with no backward in the step (as from `torch.func`): the step gathers
    and reduces it as backward would have."""
    torch.manual_seed(0)
    net = torch.nn.Embedding(5, 2, sparse=True)
    start = net.weight.detach().clone()
    with replica_execution(mode):
        strategy = mirrored(2)
        with strategy.scope():
            model, optimizer = cdt.prepare(
                net, torch.optim.SGD(net.parameters(), lr=1.0), share_storage=shared
            )

        def step() -> None:
            r = cd.get_replica_context().replica_id_in_sync_group
            grad = torch.sparse_coo_tensor([[r, 4]], torch.ones(2, 2) * (r + 1), (5, 2))
            model.weight.grad = grad
            optimizer.step()

        strategy.run(step)
    moved = start - model.replicas[0].weight.detach()
    expected = [[1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0], [3.0, 3.0]]
    np.testing.assert_allclose(moved.numpy(), expected, atol=1e-12)
    _assert_gradients_agree(torch, model)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_sparse_embedding_across_workers(torch: Any, replicas: int) -> None:
    """2 workers x `replicas`: every replica of every worker gathers every other's rows;
    step 1 has a replica without lookups, step 2 two passes (the first in `no_sync`)."""
    steps = 4
    results = [
        r.unwrap() for r in run_workers(sparse_training, 2, args=(replicas, steps), timeout=240)
    ]
    expected = plain_training(torch, 2, replicas, steps)
    first = results[0]["params"][0]
    for result in results:
        for params, grad in zip(result["params"], result["grads"], strict=True):
            for a, b in zip(params, first, strict=True):
                np.testing.assert_array_equal(a, b)  # every replica of every worker
            np.testing.assert_array_equal(grad, results[0]["grads"][0])
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(first, expected, strict=True))
    assert worst <= 1e-12


@STORAGE
def test_a_deep_copy_of_the_model_trains_like_torch(torch: Any, cdt: Any, shared: bool) -> None:
    # A deep copy's parameters are new objects: its sparse ones are noted again (in
    # `MirroredModule._setup`), not sent to a dense bucket.
    net = sparse_net(torch)
    strategy = mirrored(2)
    model, optimizers = _prepare(torch, cdt, strategy, net, "sgd", share_storage=shared)
    duplicate, duplicate_optimizers = copy.deepcopy((model, optimizers))
    plain = copy.deepcopy(net)
    start = [p.detach().clone() for p in plain.parameters()]
    data = slices(torch, 2, 3)
    run_replicas(
        strategy, data, lambda piece, i: replica_step(torch, duplicate, duplicate_optimizers, piece)
    )
    plain_optimizers = optimizers_for(torch, "sgd", plain)
    for pieces in data:
        plain_step(torch, plain, plain_optimizers, pieces)
    assert_trains_like(torch, plain, duplicate, start)
    _assert_gradients_agree(torch, duplicate)


@STORAGE
@pytest.mark.parametrize("mode", MODES)
def test_sparse_gradients_scaled_outside_run_reach_every_replica(
    torch: Any, cdt: Any, shared: bool, mode: str
) -> None:
    # Backward in one run, `p.grad.mul_(0.5)` outside (replica 0's copy), the step in the
    # next: the other replicas follow in place (`once_gradients._take`: sparse tensors
    # have no storage to compare; it raised NotImplementedError).
    net = sparse_net(torch)
    plain = copy.deepcopy(net)
    start = [p.detach().clone() for p in plain.parameters()]
    data = slices(torch, 2, 3)
    with replica_execution(mode):
        strategy = mirrored(2)
        model, optimizers = _prepare(torch, cdt, strategy, net, "sgd", share_storage=shared)

        def backward(piece: Any, i: int) -> None:
            del i
            optimizers[0].zero_grad()
            loss_of(torch, model, piece).backward()

        for pieces in data:
            run_replicas(strategy, [pieces], backward)
            for param in model.parameters():
                param.grad.mul_(0.5)
            strategy.run(optimizers[0].step)
    plain_optimizers = optimizers_for(torch, "sgd", plain)
    for pieces in data:
        plain_optimizers[0].zero_grad()
        sum(loss_of(torch, plain, p) for p in pieces).backward()
        for param in plain.parameters():
            param.grad.mul_(0.5)
        plain_optimizers[0].step()
    assert_trains_like(torch, plain, model, start)
    # (torch's own in-place `mul_` drops the coalesced flag: compared as they are)
    first, other = (r.emb.weight.grad for r in model.replicas)
    assert torch.equal(first._indices(), other._indices())
    assert torch.equal(first._values(), other._values())


@pytest.mark.parametrize("mode", MODES)
@STORAGE
def test_a_grad_scaler_checks_sparse_gradients(
    torch: Any, cdt: Any, shared: bool, mode: str
) -> None:
    """A prepared GradScaler unscales and checks the sparse gradients too: an inf in the
    embedding's sparse gradient alone, from one replica's slice at step 2, skips that
    step on every replica and halves every scale, as plain torch does with the inf in
    the global batch's; the other steps train alike."""
    replicas, poisoned = 2, 2
    net = sparse_net(torch)
    plain = copy.deepcopy(net)
    start = [p.detach().clone() for p in plain.parameters()]
    data = slices(torch, replicas, 4)
    at = {"step": 0}

    def poison(grad: Any) -> Any:  # on the embedding's gradient, before its reduction
        ctx = cd.get_replica_context()
        first = ctx is None or ctx.replica_id_in_sync_group == 0
        return grad * float("inf") if at["step"] == poisoned and first else grad

    def scaled_step(optimizer: Any, scaler: Any, loss: Any) -> float:
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        return float(scaler.get_scale())

    with replica_execution(mode):
        strategy = mirrored(replicas)
        with strategy.scope():
            sgd = optimizers_for(torch, "sgd", net)[0]
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
            model, optimizer = cdt.prepare(net, sgd, scaler=scaler, share_storage=shared)
        for replica in model.replicas:
            replica.emb.weight.register_hook(poison)
        scales: list[float] = []

        def step(piece: Any, i: int) -> None:
            at["step"] = i
            scales.append(scaled_step(optimizer, scaler, loss_of(torch, model, piece)))

        run_replicas(strategy, data, step)
    plain.emb.weight.register_hook(poison)
    plain_sgd = optimizers_for(torch, "sgd", plain)[0]
    plain_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    plain_scales = []
    for i, pieces in enumerate(data):
        at["step"] = i
        loss = sum(loss_of(torch, plain, p) for p in pieces)
        plain_scales.append(scaled_step(plain_sgd, plain_scaler, loss))
    assert plain_scales == [2.0**10, 2.0**10, 2.0**9, 2.0**9]
    assert scales == [s for s in plain_scales for _ in range(replicas)]
    assert_trains_like(torch, plain, model, start)
