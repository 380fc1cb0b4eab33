"""Shared pieces of the torch training tests: example loading, small models, strategies."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import crossdevice as cd

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """Import `examples/<name>.py` as a module (examples are scripts, not a package)."""
    key = f"crossdevice_example_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def mirrored(n: int) -> Any:
    """MirroredStrategy on `n` logical CPUs."""
    return cd.MirroredStrategy([f"CPU:{i}" for i in range(n)])


def worker_strategy(replicas: int) -> Any:
    """In a worker process: a MultiWorkerMirroredStrategy with `replicas` local CPUs."""
    if replicas > 1:
        cd.config.set_logical_cpu_devices(replicas)
    return cd.MultiWorkerMirroredStrategy(devices=[f"CPU:{i}" for i in range(replicas)])


def bn_dropout_model(torch: Any) -> Any:
    """A small CNN with BatchNorm and Dropout, for buffer and randomness tests."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 8 * 8, 10),
    )


# --- training against plain torch on the same global batches ------------------------------
GLOBAL_BATCH = 16


def global_batches(torch: Any, steps: int, features: int = 6, classes: int = 3) -> list[Any]:
    """`steps` seeded global batches `(x, y)` of GLOBAL_BATCH examples (default dtype)."""
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(GLOBAL_BATCH, features, generator=generator),
            torch.randint(0, classes, (GLOBAL_BATCH,), generator=generator),
        )
        for _ in range(steps)
    ]


def replica_batch(torch: Any) -> tuple[Any, Any]:
    """A quarter of the first global batch: what one of 4 replicas gets, for steps run
    without a distributed dataset. (A replica given the whole global batch and the
    `global_loss` would compute a local mean: the replicas' gradients add up to N times
    plain torch's, and the DDP-loss warning says so.)"""
    x, y = global_batches(torch, 1)[0]
    return x[: GLOBAL_BATCH // 4], y[: GLOBAL_BATCH // 4]


def mlp(torch: Any) -> Any:
    """A small seeded MLP (6 -> 8 -> 3)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def identical_mlp(torch: Any) -> Any:
    """A seeded MLP whose three hidden layers are alike (6 -> 8 -> 8 -> 8 -> 8 -> 3)."""
    torch.manual_seed(0)
    layers: list[Any] = [torch.nn.Linear(6, 8), torch.nn.Tanh()]
    for _ in range(3):
        layers += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, 3))


def global_loss(torch: Any, model: Any, x: Any, y: Any) -> Any:
    """Cross entropy summed over `x` divided by the global batch: the replica's share of
    the global mean under the SUM rule, and the global mean itself on one device."""
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum") / GLOBAL_BATCH


def train_plain(torch: Any, model: Any, optimizer: Any, data: list[Any], step: Any) -> list[Any]:
    """`step(model, optimizer, x, y, i)` on each global batch, in plain torch; the start."""
    del torch
    start = [p.detach().clone() for p in model.parameters()]
    for i, (x, y) in enumerate(data):
        step(model, optimizer, x, y, i)
    return start


def standard_step(torch: Any, then: Any = None) -> Callable[..., None]:
    """A step: zero_grad, backward of `global_loss`, optimizer step, then `then(optimizer)`."""

    def step(model: Any, optimizer: Any, x: Any, y: Any, i: int) -> None:
        optimizer.zero_grad()
        global_loss(torch, model, x, y).backward()
        optimizer.step()
        if then is not None:
            then(optimizer)

    return step


def prepared_mlp(
    torch: Any, cdt: Any, make: Any, replicas: int = 4, shared: bool = True
) -> tuple[Any, Any, Any]:
    """(strategy on `replicas` CPUs, the mirrored `mlp`, its optimizer `make(parameters)`)."""
    strategy = mirrored(replicas)
    with strategy.scope():
        net = mlp(torch)
        model, optimizer = cdt.prepare(net, make(net.parameters()), share_storage=shared)
    return strategy, model, optimizer


def run_on_replicas(strategy: Any, step: Any, batches: list[Any]) -> list[Any]:
    """`strategy.run(step, (x, y, i))` on each distributed global batch; the results."""
    out = []
    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(batches)):
        out.append(strategy.run(step, args=(x, y, i)))
    return out


def assert_mlp_trains_like_plain_torch(
    torch: Any, cdt: Any, mode: str, data: list[Any], step: Any
) -> None:
    """`step(model, optimizer, x, y, i)` trains `mlp` with SGD (lr 0.5) on 4 replicas
    (`mode`: replica threads or cooperative) as plain torch does on the global batches."""
    from tests.strategies.conftest import replica_execution

    plain = mlp(torch)
    start = train_plain(torch, plain, torch.optim.SGD(plain.parameters(), lr=0.5), data, step)
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            net = mlp(torch)
            model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
        run_on_replicas(strategy, lambda x, y, i: step(model, optimizer, x, y, i), data)
    assert_trains_like(torch, plain, model, start)


def assert_trains_like(
    torch: Any, plain: Any, mirrored_model: Any, start: list[Any], tol: float = 1e-12
) -> None:
    """Replicas equal each other bitwise and plain torch's parameters within `tol`, and
    training moved them away from `start` (so the comparison says something)."""
    reference = [p.detach() for p in plain.parameters()]
    first = [p.detach() for p in mirrored_model.replicas[0].parameters()]
    for replica in mirrored_model.replicas[1:]:
        for a, b in zip(first, replica.parameters(), strict=True):
            assert torch.equal(a, b.detach()), "replicas differ"
    assert len(first) == len(reference)
    worst = max(float((a - b).abs().max()) for a, b in zip(first, reference, strict=True))
    assert worst <= tol, f"{worst} off plain torch"
    moved = max(float((a - b).abs().max()) for a, b in zip(reference, start, strict=True))
    assert moved > 1e-6, "plain torch's model never moved: nothing was compared"


def fp16_run(
    torch: Any, cdt: Any, strategy: Any, steps: int, share_storage: bool = False
) -> tuple[Any, Any, list[Any]]:
    """Train a small MLP `steps` fp16 steps with a mirrored GradScaler on `strategy` (4
    replicas in sync, 4 examples each), injecting infs: into replica 2's data at steps
    37 mod 100, and into one replica's reduced gradient at steps 71 mod 100: replica 1's
    with per-replica copies, replica 0's where storage is shared (the one step reads
    replica 0's gradients; an in-place write on another replica is an error there).
    Returns the model, the scaler and each step's per-replica scales."""
    import crossdevice as cd

    torch.manual_seed(0)
    with strategy.scope():
        net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=25)
        model, optimizer = cdt.prepare(
            net,
            torch.optim.SGD(net.parameters(), lr=0.05),
            scaler=scaler,
            mixed_precision="fp16",
            share_storage=share_storage,
        )
    injected = 0 if share_storage else 1
    data = global_batches(torch, 8)

    def step(x: Any, y: Any, i: int) -> Any:
        r = cd.get_replica_context().replica_id_in_sync_group
        if i % 100 == 37 and r == 2:
            x = x.clone()
            x[0, 0] = float("inf")  # an inf in one replica's data: its local gradient
        optimizer.zero_grad()
        scaler.scale(global_loss(torch, model, x, y)).backward()
        if i % 100 == 71 and r == injected:
            with torch.no_grad():  # an inf after the reduction, on one replica only
                model.module[0].weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        return torch.tensor(scaler.get_scale(), dtype=torch.float64)

    scales = []
    for i in range(steps):
        x, y = data[i % len(data)]
        dist = strategy.experimental_distribute_values_from_function(
            lambda ctx, x=x, y=y: (
                x[4 * ctx.replica_id_in_sync_group : 4 * ctx.replica_id_in_sync_group + 4],
                y[4 * ctx.replica_id_in_sync_group : 4 * ctx.replica_id_in_sync_group + 4],
            )
        )
        scales.append(strategy.experimental_local_results(strategy.run(step, args=(*dist, i))))
    return model, scaler, scales


