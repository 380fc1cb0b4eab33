"""Code run once for all replicas acts as plain torch's, and every replica gets its result.

`model.apply(fn)`, `load_state_dict` (its hooks) and `train()` / `eval()` (a submodule's
own `train`) run user code on a prepared model outside `strategy.run`; `call_once(fn)`
runs it inside. Each runs it once, on replica 0's copy, as plain torch runs it on the
one module (the global random generator advances once, an in-place change lands once),
and every replica ends with replica 0's values and gradients, bitwise, in every mode
(replica threads, cooperative) and storage (shared, a copy per replica), on 2 and 3
replicas. Compared with plain torch on the same global batches in float64.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.frameworks.helpers import (
    assert_trains_like,
    global_batches,
    global_loss,
    mirrored,
    mlp,
    run_on_replicas,
    standard_step,
    train_plain,
)
from tests.strategies.conftest import replica_execution

pytestmark = pytest.mark.usefixtures("float64")

CASES = [
    (mode, shared, n)
    for mode in ("threads", "cooperative")
    for shared in (True, False)
    for n in (2, 3)
]
IDS = [f"{mode}-{'shared' if shared else 'copies'}-{n}" for mode, shared, n in CASES]


def _prepare(torch: Any, cdt: Any, net: Any, n: int, shared: bool) -> tuple[Any, Any, Any]:
    strategy = mirrored(n)
    with strategy.scope():
        model, optimizer = cdt.prepare(
            net, torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.5), share_storage=shared
        )
    return strategy, model, optimizer


def _plain_optimizer(torch: Any, net: Any) -> Any:
    return torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.5)


def _assert_replicas_are(torch: Any, model: Any, expected: list[Any]) -> None:
    """Every replica's parameters equal `expected` bitwise."""
    for r, replica in enumerate(model.replicas):
        for a, b in zip(replica.parameters(), expected, strict=True):
            assert torch.equal(a.detach(), b.detach()), f"replica {r} differs from plain torch"


# --- 1. model.apply(fn) outside run ----------------------------------------------------------
def _shrink(torch: Any) -> Any:
    def fn(m: Any) -> None:  # GPT-2's "scale down these layers' init", in place
        if isinstance(m, torch.nn.Linear):
            with torch.no_grad():
                m.weight.mul_(0.5)

    return fn


def _xavier(torch: Any) -> Any:
    def fn(m: Any) -> None:  # a random initialiser
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.xavier_uniform_(m.weight)
            torch.nn.init.zeros_(m.bias)

    return fn


def _through_data(torch: Any) -> Any:
    def fn(m: Any) -> None:  # DCGAN's weights_init: random, written through .data
        if isinstance(m, torch.nn.Linear):
            m.weight.data.normal_(0.0, 0.3)

    return fn


INITS = {"in_place": _shrink, "random": _xavier, "through_data": _through_data}


@pytest.mark.parametrize("init", sorted(INITS))
@pytest.mark.parametrize(("mode", "shared", "n"), CASES, ids=IDS)
def test_apply_after_prepare_acts_once_as_plain_torch(
    torch: Any, cdt: Any, init: str, mode: str, shared: bool, n: int
) -> None:
    data = global_batches(torch, 3)
    fn = INITS[init](torch)
    plain_calls: list[str] = []
    plain = mlp(torch)
    torch.manual_seed(5)
    plain.apply(lambda m: (plain_calls.append(type(m).__name__), fn(m)))
    plain_next = torch.rand(3)
    initialised = [p.detach().clone() for p in plain.parameters()]
    start = train_plain(torch, plain, _plain_optimizer(torch, plain), data, standard_step(torch))
    with replica_execution(mode):
        strategy, model, optimizer = _prepare(torch, cdt, mlp(torch), n, shared)
        calls: list[str] = []
        torch.manual_seed(5)
        assert model.apply(lambda m: (calls.append(type(m).__name__), fn(m))) is model
        assert torch.equal(torch.rand(3), plain_next), "the generator advanced differently"
        assert calls == plain_calls  # once per submodule of the model, in torch's order
        _assert_replicas_are(torch, model, initialised)

        def step(x: Any, y: Any, i: int) -> None:
            standard_step(torch)(model, optimizer, x, y, i)

        run_on_replicas(strategy, step, data)
    assert_trains_like(torch, plain, model, start)


