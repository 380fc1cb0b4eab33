"""What user code does to a prepared model reaches every replica, or fails clearly.

Outside `strategy.run` a prepared model reads as replica 0's copy; a change made there
(a dtype cast, new parameter memory, a hook) must reach every replica. Inside `run`
each replica's mode is its own, and buffers a replica changes outside a forward of the
prepared model (a submodule called directly) are combined as declared. Compared with
plain torch on the same global batches in float64.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest

import crossdevice as cd
from tests.frameworks.helpers import max_norm_data, max_norm_net, max_norm_step, mirrored
from tests.strategies.conftest import replica_execution

MODES = ["threads", "cooperative"]
pytestmark = pytest.mark.usefixtures("float64")


def _data(torch: Any, steps: int = 3, n: int = 8) -> list[Any]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, 3, generator=generator), torch.randn(n, 1, generator=generator))
        for _ in range(steps)
    ]


def _mlp(torch: Any) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _step(torch: Any, model: Any, optimizer: Any, x: Any, y: Any, n: int) -> None:
    optimizer.zero_grad()
    (((model(x) - y.to(x.dtype)) ** 2).sum() / n).backward()
    optimizer.step()


def _compare(
    torch: Any,
    cdt: Any,
    net: Any,
    *,
    shared: bool | None = None,
    mode: str = "threads",
    before: Any = None,
    after: Any = None,
    step: Any = None,
    data: list[Any] | None = None,
    **prepare: Any,
) -> tuple[Any, Any]:
    """Train `net` prepared on 2 replicas and a plain copy alike; `before(module)` runs on
    both before prepare, `after(model)` right after it. Returns (prepared, plain)."""
    step = step or _step
    data = data or _data(torch)
    plain = copy.deepcopy(net)
    if before is not None:
        before(net)
        before(plain)
    with replica_execution(mode):
        strategy = mirrored(2)
        with strategy.scope():
            optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            model, optimizer = cdt.prepare(net, optimizer, share_storage=shared, **prepare)
        if after is not None:
            after(model)
            after(plain)
        plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
        for features, y in data:
            n = len(features)
            x = features.to(next(plain.parameters()).dtype)
            dist = strategy.experimental_distribute_values_from_function(
                lambda ctx, x=x, y=y: (
                    x[ctx.replica_id_in_sync_group :: 2],
                    y[ctx.replica_id_in_sync_group :: 2],
                )
            )
            strategy.run(lambda a, b, n=n: step(torch, model, optimizer, a, b, n), args=dist)
            step(torch, plain, plain_optimizer, x, y, n)
    return model, plain


def _assert_like(torch: Any, model: Any, plain: Any, tol: float = 1e-12) -> None:
    first, *others = model.replicas
    for other in others:
        for a, b in zip(first.parameters(), other.parameters(), strict=True):
            assert torch.equal(a, b), "replicas differ"
            if model.shares_storage:
                assert a.data_ptr() == b.data_ptr(), "replicas stopped sharing storage"
    worst = max(
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(first.parameters(), plain.parameters(), strict=True)
    )
    assert worst <= tol, f"{worst} off plain torch"


# --- 1. dtype casts and new parameter memory outside run -------------------------------------
CASTS = {
    "float": lambda torch, m: m.float(),
    "to_float32": lambda torch, m: m.to(torch.float32),
    "half_then_double": lambda torch, m: m.half().double(),
}


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("cast", sorted(CASTS))
def test_a_dtype_cast_after_prepare_trains_like_plain_torch(
    torch: Any, cdt: Any, cast: str, shared: bool
) -> None:
    model, plain = _compare(
        torch, cdt, _mlp(torch), shared=shared, after=lambda m: CASTS[cast](torch, m)
    )
    assert next(model.parameters()).dtype == next(plain.parameters()).dtype
    _assert_like(torch, model, plain, tol=1e-12 if cast == "half_then_double" else 1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [True, False])
def test_new_parameter_memory_outside_run_reaches_every_replica(
    torch: Any, cdt: Any, shared: bool, mode: str
) -> None:
    def halve(m: Any) -> None:
        for p in m.parameters():
            p.data = p.detach().clone() * 0.5  # new memory, as torch's own _apply gives

    model, plain = _compare(torch, cdt, _mlp(torch), shared=shared, mode=mode, after=halve)
    _assert_like(torch, model, plain)


def test_a_replaced_parameter_object_is_an_error(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.prepare(_mlp(torch))
    with pytest.raises(RuntimeError, match=r"assign=True\) replaces"):
        model.load_state_dict(model.state_dict(), assign=True)
    import torch.nn.utils.prune

    torch.nn.utils.prune.l1_unstructured(model[0], "weight", amount=0.5)  # replica 0 only
    with pytest.raises(RuntimeError, match=r"'0.weight' of replica 0's copy .* no longer the"):
        strategy.run(lambda: model(torch.ones(2, 3)))


def test_new_parameter_memory_inside_run_with_shared_storage_is_an_error(
    torch: Any, cdt: Any
) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.prepare(_mlp(torch), share_storage=True)

    def step() -> None:
        if cd.get_replica_context().replica_id_in_sync_group == 1:
            model.module[0].weight.data = torch.zeros(4, 3)

    with pytest.raises(RuntimeError, match=r"'0.weight' .* stopped sharing replica 0's memory"):
        strategy.run(step)


# --- 2./3. hooks registered outside run --------------------------------------------------------
def _double_gradients(m: Any) -> None:
    for p in m.parameters():
        p.register_hook(lambda g: g * 2)


MODULE_HOOKS = {
    "forward": lambda m: m[0].register_forward_hook(lambda mod, i, o: o * 0.5),
    "forward_pre": lambda m: m[2].register_forward_pre_hook(lambda mod, a: (a[0] * 2,)),
    "forward_kwargs": lambda m: m[2].register_forward_pre_hook(
        lambda mod, a, k: ((a[0] * 3,), k), with_kwargs=True
    ),
    "full_backward": lambda m: m[2].register_full_backward_hook(
        lambda mod, gin, gout: tuple(None if g is None else g * 3 for g in gin)
    ),
    "backward_pre": lambda m: m[2].register_full_backward_pre_hook(
        lambda mod, gout: tuple(g * 3 for g in gout)
    ),
    "tensor": _double_gradients,
}


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("kind", sorted(MODULE_HOOKS))
def test_hooks_registered_after_prepare_run_on_every_replica(
    torch: Any, cdt: Any, kind: str, shared: bool
) -> None:
    model, plain = _compare(torch, cdt, _mlp(torch), shared=shared, after=MODULE_HOOKS[kind])
    _assert_like(torch, model, plain)


@pytest.mark.parametrize("mode", MODES)
def test_parameter_hooks_registered_before_prepare_run_on_every_replica(
    torch: Any, cdt: Any, mode: str
) -> None:
    model, plain = _compare(torch, cdt, _mlp(torch), mode=mode, before=_double_gradients)
    assert all(p._backward_hooks for p in plain.parameters())
    _assert_like(torch, model, plain)


def test_hooks_follow_their_handles_and_in_run_ones_stay_per_replica(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.prepare(_mlp(torch))
    calls: list[Any] = []

    def who(*_: Any) -> None:
        calls.append(cd.get_replica_context().replica_id_in_sync_group)

    seen: list[int] = []
    handle = model[0].register_forward_hook(who)
    post = [
        p.register_post_accumulate_grad_hook(lambda p: seen.append(1)) for p in model.parameters()
    ]
    strategy.run(lambda: model(torch.ones(2, 3)).sum().backward())
    assert sorted(calls) == [0, 1]  # every replica's copy runs it
    assert len(seen) == 2 * 4  # every replica's 4 parameters
    handle.remove()
    for each in post:
        each.remove()
    calls.clear()
    seen.clear()
    strategy.run(lambda: model(torch.ones(2, 3)).sum().backward())
    assert calls == []  # removed from every replica
    assert seen == []

    own: list[Any] = []

    def register() -> None:  # inside run: each replica's hook on its own copy
        own.append(model.module[2].register_forward_hook(who))

    strategy.run(register)
    strategy.run(lambda: model(torch.ones(2, 3)))
    assert sorted(calls) == [0, 1]  # once per replica, not once per replica per copy


def test_a_load_state_dict_hook_registered_after_prepare_loads_every_replica(
    torch: Any, cdt: Any
) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.prepare(_mlp(torch), share_storage=False)

    def zero_bias(module: Any, state: Any, prefix: str, *_: Any) -> None:
        state[prefix + "bias"] = torch.zeros_like(state[prefix + "bias"])

    model[0].register_load_state_dict_pre_hook(zero_bias)
    model.load_state_dict(model.state_dict())
    assert all(float(r[0].bias.detach().abs().max()) == 0.0 for r in model.replicas)


# --- 4. train()/eval() inside run are per replica ----------------------------------------------
def _mode_net(torch: Any) -> Any:
    class ModeScale(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            time.sleep(0.002)  # a real forward takes a while
            return x * (2.0 if self.training else 1.0)

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), ModeScale(), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    )


@pytest.mark.parametrize("shared", [True, False])
def test_eval_and_train_inside_run_are_each_replicas_own(
    torch: Any, cdt: Any, shared: bool
) -> None:
    modes: list[bool] = []

    def step(torch: Any, model: Any, optimizer: Any, x: Any, y: Any, n: int) -> None:
        ctx = cd.get_replica_context()
        if ctx is not None and ctx.replica_id_in_sync_group == 1:
            time.sleep(0.003)  # replica 1 a little late, as threads are
        model.eval()
        with torch.no_grad():
            model(x)  # a validation pass
        if ctx is not None:
            modes.append(model.training)
        model.train()
        _step(torch, model, optimizer, x, y, n)

    model, plain = _compare(
        torch, cdt, _mode_net(torch), shared=shared, step=step, data=_data(torch, 6)
    )
    assert modes
    assert not any(modes)
    _assert_like(torch, model, plain)


# --- 5. buffers changed outside a forward of the prepared model ---------------------------------
def _backbone_head(torch: Any) -> Any:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = torch.nn.Sequential(
                torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Tanh()
            )
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x: Any) -> Any:
            return self.head(self.backbone(x))

    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [True, False])
def test_submodules_called_directly_combine_buffers_like_the_whole_model(
    torch: Any, cdt: Any, shared: bool, mode: str
) -> None:
    def direct(torch: Any, model: Any, optimizer: Any, x: Any, y: Any, n: int) -> None:
        optimizer.zero_grad()
        (((model.head(model.backbone(x)) - y) ** 2).sum() / n).backward()
        optimizer.step()

    whole, _ = _compare(torch, cdt, _backbone_head(torch), shared=shared, mode=mode)
    model, _ = _compare(torch, cdt, _backbone_head(torch), shared=shared, mode=mode, step=direct)
    for name in ("running_mean", "running_var"):
        values = [getattr(r.backbone[1], name) for r in model.replicas]
        assert torch.equal(values[0], values[1]), f"{name} differs between replicas"
        expected = getattr(whole.replicas[0].backbone[1], name)
        assert float((values[0] - expected).abs().max()) <= 1e-15
    for a, b in zip(whole.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_sum_buffer_changed_by_eval_forwards_is_combined_when_the_run_ends(
    torch: Any, cdt: Any
) -> None:
    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)
            self.register_buffer("seen", torch.zeros((), dtype=torch.long))

        def forward(self, x: Any) -> Any:
            self.seen += x.shape[0]
            return self.lin(x)

    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.prepare(Counter(), buffer_aggregation={"seen": "sum"})
    model.eval()
    strategy.run(lambda: model(torch.ones(4, 3)))
    assert [int(r.seen) for r in model.replicas] == [8, 8]


# --- 6. undeclared buffers --------------------------------------------------------------------
@pytest.mark.parametrize("shared", [True, False])
def test_spectral_norm_trains_like_plain_torch_without_a_declaration(
    torch: Any, cdt: Any, shared: bool
) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.utils.spectral_norm(torch.nn.Linear(3, 4)), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    )
    model, plain = _compare(torch, cdt, net, shared=shared)
    _assert_like(torch, model, plain)
    for replica in model.replicas:
        assert float((replica[0].weight_u - plain[0].weight_u).abs().max()) <= 1e-12


def test_parametrized_spectral_norm_needs_no_declaration(torch: Any, cdt: Any) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(3, 4)),
        torch.nn.Tanh(),
        torch.nn.Linear(4, 1),
    )
    model, plain = _compare(torch, cdt, net, shared=True)
    _assert_like(torch, model, plain)


def test_an_undeclared_float_counter_alike_on_every_replica_is_an_error(
    torch: Any, cdt: Any
) -> None:
    """A float buffer counting examples (`seen += len(x)`) changes alike on replicas with
    slices of one size, and was kept so: each replica's count, 1/N of plain torch's,
    silently (the bug hunt of session 54). Alike says nothing: it must be declared."""

    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x: Any) -> Any:
            self.seen += x.shape[0]
            return self.lin(x)

    batches = [torch.ones(8, 3), torch.ones(8, 3)]
    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.prepare(Counter())
    with pytest.raises(RuntimeError, match=r"\['seen'\].*changed them to the same value.*'sum'"):
        strategy.run(model, args=(next(iter(strategy.experimental_distribute_dataset(batches))),))
    with strategy.scope():
        model = cdt.prepare(Counter(), buffer_aggregation={"seen": "sum"})
    for x in strategy.experimental_distribute_dataset(batches):
        strategy.run(model, args=(x,))
    assert [float(r.seen) for r in model.replicas] == [16.0, 16.0]  # plain torch's count


def test_an_undeclared_buffer_error_explains_every_choice(torch: Any, cdt: Any) -> None:
    class Stats(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)
            self.register_buffer("avg", torch.zeros(3))

        def forward(self, x: Any) -> Any:
            self.avg.mul_(0.9).add_(x.mean(0), alpha=0.1)
            return self.lin(x)

    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.prepare(Stats())
    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full((2, 3), float(ctx.replica_id_in_sync_group))
    )
    message = r"\['avg'\].*differ.*'mean' for running statistics.*'sum' for counters"
    with pytest.raises(RuntimeError, match=message):
        strategy.run(model, args=(dist,))

    def direct(x: Any) -> Any:
        return model.module(x)  # the running replica's copy: no combining after it

    with pytest.raises(RuntimeError, match=message):  # found when the run ends
        strategy.run(direct, args=(dist,))


# --- parameters written in place inside run, per-replica copies ---------------------------
def _max_norm_step(which: str) -> Any:
    """The step, then each weight row scaled to norm <= 1 in place (a max-norm constraint)
    by every replica (`which="all"`) or by replica 0 only."""

    def step(torch: Any, model: Any, optimizer: Any, x: Any, y: Any, n: int) -> None:
        _step(torch, model, optimizer, x, y, n)
        ctx = cd.get_replica_context()
        if which == "all" or ctx is None or ctx.replica_id_in_sync_group == 0:
            with torch.no_grad():
                weight = getattr(model, "module", model)[0].weight  # prepared, or plain
                weight.div_(weight.norm(dim=1, keepdim=True).clamp(min=1.0))

    return step


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_written_alike_by_every_replica_trains_like_torch(
    torch: Any, cdt: Any, mode: str
) -> None:
    model, plain = _compare(
        torch, cdt, _mlp(torch), shared=False, mode=mode, step=_max_norm_step("all")
    )
    _assert_like(torch, model, plain)


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_written_by_some_replicas_only_is_an_error_naming_it(
    torch: Any, cdt: Any, mode: str
) -> None:
    """Copies that differ from then on were silent: each replica trained its own model."""
    with pytest.raises(RuntimeError, match=r"parameter '0.weight'.*replica 0: 2, replica 1: 1"):
        _compare(torch, cdt, _mlp(torch), shared=False, mode=mode, step=_max_norm_step("one"))


# --- max_norm embeddings: every row of the global batch rescaled on every replica ------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [False, True], ids=["copies", "shared"])
def test_a_max_norm_embedding_trains_like_torch(
    torch: Any, cdt: Any, mode: str, shared: bool
) -> None:
    """Each replica rescaled the rows of its own slice only: with copies they drifted apart
    silently, with shared storage it was an error."""
    net = max_norm_net(torch)
    plain = copy.deepcopy(net)
    assert float(net[0].weight.detach().norm(dim=1).min()) > 0.7  # every row looked up rescales
    with replica_execution(mode):
        strategy = mirrored(2)
        with strategy.scope():
            model, optimizer = cdt.prepare(
                net, torch.optim.SGD(net.parameters(), lr=0.1), share_storage=shared
            )
        plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
        for x, y in max_norm_data(torch):
            dist = strategy.experimental_distribute_values_from_function(
                lambda ctx, x=x, y=y: (
                    x[ctx.replica_id_in_sync_group :: 2],
                    y[ctx.replica_id_in_sync_group :: 2],
                )
            )
            strategy.run(lambda a, b: max_norm_step(model, optimizer, a, b), args=dist)
            max_norm_step(plain, plain_optimizer, x, y)
    _assert_like(torch, model, plain)


@pytest.mark.parametrize("mode", MODES)
def test_max_norm_embeddings_declared_replica_copies_stay_copies(
    torch: Any, cdt: Any, mode: str
) -> None:
    """Copies a user made per replica and declared (`mark_replica_copy`) are copies of one
    model: each rescales every replica's rows, as the one model would on one device with
    the global batch, so they stay equal (each rescaling its own slice's rows would part
    them for good, silently)."""
    torch.manual_seed(3)
    one = torch.nn.Embedding(12, 4, max_norm=0.7)
    plain = copy.deepcopy(one)
    x = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])  # replica 0: rows 0-3, replica 1: 4-7
    with replica_execution(mode):
        strategy = mirrored(2)
        copies = [one, copy.deepcopy(one)]
        for r, c in enumerate(copies):
            cdt.mark_replica_copy(c, r, strategy=strategy)

        def lookup() -> None:
            r = cd.get_replica_context().replica_id_in_sync_group
            copies[r](x[r::2])

        strategy.run(lookup)
    plain(x)
    assert (
        float(plain.weight.detach()[4:8].norm(dim=1).max()) <= 0.7 + 1e-6
    )  # the other slice's rows
    for r in range(2):
        assert torch.equal(copies[r].weight, plain.weight), f"replica {r}"


@pytest.mark.parametrize("mode", MODES)
def test_a_max_norm_embedding_every_replica_shares_rescales_the_global_batchs_rows_once(
    torch: Any, mode: str
) -> None:
    """One embedding that no replica owns, shared in eval mode under no_grad (allowed: it
    trains nothing), still rescales rows in place: every slice's rows, each once, as
    one device would with the global batch, not two replicas writing it at once."""
    torch.manual_seed(3)
    one = torch.nn.Embedding(12, 4, max_norm=0.7).eval()
    plain = copy.deepcopy(one)
    x = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])

    def lookup() -> Any:
        with torch.no_grad():
            return one(x[cd.get_replica_context().replica_id_in_sync_group :: 2])

    with replica_execution(mode):
        strategy = mirrored(2)
        strategy.run(lookup)
    with torch.no_grad():
        plain(x)
    assert torch.equal(one.weight, plain.weight)


@pytest.mark.multiprocess
def test_a_max_norm_embedding_trains_like_torch_across_workers(torch: Any) -> None:
    from tests.frameworks.workers import max_norm_embedding
    from tests.multi_worker.harness import run_workers

    plain = max_norm_net(torch)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for x, y in max_norm_data(torch):
        max_norm_step(plain, optimizer, x, y)
    for params in (r.unwrap() for r in run_workers(max_norm_embedding, 2)):
        for got, want in zip(params, plain.parameters(), strict=True):
            assert abs(got - want.detach().numpy()).max() <= 1e-12
