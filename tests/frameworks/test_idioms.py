"""Torch idioms around `prepare` train like plain torch, or fail clearly.

Compared with plain torch on the same global batches in float64 (replicas bitwise equal
to each other, within 1e-12 of plain torch), on replica threads and cooperative
replicas: every `torch.optim` optimizer, deep copies and pickles, freezing after
`prepare`, averaged models, unused parameters with zeroed gradients, dropout under
activation checkpointing, `torch.func` gradients, buffer aggregation, and the warning
for a DDP-style mean loss under TF's SUM rule.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest

import crossdevice as cd
from tests.frameworks.helpers import (
    GLOBAL_BATCH,
    assert_mlp_trains_like_plain_torch,
    assert_trains_like,
    fp16_run,
    global_batches,
    global_loss,
    mirrored,
    mlp,
    run_on_replicas,
    standard_step,
    train_plain,
)
from tests.strategies.conftest import replica_execution

MODES = ["threads", "cooperative"]
pytestmark = pytest.mark.usefixtures("float64")


# --- every torch.optim optimizer ----------------------------------------------------------------
OPTIMIZERS: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("SGD", lambda t, p: t.optim.SGD(p, lr=0.2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("Adam", lambda t, p: t.optim.Adam(p, lr=0.05, amsgrad=True)),
    ("AdamW", lambda t, p: t.optim.AdamW(p, lr=0.05, weight_decay=0.1)),
    ("RMSprop", lambda t, p: t.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True)),
    ("Adagrad", lambda t, p: t.optim.Adagrad(p, lr=0.1)),
    ("Adadelta", lambda t, p: t.optim.Adadelta(p, lr=1.0)),
    ("Adamax", lambda t, p: t.optim.Adamax(p, lr=0.05)),
    ("NAdam", lambda t, p: t.optim.NAdam(p, lr=0.05)),
    ("RAdam", lambda t, p: t.optim.RAdam(p, lr=0.05)),
    ("ASGD", lambda t, p: t.optim.ASGD(p, lr=0.1, t0=1)),
    ("Rprop", lambda t, p: t.optim.Rprop(p, lr=0.01)),
    ("LBFGS", lambda t, p: t.optim.LBFGS(p, lr=0.5, max_iter=4, history_size=3)),
]


@pytest.mark.parametrize(
    ("name", "make", "mode"),
    [(name, make, "threads") for name, make in OPTIMIZERS]
    + [(name, make, "cooperative") for name, make in OPTIMIZERS if name in ("AdamW", "LBFGS")],
    ids=[f"{n}-threads" for n, _ in OPTIMIZERS] + ["AdamW-cooperative", "LBFGS-cooperative"],
)
def test_every_optimizer_trains_like_plain_torch(
    torch: Any, cdt: Any, name: str, make: Any, mode: str
) -> None:
    data = global_batches(torch, 4)

    def step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        def closure() -> Any:
            optimizer.zero_grad()
            loss = global_loss(torch, model, x, y)
            loss.backward()
            return loss

        if name == "LBFGS":
            optimizer.step(closure)
        else:
            closure()
            optimizer.step()

    plain = mlp(torch)
    start = train_plain(torch, plain, make(torch, plain.parameters()), data, step)
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            net = mlp(torch)
            model, optimizer = cdt.prepare(net, make(torch, net.parameters()))
        run_on_replicas(strategy, lambda x, y, i: step(model, optimizer, x, y, i), data)
    assert_trains_like(torch, plain, model, start)
    assert type(optimizer.replicas[1]) is type(optimizer.replicas[0])


def test_sparse_gradients_are_gathered_from_every_replica(torch: Any, cdt: Any) -> None:
    """Embedding(sparse=True) trains (test_sparse_gradients.py compares it with torch)."""
    strategy = mirrored(2)
    with strategy.scope():
        net = torch.nn.Embedding(10, 3, sparse=True)
        model, optimizer = cdt.prepare(net, torch.optim.SparseAdam(net.parameters()))
    ids = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([ctx.replica_id_in_sync_group])
    )

    def step(i: Any) -> None:
        optimizer.zero_grad()
        model(i).sum().backward()
        optimizer.step()

    strategy.run(step, args=(ids,))
    for replica in model.replicas:  # each replica looked up its own row: both rows
        assert replica.weight.grad._indices().tolist() == [[0, 1]]


# --- copies: deepcopy, pickle, torch.save ------------------------------------------------------
def test_a_prepared_module_deep_copies_pickles_and_saves(torch: Any, cdt: Any) -> None:
    strategy = mirrored(4)
    with strategy.scope():
        net = mlp(torch)
        model, optimizer = cdt.prepare(net, torch.optim.Adam(net.parameters(), lr=0.1))
    data = global_batches(torch, 2)
    run_on_replicas(strategy, lambda x, y, i: standard_step(torch)(model, optimizer, x, y, i), data)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    duplicate = copy.deepcopy(model)  # a target network, a best-model snapshot
    assert type(duplicate).__name__ == "MirroredModule"
    assert duplicate.strategy is strategy
    for replica in duplicate.replicas:
        for (name, a), b in zip(replica.state_dict().items(), state.values(), strict=True):
            assert torch.equal(a, b), name
            assert a.data_ptr() not in {t.data_ptr() for t in model.state_dict().values()}
    out = strategy.run(lambda: duplicate(torch.ones(2, 6)).sum())
    assert len(strategy.experimental_local_results(out)) == 4

    for blob in (pickle.dumps(model), pickle.dumps(model.module)):
        loaded = pickle.loads(blob)  # a plain torch module: the strategy stays behind
        assert type(loaded) is torch.nn.Sequential
        for a, b in zip(loaded.state_dict().values(), state.values(), strict=True):
            assert torch.equal(a, b)
    for obj in (model, model.module):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert type(loaded) is torch.nn.Sequential
    assert type(copy.deepcopy(model.module)) is torch.nn.Sequential
    copy.deepcopy(optimizer.replicas[1])
    pickle.dumps(optimizer.replicas[1])


# --- changes after prepare reach every replica ------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["wrapper", "original", "inside-run"])
def test_freezing_and_unfreezing_after_prepare_trains_like_plain_torch(
    torch: Any, cdt: Any, mode: str, how: str
) -> None:
    data = global_batches(torch, 6)

    def schedule(model: Any, i: int) -> None:
        if i == 1:
            model[2].requires_grad_(True)  # frozen before prepare
        if i == 2:
            model[0].requires_grad_(False)
        if i == 4:
            model[0].requires_grad_(True)

    plain = mlp(torch)
    plain[2].requires_grad_(False)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)

    def plain_step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        schedule(model, i)
        standard_step(torch)(model, optimizer, x, y, i)

    start = train_plain(torch, plain, optimizer, data, plain_step)
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            net = mlp(torch)
            net[2].requires_grad_(False)
            model, optimizer = cdt.prepare(
                net, torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
            )

        def step(x: Any, y: Any, i: int) -> None:
            if how == "inside-run":
                schedule(model, i)  # every replica changes its own copy alike
            standard_step(torch)(model, optimizer, x, y, i)

        for i, batch in enumerate(strategy.experimental_distribute_dataset(data)):
            if how != "inside-run":
                schedule(model if how == "wrapper" else net, i)  # replica 0's copy only
            strategy.run(step, args=(*batch, i))
            frozen = [p.grad is None for p in model.replicas[0][0].parameters()]
            if i in (2, 3):
                for replica in model.replicas:  # a frozen layer gets no gradient anywhere
                    assert all(p.grad is None for p in replica[0].parameters()), (i, frozen)
    assert_trains_like(torch, plain, model, start)


@pytest.mark.parametrize("mode", MODES)
def test_in_place_initialisation_after_prepare_reaches_every_replica(
    torch: Any, cdt: Any, mode: str
) -> None:
    with replica_execution(mode):
        strategy = mirrored(3)
        with strategy.scope():
            net = mlp(torch)
            model = cdt.prepare(net)
        torch.nn.init.constant_(model[0].weight, 0.25)  # cross-replica: replica 0's copy
        model[2].eval()
        seen = strategy.experimental_local_results(
            strategy.run(lambda: (model[0].weight.detach().sum(), float(model[2].training)))
        )
    for weight_sum, training in seen:
        assert float(weight_sum) == 0.25 * 48
        assert training == 0.0


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
def test_parameter_groups_added_after_prepare_reach_every_replica(
    torch: Any, cdt: Any, shared: bool
) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        net = mlp(torch)
        model, optimizer = cdt.prepare(
            net, torch.optim.SGD(net[0].parameters(), lr=0.1), share_storage=shared
        )
    optimizer.add_param_group({"params": list(model[2].parameters()), "lr": 0.3})
    for replica, replica_optimizer in zip(model.replicas, optimizer.replicas, strict=True):
        owner = model.replicas[0] if shared else replica  # one optimizer over replica 0's
        group = replica_optimizer.param_groups[1]
        assert all(a is b for a, b in zip(group["params"], owner[2].parameters(), strict=True))
        assert group["lr"] == 0.3
    assert len(optimizer.replicas[0].param_groups) == 2  # added once
    with pytest.raises(ValueError, match="belongs to no mirrored module"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})


# --- one step, one update: averaged models ------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_averaged_model_updated_inside_run_updates_once_per_step(
    torch: Any, cdt: Any, mode: str
) -> None:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    data = global_batches(torch, 6)
    plain = mlp(torch)
    plain_ema = AveragedModel(plain, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)

    def plain_step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        standard_step(torch)(model, optimizer, x, y, i)
        plain_ema.update_parameters(model)

    start = train_plain(torch, plain, plain_optimizer, data, plain_step)
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            net = mlp(torch)
            model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
            ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))

        def step(x: Any, y: Any, i: int) -> Any:
            standard_step(torch)(model, optimizer, x, y, i)
            ema.update_parameters(model)  # every replica calls it; it runs once
            return ema(x).sum()  # the averaged model, used on the running replica

        run_on_replicas(strategy, step, data)
    assert int(ema.n_averaged) == len(data)  # not len(data) * 4
    assert_trains_like(torch, plain, model, start)
    assert_trains_like(torch, plain_ema.module, ema.module, start)


# --- zero_grad(set_to_none=False) with a parameter unused in a step ------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_unused_parameter_keeps_its_zeroed_gradient(torch: Any, cdt: Any, mode: str) -> None:
    data = global_batches(torch, 4)  # the last step leaves "unused" out

    def make() -> Any:
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"used": torch.nn.Linear(6, 3), "unused": torch.nn.Linear(6, 3)})

    def step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        optimizer.zero_grad(set_to_none=False)
        logits = model["used"](x)
        if i % 2 == 0:  # "unused" takes part in every other step only
            logits = logits + model["unused"](x)
        loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
        (loss / GLOBAL_BATCH).backward()
        optimizer.step()

    def sgd(params: Any) -> Any:
        return torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.1)

    plain = make()
    start = train_plain(torch, plain, sgd(plain.parameters()), data, step)
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            net = make()
            model, optimizer = cdt.prepare(net, sgd(net.parameters()))
        run_on_replicas(strategy, lambda x, y, i: step(model, optimizer, x, y, i), data)
    for replica in model.replicas:
        grad = replica["unused"].weight.grad
        assert grad is not None  # plain torch keeps the zeroed tensor: decay still applies
        assert not grad.any()
    assert_trains_like(torch, plain, model, start)


# --- dropout under activation checkpointing ------------------------------------------------------
def _checkpointed(torch: Any, how: str) -> Any:
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc0 = torch.nn.Linear(6, 8)
            self.block = torch.nn.Sequential(
                torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Dropout(0.4)
            )
            self.fc2 = torch.nn.Linear(8, 3)

        def forward(self, x: Any) -> Any:
            h = self.fc0(x)
            if how == "none":
                h = self.block(h)
            else:
                h = checkpoint(self.block, h, use_reentrant=how == "reentrant")
            return self.fc2(h)

    torch.manual_seed(0)
    return Net()


def _dropout_run(torch: Any, cdt: Any, how: str, replicas: int) -> list[Any]:
    torch.manual_seed(7)
    data = global_batches(torch, 4)
    strategy = mirrored(replicas)
    with strategy.scope():
        net = _checkpointed(torch, how)
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
    torch.manual_seed(11)
    run_on_replicas(strategy, lambda x, y, i: standard_step(torch)(model, optimizer, x, y, i), data)
    for replica in model.replicas:
        assert all(p.grad is not None for p in replica.parameters())
    return [p.detach().clone() for p in model.replicas[0].parameters()]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
def test_dropout_under_activation_checkpointing_is_reproducible_and_exact(
    torch: Any, cdt: Any, mode: str, how: str
) -> None:
    with replica_execution(mode):
        first = _dropout_run(torch, cdt, how, 4)
        second = _dropout_run(torch, cdt, how, 4)
        unchecked = _dropout_run(torch, cdt, "none", 4)
    for a, b, c in zip(first, second, unchecked, strict=True):
        assert torch.equal(a, b)  # seeded alike: bitwise the same, whatever the timing
        # The recomputation drew the forward's masks: the same model as without it.
        assert torch.equal(a, c)


def test_one_replica_draws_plain_torchs_dropout_masks_under_checkpointing(
    torch: Any, cdt: Any
) -> None:
    replicated = _dropout_run(torch, cdt, "non-reentrant", 1)
    torch.manual_seed(7)
    data = global_batches(torch, 4)
    plain = _checkpointed(torch, "non-reentrant")
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    torch.manual_seed(11)
    for i, (x, y) in enumerate(data):
        standard_step(torch)(plain, optimizer, x, y, i)
    for a, b in zip(replicated, plain.parameters(), strict=True):
        assert torch.equal(a, b)


# --- gradients made outside autograd's accumulation ---------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_torch_func_gradients_are_reduced_at_step(torch: Any, cdt: Any, mode: str) -> None:
    from torch.func import functional_call, grad

    data = global_batches(torch, 4)

    def step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        module = getattr(model, "module", model)
        params = dict(module.named_parameters())

        def loss_fn(values: Any) -> Any:
            logits = functional_call(module, values, (x,))
            return torch.nn.functional.cross_entropy(logits, y, reduction="sum") / GLOBAL_BATCH

        grads = grad(loss_fn)({k: v.detach() for k, v in params.items()})
        for name, param in params.items():
            param.grad = grads[name]  # set by hand: no backward saw it
        optimizer.step()

    assert_mlp_trains_like_plain_torch(torch, cdt, mode, data, step)


# --- buffers: a declared aggregation ------------------------------------------------------------
def _counting(torch: Any) -> Any:
    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(6, 3)
            self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
            self.register_buffer("peak", torch.full((), -1e9))
            self.register_buffer("first", torch.zeros(()))
            self.register_buffer("constant", torch.arange(3.0))  # never changed: no rule

        def forward(self, x: Any) -> Any:
            self.seen += x.shape[0]
            self.peak.copy_(torch.maximum(self.peak, x.max()))
            self.first.copy_(x[0, 0])
            return self.fc(x) + self.constant

    return Counting()


@pytest.mark.parametrize("mode", MODES)
def test_buffers_combine_as_declared(torch: Any, cdt: Any, mode: str) -> None:
    data = global_batches(torch, 3)
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            model = cdt.prepare(
                _counting(torch),
                buffer_aggregation={"seen": "sum", "peak": "max", "first": "first_replica"},
            )
        run_on_replicas(strategy, lambda x, y, i: model(x).sum(), data)
    for replica in model.replicas:
        assert int(replica.seen) == 3 * GLOBAL_BATCH  # every example once, not a quarter
        assert float(replica.peak) == max(float(x.max()) for x, _ in data)
        assert float(replica.first) == float(data[-1][0][0, 0])  # replica 0's first example


@pytest.mark.parametrize("mode", MODES)
def test_an_undeclared_buffer_that_forward_changes_is_an_error(
    torch: Any, cdt: Any, mode: str
) -> None:
    with replica_execution(mode):
        strategy = mirrored(2)
        with strategy.scope():
            model = cdt.prepare(_counting(torch), buffer_aggregation={"peak": "max"})
        # 'first' (x[0, 0]) is alike on both replicas here: kept; 'seen' counts (integers).
        with pytest.raises(RuntimeError, match=r"changed buffer\(s\) \['seen'\].*integers"):
            strategy.run(lambda: model(torch.ones(2, 6)))
    with strategy.scope():
        with pytest.raises(ValueError, match=r"'nope', which matches no buffer.*'constant'"):
            cdt.prepare(_counting(torch), buffer_aggregation={"nope": "sum"})
        with pytest.raises(ValueError, match=r"must be one of \['mean'"):
            cdt.prepare(_counting(torch), buffer_aggregation={"seen": "avg"})
        with pytest.raises(ValueError, match=r"'seen' holds torch.int64 values"):
            cdt.prepare(_counting(torch), buffer_aggregation={"seen": "mean"})


# --- a DDP habit under TF's SUM rule warns once -------------------------------------------------
def test_a_local_mean_loss_under_the_sum_rule_warns_once(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.prepare(mlp(torch))
    x, y = global_batches(torch, 1)[0]

    def mean_loss() -> None:
        (torch.nn.functional.cross_entropy(model(x), y) + 0.0 * model[0].weight.sum()).backward()

    with pytest.warns(UserWarning, match=r"this replica's mean \(NllLoss with reduction='mean'\)"):
        strategy.run(mean_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy.run(mean_loss)  # once per model
        strategy.run(lambda: global_loss(torch, model, x, y).backward())
        with strategy.scope():
            ddp = cdt.prepare(mlp(torch), gradient_reduction="mean")
        strategy.run(lambda: torch.nn.functional.cross_entropy(ddp(x), y).backward())
    assert cd.get_replica_context() is not None


# --- autograd.grad inside the step: a gradient penalty -------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_gradient_penalty_with_autograd_grad_trains_like_plain_torch(
    torch: Any, cdt: Any, mode: str
) -> None:
    data = global_batches(torch, 4)

    def step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        optimizer.zero_grad()
        x = x.clone().requires_grad_(True)
        loss = global_loss(torch, model, x, y)
        (slope,) = torch.autograd.grad(loss, x, create_graph=True)  # a nested autograd call
        (loss + 0.5 * slope.pow(2).sum()).backward()
        optimizer.step()

    assert_mlp_trains_like_plain_torch(torch, cdt, mode, data, step)


# --- mixed precision: replicas agree on the loss scale -------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [False, True], ids=["copies", "shared"])
def test_an_inf_on_one_replica_makes_every_replica_skip_and_back_off(
    torch: Any, cdt: Any, mode: str, shared: bool
) -> None:
    torch.set_default_dtype(torch.float32)
    steps = 1000
    with replica_execution(mode):
        model, _, scales = fp16_run(torch, cdt, mirrored(4), steps, share_storage=shared)
    for i, per_replica in enumerate(scales):
        assert len({float(s) for s in per_replica}) == 1, (i, per_replica)  # one scale
    first = [float(s[0]) for s in scales]
    backoffs = [i for i in range(1, steps) if first[i] < first[i - 1]]
    injected = [i for i in range(steps) if i % 100 in (37, 71)]
    assert set(injected) <= set(backoffs)  # every injection skipped the step everywhere
    for replica in model.replicas[1:]:
        for a, b in zip(model.replicas[0].parameters(), replica.parameters(), strict=True):
            assert torch.equal(a, b)  # zero divergence
    assert all(torch.isfinite(p).all() for p in model.replicas[0].parameters())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_inf_on_one_replica_of_one_worker_makes_every_worker_skip(torch: Any) -> None:
    from tests.frameworks.workers import fp16_training
    from tests.multi_worker.harness import run_workers

    results = [r.unwrap() for r in run_workers(fp16_training, 2, args=(1000,), timeout=240)]
    assert results[0]["scales"] == results[1]["scales"]  # every replica of every worker
    assert results[0]["backoffs"] >= 20  # 10 injections of each kind: all backed off
    for other in results[1:]:
        for a, b in zip(results[0]["params"], other["params"], strict=True):
            assert (a == b).all()  # zero divergence


@pytest.mark.slow
def test_a_bf16_all_reduce_accumulates_in_float32(torch: Any) -> None:
    n, replicas = 16 << 20, 8
    generator = torch.Generator().manual_seed(0)
    values = [
        (torch.randn(n, generator=generator) * (1 + 100 * (r % 2))).to(torch.bfloat16)
        for r in range(replicas)
    ]
    strategy = mirrored(replicas)

    def step() -> Any:
        ctx = cd.get_replica_context()
        return ctx.all_reduce("sum", values[ctx.replica_id_in_sync_group])

    result = strategy.experimental_local_results(strategy.run(step))[0]
    assert result.dtype == torch.bfloat16
    reference = torch.zeros(n, dtype=torch.float64)
    magnitude = torch.zeros(n, dtype=torch.float64)
    for v in values:
        reference += v.double()
        magnitude += v.double().abs()
    # One bf16 rounding of the result (unit roundoff 2**-8) after float32 additions.
    bound = reference.abs() * 2.0**-8 + (replicas - 1) * 2.0**-24 * magnitude + 1e-30
    assert bool(((result.double() - reference).abs() <= bound).all())
    naive = values[0].clone()
    for v in values[1:]:
        naive += v  # bf16 accumulation, one rounding per addition
    assert not bool(((naive.double() - reference).abs() <= bound).all())  # the bound bites


def test_a_prepared_scaler_is_the_users_object_and_refuses_misuse(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    with strategy.scope():
        net = mlp(torch)
        _, _, same = cdt.prepare(net, torch.optim.SGD(net.parameters()), scaler)
        with pytest.raises(ValueError, match=r"fp16.*needs loss scaling.*GradScaler"):
            cdt.prepare(mlp(torch), mixed_precision="fp16")
        with pytest.raises(ValueError, match="mixed_precision must be None, 'bf16' or 'fp16'"):
            cdt.prepare(mlp(torch), mixed_precision="fp8")
    assert same is scaler
    assert isinstance(scaler, cdt.MirroredGradScaler)
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.get_scale() == 8.0
    plain_optimizer = torch.optim.SGD(mlp(torch).parameters())
    with pytest.raises(TypeError, match="steps the MirroredOptimizer that prepare returned"):
        strategy.run(lambda: scaler.step(plain_optimizer))
    scaler.load_state_dict({**scaler.state_dict(), "scale": 4.0})
    scales = strategy.run(lambda: torch.tensor(scaler.get_scale()))
    assert [float(s) for s in strategy.experimental_local_results(scales)] == [4.0, 4.0]


SCALER_SKIPS = {
    "step": r"scaler.update\(\) was called on replica 1 with no scaler.step\(optimizer\)",
    "update": r"scaler.step\(\) was called on replica 1 a second time since its last",
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [False, True], ids=["copies", "shared"])
@pytest.mark.parametrize("skipped", sorted(SCALER_SKIPS))
def test_a_scaler_call_skipped_by_one_replica_is_an_error_naming_it(
    torch: Any, cdt: Any, mode: str, shared: bool, skipped: str
) -> None:
    """torch's own words ('No inf checks were recorded prior to update') named nobody."""
    with replica_execution(mode):
        strategy = mirrored(2)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        with strategy.scope():
            net = mlp(torch)
            model, optimizer = cdt.prepare(
                net, torch.optim.SGD(net.parameters(), lr=0.1), scaler=scaler, share_storage=shared
            )

        def step(k: int) -> None:
            skips = k == 1 and cd.get_replica_context().replica_id_in_sync_group == 1
            optimizer.zero_grad()
            scaler.scale(model(torch.ones(4, 6)).sum()).backward()
            if skipped != "step" or not skips:
                scaler.step(optimizer)
            if skipped != "update" or not skips:
                scaler.update()

        def two_steps() -> None:
            strategy.run(step, args=(1,))  # found at once, or
            strategy.run(step, args=(2,))  # at the next step

        strategy.run(step, args=(0,))  # (float64 by default: the shared flag is float32)
        with pytest.raises(RuntimeError, match=SCALER_SKIPS[skipped]):
            two_steps()


def test_a_wrapper_around_a_prepared_model_is_refused_for_its_own_layers(
    torch: Any, cdt: Any
) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.prepare(mlp(torch))
    wrapper = torch.nn.Sequential(model, torch.nn.Linear(3, 2))  # a head added after prepare
    assert len(list(wrapper.parameters())) == 6  # it sees replica 0's parameters, and the head's
    with pytest.raises(RuntimeError, match=r"module Linear\(in_features=3, out_features=2"):
        strategy.run(lambda: wrapper(torch.ones(1, 6)).sum())
    frozen = torch.nn.Sequential(model, torch.nn.Linear(3, 2).requires_grad_(False))
    out = strategy.run(lambda: frozen(torch.ones(1, 6)).sum())  # a frozen head may be shared
    assert len(strategy.experimental_local_results(out)) == 2