@pytest.mark.parametrize(("mode", "shared", "n"), CASES, ids=IDS)
def test_an_attribute_apply_sets_reaches_every_replica(
    torch: Any, cdt: Any, mode: str, shared: bool, n: int
) -> None:
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.factor = 1.0

        def forward(self, x: Any) -> Any:
            return x * self.factor

    def net() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), Scale(), torch.nn.Linear(8, 3))

    def fn(m: Any) -> None:
        if isinstance(m, Scale):
            m.factor = 0.25

    data = global_batches(torch, 3)
    plain = net().apply(fn)
    start = train_plain(torch, plain, _plain_optimizer(torch, plain), data, standard_step(torch))
    with replica_execution(mode):
        strategy, model, optimizer = _prepare(torch, cdt, net(), n, shared)
        model.apply(fn)
        assert [r[1].factor for r in model.replicas] == [0.25] * n

        def step(x: Any, y: Any, i: int) -> None:
            standard_step(torch)(model, optimizer, x, y, i)

        run_on_replicas(strategy, step, data)
    assert_trains_like(torch, plain, model, start)


def test_a_structure_change_in_apply_is_an_error(torch: Any, cdt: Any) -> None:
    _, model, _ = _prepare(torch, cdt, mlp(torch), 2, True)

    def replace(m: Any) -> None:
        if isinstance(m, torch.nn.Sequential):
            m[1] = torch.nn.ReLU()

    with pytest.raises(RuntimeError, match=r"added or replaced a submodule"):
        model.apply(replace)


# --- 2. _apply with an in-place function, load_state_dict's hooks, a custom train() -------
@pytest.mark.parametrize(("mode", "shared", "n"), CASES, ids=IDS)
def test_an_in_place_apply_function_changes_shared_memory_once(
    torch: Any, cdt: Any, mode: str, shared: bool, n: int
) -> None:
    def halve(t: Any) -> Any:
        return t.mul_(0.5)  # torch's _apply protocol with an in-place function

    plain = mlp(torch)
    with torch.no_grad():
        plain._apply(halve)
    with replica_execution(mode):
        _, model, _ = _prepare(torch, cdt, mlp(torch), n, shared)
        with torch.no_grad():
            model._apply(halve)
    _assert_replicas_are(torch, model, list(plain.parameters()))


@pytest.mark.parametrize(("mode", "shared", "n"), CASES, ids=IDS)
def test_load_state_dict_runs_its_hooks_once_as_plain_torch(
    torch: Any, cdt: Any, mode: str, shared: bool, n: int
) -> None:
    saved = mlp(torch).state_dict()
    with torch.no_grad():
        for value in saved.values():
            value.add_(1.0)

    def hooks(module: Any, calls: list[str]) -> None:
        def double(m: Any, state: Any, prefix: str, *_: Any) -> None:
            calls.append("pre")
            state[prefix + "weight"].mul_(2.0)  # in place, on the caller's tensor

        module[0].register_load_state_dict_pre_hook(double)
        module.register_load_state_dict_post_hook(lambda m, keys: calls.append("post"))

    plain = mlp(torch)
    plain_calls: list[str] = []
    hooks(plain, plain_calls)
    plain.load_state_dict({k: v.clone() for k, v in saved.items()})
    with replica_execution(mode):
        _, model, _ = _prepare(torch, cdt, mlp(torch), n, shared)
        calls: list[str] = []
        hooks(model, calls)
        model.load_state_dict({k: v.clone() for k, v in saved.items()})
    assert calls == plain_calls
    _assert_replicas_are(torch, model, list(plain.parameters()))


