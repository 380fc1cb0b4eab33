"""Models whose replica copies need care: a tensor attribute derived from parameters.

The deprecated `torch.nn.utils.weight_norm` (common in audio and TTS models) keeps
`weight` as a plain attribute computed from `weight_g` and `weight_v`; `copy.deepcopy`
refuses it, so `prepare`, which copies the model once per replica, failed with torch's
deepcopy message where DDP runs (bug hunt, session 53). Each copy now derives it from
its own parameters (`derived.copy_module`), and its hook computes it again at every
forward: training equals plain torch's. So are a view of a parameter kept in
`__init__` and other tensors a graph made once (a later bug hunt: copies took them
detached, frozen at the initial weights and sending them no gradient).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest

from tests.frameworks.helpers import (
    GLOBAL_BATCH,
    assert_trains_like,
    global_batches,
    mirrored,
    run_on_replicas,
    standard_step,
    train_plain,
)
from tests.strategies.conftest import replica_execution


def _net(torch: Any) -> Any:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, and still in use
        first = torch.nn.utils.weight_norm(torch.nn.Linear(6, 8))
    return torch.nn.Sequential(first, torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
def test_a_deprecated_weight_norm_model_trains_like_plain_torch(
    torch: Any, cdt: Any, shared: bool
) -> None:
    torch.set_default_dtype(torch.float64)  # (restored by the suite's fixture)
    data = global_batches(torch, 4)
    step = standard_step(torch)
    plain = _net(torch)
    start = train_plain(torch, plain, torch.optim.SGD(plain.parameters(), lr=0.5), data, step)
    strategy = mirrored(4)
    with strategy.scope():
        net = _net(torch)
        sgd = torch.optim.SGD(net.parameters(), lr=0.5)
        model, optimizer = cdt.prepare(net, sgd, share_storage=shared)
    run_on_replicas(strategy, lambda x, y, i: step(model, optimizer, x, y, i), data)
    assert_trains_like(torch, plain, model, start)
    twin = copy.deepcopy(model)  # a mirrored module's own copy takes the same path
    x = data[0][0]
    assert torch.equal(twin.replicas[0](x), model.replicas[0](x))


# --- tensors a module derived from its parameters, kept as attributes -------------------------
# A view kept in `__init__` follows its parameter's in-place updates and sends it gradient;
# another derived tensor keeps its first value and sends gradient through its graph at every
# backward. Each replica's copy derives them again from its own parameters
# (`derived.copy_module`; a bug hunt found copies frozen at the initial weights).
def _cached_view(torch: Any) -> Any:
    class CachedView(torch.nn.Module):  # DDP trains it: each rank builds its own module
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(6, 3)
            self.wt = self.l.weight.t()  # a view of the weight

        def forward(self, x: Any) -> Any:
            return x @ self.wt + self.l.bias

    return CachedView()


def _in_containers(torch: Any) -> Any:
    class Containers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh())
            self.head = torch.nn.Linear(8, 3)
            # views of submodules' parameters, kept on the parent, in a list and a dict
            self.views = [self.body[0].weight.t(), self.head.weight[:, :4]]
            self.named = {"bias": self.body[0].bias.unsqueeze(0), "rest": (self.head.weight,)}

        def forward(self, x: Any) -> Any:
            h = torch.tanh(x @ self.views[0] + self.named["bias"])
            return h[:, :4] @ self.views[1].t() + h[:, 4:] @ self.head.weight[:, 4:].t()

    return Containers()


def _tied(torch: Any) -> Any:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encode = torch.nn.Linear(6, 4, bias=False)
            self.decode = torch.nn.Linear(4, 6, bias=False)
            self.decode.weight = self.encode.weight  # tied (used transposed in forward)
            self.head = torch.nn.Linear(6, 3)
            self.back = self.encode.weight.t()  # a view of the tied weight

        def forward(self, x: Any) -> Any:
            h = torch.tanh(x @ self.back)
            return self.head(torch.tanh(h @ self.decode.weight) + x)

    return Tied()


def _computed_once(torch: Any) -> Any:
    class ComputedOnce(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(6, 3)
            # not a view: its first value, and its graph's gradient at every backward (a
            # graph that saves no tensor: `weight * 2` would fail plain torch's 2nd backward)
            self.both = torch.cat([self.l.weight, -self.l.weight.flip(1)])

        def forward(self, x: Any) -> Any:
            return (x @ self.both.t())[:, :3] + self.l(x)

    return ComputedOnce()


DERIVED = {
    "view": _cached_view,
    "views_in_containers": _in_containers,
    "view_of_a_tied_weight": _tied,
    "computed_once": _computed_once,
}


def _trains_like_plain_torch(
    torch: Any, cdt: Any, make: Any, replicas: int, mode: str, shared: bool, step: Any = None
) -> Any:
    def build() -> Any:
        torch.manual_seed(0)
        return make(torch)

    data = global_batches(torch, 4)
    step = step or standard_step(torch)
    plain = build()
    start = train_plain(torch, plain, torch.optim.SGD(plain.parameters(), lr=0.5), data, step)
    with replica_execution(mode):
        strategy = mirrored(replicas)
        with strategy.scope():
            net = build()
            sgd = torch.optim.SGD(net.parameters(), lr=0.5)
            model, optimizer = cdt.prepare(net, sgd, share_storage=shared)
        run_on_replicas(strategy, lambda x, y, i: step(model, optimizer, x, y, i), data)
    assert_trains_like(torch, plain, model, start)
    return model


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("mode", ["threads", "cooperative"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
@pytest.mark.parametrize("kind", list(DERIVED))
def test_a_tensor_derived_from_parameters_in_init_trains_like_plain_torch(
    torch: Any, cdt: Any, kind: str, shared: bool, mode: str, replicas: int
) -> None:
    torch.set_default_dtype(torch.float64)
    model = _trains_like_plain_torch(torch, cdt, DERIVED[kind], replicas, mode, shared)
    if kind == "view":
        for replica in model.replicas:
            assert replica.wt._base is replica.l.weight
    twin = copy.deepcopy(model)  # a copy of the mirrored module derives them again too
    x = global_batches(torch, 1)[0][0]
    for mine, theirs in zip(model.replicas, twin.replicas, strict=True):
        assert torch.equal(mine(x), theirs(x))
    if kind == "view":
        assert twin.replicas[1].wt._base is twin.replicas[1].l.weight


def test_a_tensor_derived_from_a_tensor_outside_the_module_is_an_error(
    torch: Any, cdt: Any
) -> None:
    outside = torch.ones(3, 6, requires_grad=True)

    class Outside(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(6, 3)
            self.mixed = self.l.weight * outside

    strategy = mirrored(2)
    with strategy.scope(), pytest.raises(RuntimeError, match=r"'mixed' .* not one of the mod"):
        cdt.prepare(Outside())


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
def test_a_view_of_a_buffer_follows_an_in_place_write_outside_run(
    torch: Any, cdt: Any, shared: bool
) -> None:
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(6, 3)
            self.register_buffer("scale", torch.ones(3))
            self.row = self.scale.view(1, 3)

        def forward(self, x: Any) -> Any:
            return self.l(x) * self.row

    strategy = mirrored(3)
    with strategy.scope():
        torch.manual_seed(0)
        model = cdt.prepare(Scaled(), share_storage=shared)
    with torch.no_grad():
        model.scale.fill_(3.0)  # replica 0's buffer, in place: its view follows
    x = torch.ones(2, 6)
    out = strategy.run(lambda: model(x).detach())
    for value in strategy.experimental_local_results(out):
        assert torch.equal(value, out.values[0])
    for replica in model.replicas:
        assert replica.row._base is replica.scale


@pytest.mark.parametrize("mode", ["threads", "cooperative"])
def test_a_tensor_computed_once_whose_graph_torch_frees_fails_as_in_plain_torch(
    torch: Any, cdt: Any, mode: str
) -> None:
    class Doubled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(6, 3)
            self.w2 = self.l.weight * 2  # saves a tensor: plain torch's 2nd backward fails

        def forward(self, x: Any) -> Any:
            return x @ self.w2.t()

    torch.set_default_dtype(torch.float64)
    data = global_batches(torch, 2)
    step = standard_step(torch)
    plain = Doubled()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        train_plain(torch, plain, torch.optim.SGD(plain.parameters(), lr=0.5), data, step)
    with replica_execution(mode):
        strategy = mirrored(2)
        with strategy.scope():
            net = Doubled()
            model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
        # Replica 1 sends gradient through the graph that replica 0's backward frees:
        # crossdevice's error naming 'w2' at the first step, or (replica threads, when
        # replica 1 is first) torch's at the second, as plain torch's
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            run_on_replicas(strategy, lambda x, y, i: step(model, optimizer, x, y, i), data)


def _parametrized_net(torch: Any) -> Any:
    from torch.nn.utils import parametrizations

    return torch.nn.Sequential(
        parametrizations.weight_norm(torch.nn.Linear(6, 8)),
        torch.nn.Tanh(),
        parametrizations.orthogonal(torch.nn.Linear(8, 8)),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 3),
    )


@pytest.mark.parametrize("mode", ["threads", "cooperative"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
def test_parametrizations_cached_in_the_step_train_like_plain_torch(
    torch: Any, cdt: Any, shared: bool, mode: str
) -> None:
    # torch keys `parametrize.cached()` values by the module the parametrization was
    # registered on: every replica's copy read the first one's weight and graph (a
    # backward through another replica's copy, or through one graph twice).
    from torch.nn.utils import parametrize

    torch.set_default_dtype(torch.float64)

    def step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        optimizer.zero_grad()
        with parametrize.cached():
            loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
        (loss / GLOBAL_BATCH).backward()
        optimizer.step()

    model = _trains_like_plain_torch(torch, cdt, _parametrized_net, 3, mode, shared, step)
    with parametrize.cached():  # each copy caches its own value, the original its own
        weights = [replica[0].weight for replica in model.replicas]
        assert len({id(w) for w in weights}) == len(weights)
        assert all(torch.equal(w, weights[0]) for w in weights)