def max_norm_net(torch: Any) -> Any:
    """A seeded model whose `max_norm` embedding rescales every row it looks up."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(12, 4, max_norm=0.7), torch.nn.Flatten(), torch.nn.Linear(8, 1)
    )


def max_norm_data(torch: Any, steps: int = 3) -> list[Any]:
    """Global batches of 8 (index pairs, targets) for `max_norm_net`."""
    generator = torch.Generator().manual_seed(2)
    return [
        (torch.randint(0, 12, (8, 2), generator=generator), torch.randn(8, 1, generator=generator))
        for _ in range(steps)
    ]


def max_norm_step(model: Any, optimizer: Any, x: Any, y: Any) -> None:
    """A step of `max_norm_net` whose loss is this slice's share of the global batch of 8."""
    optimizer.zero_grad()
    ((model(x) - y) ** 2).sum().div(8).backward()
    optimizer.step()


def steps_outcome(strategy: Any, step: Any, model: Any, batches: list[Any]) -> dict[str, Any]:
    """`strategy.run(step, args=(x, y, i))` over `batches` distributed, as an outcome.

    `{"params": each replica's parameters, "steps": n}`, or `{"error": "Type: text",
    "steps": n}` where a step raised (`n`: the steps that completed).
    """
    steps = 0
    try:
        for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(batches)):
            strategy.run(step, args=(x, y, i))
            steps += 1
    except Exception as err:  # the outcome, returned
        return {"error": f"{type(err).__name__}: {err}", "steps": steps}
    return {
        "params": [[p.detach().clone() for p in r.parameters()] for r in model.replicas],
        "steps": steps,
    }


def plain_sgd(
    steps: int,
    before_step: Callable[[Any, Any, int], None],
    after_step: Callable[[Any, Any, int], None] | None = None,
) -> list[Any]:
    """Plain torch's `mlp` after SGD (lr 0.5, momentum 0.9) on `global_batches`, float64.

    `before_step(torch, net, i)` runs between backward and step `i`, `after_step` after
    it (the edits the tests make inside `strategy.run`). Returns the final parameters;
    the default dtype is restored (it runs in the test's own process).
    """
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        net = mlp(torch)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
        for i, (x, y) in enumerate(global_batches(torch, steps)):
            optimizer.zero_grad()
            global_loss(torch, net, x, y).backward()
            before_step(torch, net, i)
            optimizer.step()
            if after_step is not None:
                after_step(torch, net, i)
        return [p.detach().clone() for p in net.parameters()]
    finally:
        torch.set_default_dtype(before)


def assert_replicas_like(torch: Any, params: list[list[Any]], reference: list[Any]) -> None:
    """Every replica's parameters bitwise alike and within 1e-12 of `reference`'s."""
    for replica in params:
        assert all(torch.equal(a, b) for a, b in zip(params[0], replica, strict=True))
    worst = max(float((a - b).abs().max()) for a, b in zip(params[0], reference, strict=True))
    assert worst <= 1e-12, worst