def _merging_net(torch: Any) -> Any:
    class Merging(torch.nn.Linear):
        """A LoRA-style layer: eval() merges its delta into the weight, train() undoes it."""

        def __init__(self) -> None:
            super().__init__(6, 8)
            self.merged = False
            self.delta = torch.nn.Parameter(torch.full((8, 6), 0.1), requires_grad=False)

        def train(self, mode: bool = True) -> Any:
            super().train(mode)
            with torch.no_grad():
                if not mode and not self.merged:
                    self.weight.add_(self.delta)
                elif mode and self.merged:
                    self.weight.sub_(self.delta)
            self.merged = not mode
            return self

        def forward(self, x: Any) -> Any:
            weight = self.weight if self.merged else self.weight + self.delta
            return torch.nn.functional.linear(x, weight, self.bias)

    torch.manual_seed(0)
    return torch.nn.Sequential(Merging(), torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize(("mode", "shared", "n"), CASES, ids=IDS)
def test_a_submodules_own_train_runs_once_outside_run(
    torch: Any, cdt: Any, mode: str, shared: bool, n: int
) -> None:
    data = global_batches(torch, 3)
    x = data[0][0]

    def evaluate_then_train(model: Any, optimizer: Any, xs: Any, ys: Any, i: int) -> None:
        standard_step(torch)(model, optimizer, xs, ys, i)

    plain = _merging_net(torch)
    plain.eval()
    plain_eval = plain(x).detach()
    merged = [p.detach().clone() for p in plain.parameters()]
    plain.train()
    start = train_plain(torch, plain, _plain_optimizer(torch, plain), data, evaluate_then_train)
    with replica_execution(mode):
        strategy, model, optimizer = _prepare(torch, cdt, _merging_net(torch), n, shared)
        model.eval()
        _assert_replicas_are(torch, model, merged)
        assert all(r[0].merged for r in model.replicas)
        outputs = strategy.experimental_local_results(strategy.run(lambda: model(x)))
        for output in outputs:
            assert torch.equal(output.detach(), plain_eval)
        model.train()

        def step(xs: Any, ys: Any, i: int) -> None:
            evaluate_then_train(model, optimizer, xs, ys, i)

        run_on_replicas(strategy, step, data)
    assert_trains_like(torch, plain, model, start)


# --- 3. call_once: replica 0's gradients reach every replica -----------------------------------
def _halve_in_place(model: Any) -> None:
    for p in model.parameters():
        p.grad.mul_(0.5)


def _halve_by_replacing(model: Any) -> None:
    for p in model.parameters():
        p.grad = p.grad * 0.5


def _drop_last_bias(model: Any) -> None:
    _halve_in_place(model)
    model[2].bias.grad = None  # that parameter does not step


GRADIENT_CHANGES = {
    "in_place": _halve_in_place,
    "replaced": _halve_by_replacing,
    "set_to_none": _drop_last_bias,
}


@pytest.mark.parametrize("change", sorted(GRADIENT_CHANGES))
@pytest.mark.parametrize(("mode", "shared", "n"), CASES, ids=IDS)
def test_gradients_changed_in_call_once_reach_every_replica(
    torch: Any, cdt: Any, change: str, mode: str, shared: bool, n: int
) -> None:
    fn = GRADIENT_CHANGES[change]
    data = global_batches(torch, 3)

    def plain_step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        optimizer.zero_grad()
        global_loss(torch, model, x, y).backward()
        fn(model)
        optimizer.step()

    plain = mlp(torch)
    start = train_plain(torch, plain, _plain_optimizer(torch, plain), data, plain_step)
    with replica_execution(mode):
        strategy, model, optimizer = _prepare(torch, cdt, mlp(torch), n, shared)

        def step(x: Any, y: Any, i: int) -> None:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()
            cdt.call_once(fn, model)
            optimizer.step()

        run_on_replicas(strategy, step, data)
    assert_trains_like(torch, plain, model, start)
    first = [p.grad for p in model.replicas[0].parameters()]
    for replica in model.replicas[1:]:
        for a, b in zip(first, replica.parameters(), strict=True):
            assert (a is None) == (b.grad is None)
            assert a is None or torch.equal(a, b.grad), "a replica's gradient differs"
    for a, b in zip(first, plain.parameters(), strict=True):
        assert (a is None) == (b.grad is None)


@pytest.mark.parametrize("shared", [True, False])
def test_a_gradient_call_once_gives_where_there_was_none_is_an_error(
    torch: Any, cdt: Any, shared: bool
) -> None:
    strategy, model, optimizer = _prepare(torch, cdt, mlp(torch), 2, shared)
    x, y = global_batches(torch, 1)[0]

    def clear(m: Any) -> None:
        m[0].bias.grad = None

    def give(m: Any) -> None:
        m[0].bias.grad = torch.ones_like(m[0].bias)

    def step(xs: Any, ys: Any) -> None:
        optimizer.zero_grad()
        global_loss(torch, model, xs, ys).backward()
        cdt.call_once(clear, model)
        cdt.call_once(give, model)

    dist = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    with pytest.raises(RuntimeError, match=r"give ran once for all replicas .* a new gradient"):
        strategy.run(step, args=dist)


@pytest.mark.parametrize(("mode", "shared", "n"), CASES, ids=IDS)
def test_optimizer_state_changed_in_call_once_reaches_every_replica(
    torch: Any, cdt: Any, mode: str, shared: bool, n: int
) -> None:
    def damp(optimizer: Any) -> None:
        for state in optimizer.state.values():
            state["momentum_buffer"].mul_(0.5)

    def then(optimizer: Any) -> None:
        damp(optimizer)

    data = global_batches(torch, 3)
    plain = mlp(torch)
    start = train_plain(
        torch, plain, _plain_optimizer(torch, plain), data, standard_step(torch, then)
    )
    with replica_execution(mode):
        strategy, model, optimizer = _prepare(torch, cdt, mlp(torch), n, shared)

        def step(x: Any, y: Any, i: int) -> None:
            standard_step(torch)(model, optimizer, x, y, i)
            cdt.call_once(damp, optimizer)

        run_on_replicas(strategy, step, data)
    assert_trains_like(torch, plain, model, start)
