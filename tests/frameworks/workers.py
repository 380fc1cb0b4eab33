"""Functions the multi-worker training tests run in each worker process."""

from __future__ import annotations

import time
from typing import Any

from tests.frameworks.helpers import load_example, worker_strategy


def train_example(rank: int, world_size: int, argv: list[str]) -> dict[str, Any]:
    """Run examples/custom_training_loop.py in this worker; return its result."""
    del rank, world_size
    out = load_example("custom_training_loop").main(argv)
    return {k: out[k] for k in ("params", "replica_params", "test_accuracy", "steps")}


def fp16_training(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """2 local replicas of a MultiWorkerMirroredStrategy train `fp16_run`'s model."""
    del rank, world_size
    import torch

    import crossdevice
    import crossdevice.torch
    from tests.frameworks.helpers import fp16_run

    crossdevice.config.set_logical_cpu_devices(2)
    strategy = crossdevice.MultiWorkerMirroredStrategy(devices=["CPU:0", "CPU:1"])
    model, _, scales = fp16_run(torch, crossdevice.torch, strategy, steps)
    first = [float(s[0]) for s in scales]
    return {
        "scales": [[float(x) for x in s] for s in scales],
        "backoffs": sum(1 for i in range(1, steps) if first[i] < first[i - 1]),
        "params": [p.detach().numpy() for r in model.replicas for p in r.parameters()],
    }


def bucket_training(
    rank: int, world_size: int, op: str, flat: bool, steps: int, queued: bool = False
) -> list[Any]:
    """One replica per worker trains `mlp` in float64, three gradient buckets
    ([b2, W2], [b1], [W1]).

    Each step accumulates two micro-batches (the first inside `no_sync`) and clears the
    gradients in place on odd steps (`zero_grad(set_to_none=False)`), so reduced parts
    are taken out and added back. `flat=False` takes `ReplicaContext.all_reduce`'s path
    (what every bucket took before buckets were reduced where they lie). `queued`: every
    bucket issued on the communicator's queue thread (`queue_min_bytes=0`), else every
    one from the hook; checked to have been (through shared memory: the hook either
    way). Returns the final parameters.
    """
    del rank, world_size
    import torch

    import crossdevice
    import crossdevice.torch as cdt
    from crossdevice._core import tuning
    from tests.comm.peers import apply_tuning
    from tests.frameworks.helpers import GLOBAL_BATCH, global_batches, mlp

    apply_tuning()
    tuning.set_tuning(queue_min_bytes=0 if queued else 1 << 62)
    torch.set_default_dtype(torch.float64)
    strategy = crossdevice.MultiWorkerMirroredStrategy()
    with strategy.scope():
        net = mlp(torch)
        sgd = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
        model, optimizer = cdt.prepare(net, sgd, gradient_reduction=op, bucket_cap_bytes=256)
    if not flat:
        model.__dict__["_gradients"]._flat = False
    divisor = GLOBAL_BATCH if op == "sum" else GLOBAL_BATCH // strategy.num_replicas_in_sync

    def step(x: Any, y: Any, i: int) -> None:
        optimizer.zero_grad(set_to_none=i % 2 == 0)
        half = x.shape[0] // 2
        with model.no_sync():
            (
                torch.nn.functional.cross_entropy(model(x[:half]), y[:half], reduction="sum")
                / divisor
            ).backward()
        (
            torch.nn.functional.cross_entropy(model(x[half:]), y[half:], reduction="sum") / divisor
        ).backward()
        optimizer.step()

    for i, (x, y) in enumerate(
        strategy.experimental_distribute_dataset(global_batches(torch, steps))
    ):
        strategy.run(step, args=(x, y, i))
    communicator = strategy.extended._worker_communicator
    used = communicator._sequencer.queue is not None
    # Buckets that travel through shared memory are issued by the hook all the same.
    expected = queued and communicator.shared_memory is None
    assert used == expected, f"the queue thread was {'' if used else 'not '}used"
    return [p.detach().numpy() for p in model.module.parameters()]


def identical_layers(rank: int, world_size: int, steps: int, epochs: int = 1) -> dict[str, Any]:
    """One replica per worker trains, in float64, a net whose three hidden layers are
    alike (8 -> 8), one gradient bucket each: buckets of one layout and signature, in a
    row; `epochs` passes over `steps` global batches (each pass's first step agrees on
    its length). Returns the final parameters, and the predictor's misses and guesses so
    far after each step."""
    del rank, world_size
    import torch

    import crossdevice
    import crossdevice.torch as cdt
    from tests.comm.peers import apply_tuning
    from tests.frameworks.helpers import GLOBAL_BATCH, global_batches, identical_mlp

    apply_tuning()
    torch.set_default_dtype(torch.float64)
    strategy = crossdevice.MultiWorkerMirroredStrategy()
    with strategy.scope():
        net = identical_mlp(torch)
        sgd = torch.optim.SGD(net.parameters(), lr=0.5)
        model, optimizer = cdt.prepare(net, sgd, bucket_cap_bytes=8 * 72)
    predictor = strategy.extended._worker_communicator._integrity.predictor
    misses, guesses = [], []

    def step(x: Any, y: Any) -> None:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum") / GLOBAL_BATCH
        loss.backward()
        optimizer.step()

    dataset = strategy.experimental_distribute_dataset(global_batches(torch, steps))
    for _ in range(epochs):
        for x, y in dataset:
            strategy.run(step, args=(x, y))
            misses.append(predictor.misses)
            guesses.append(predictor.guesses)
    sizes = [layout.sizes for layout in model.__dict__["_gradients"]._layouts.values()]
    return {
        "params": [p.detach().numpy() for p in model.module.parameters()],
        "misses": misses,
        "guesses": guesses,
        "buckets": sizes,
    }


def compressed_gradients_of_mixed_rules(rank: int, world_size: int) -> None:
    """Worker 0 SUMs, worker 1 averages, with bf16 gradients.

    `prepare` refuses different `gradient_reduction`s itself (it compares its options);
    worker 1's rule is changed after it, so that the collective's own check is what
    meets the difference.
    """
    del world_size
    import torch

    import crossdevice
    import crossdevice.torch as cdt

    torch.manual_seed(0)
    strategy = crossdevice.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = cdt.prepare(torch.nn.Linear(8, 4), gradient_dtype=torch.bfloat16)
    if rank == 1:
        model.__dict__["_gradients"]._op = crossdevice.ReduceOp.MEAN
    strategy.run(lambda: model(torch.ones(2, 8)).sum().backward())


def compressed_gradients(rank: int, world_size: int, dtype: str = "float32") -> dict[str, Any]:
    """One backward of a linear model of `dtype` with `gradient_dtype=torch.bfloat16`.

    Returns this worker's own gradient (a plain copy of the model on its slice, as float32)
    and the reduced gradient every worker gets (as float32).
    """
    import torch

    import crossdevice
    import crossdevice.torch as cdt

    torch.manual_seed(0)
    net = torch.nn.Linear(64, 32).to(getattr(torch, dtype))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank + 1)).to(net.weight)
    plain = torch.nn.Linear(64, 32).to(net.weight)
    plain.load_state_dict(net.state_dict())
    plain(x).square().sum().backward()
    strategy = crossdevice.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = cdt.prepare(net, gradient_dtype=torch.bfloat16)

    def step() -> Any:
        model(x).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    reduced = strategy.run(step)
    return {
        "local": [p.grad.float().numpy() for p in plain.parameters()],
        "reduced": [g.float().numpy() for g in reduced],
        "dtype": str(reduced[0].dtype),
    }


def bucket_views(rank: int, world_size: int) -> dict[str, Any]:
    """Two steps of one bucket on one replica per worker: what `.grad` lies in."""
    del world_size
    import torch

    import crossdevice
    import crossdevice.torch as cdt
    from tests.frameworks.helpers import mlp

    strategy = crossdevice.MultiWorkerMirroredStrategy()
    with strategy.scope():
        net = mlp(torch)
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.full((4, 6), float(rank + 1))

    def step() -> list[Any]:
        optimizer.zero_grad()
        model(x).sum().backward()
        grads = [p.grad for p in model.parameters()]
        optimizer.step()
        return grads

    first = strategy.run(step)
    kept = [g.clone() for g in first]
    second = strategy.run(step)
    return {
        "storages": [{g.untyped_storage().data_ptr() for g in gs} for gs in (first, second)],
        "first_unchanged": all(torch.equal(a, b) for a, b in zip(first, kept, strict=True)),
    }


def bucket_reuse(rank: int, world_size: int) -> dict[str, Any]:
    """Steps that keep no gradient: the host buffers each new one takes, after two steps.

    `zero_grad()` drops the last step's `.grad` views, so the strategy's buffers (the
    bucket's pack, its reduced output) are free again by the next step's all-reduce.
    """
    del world_size
    import numpy as np
    import torch

    import crossdevice
    import crossdevice.torch as cdt
    from crossdevice._arrays import buffer_pool
    from tests.comm.peers import apply_tuning
    from tests.frameworks.helpers import mlp

    apply_tuning()
    fresh: list[int] = []
    take = buffer_pool.BufferPool.take

    def counted(pool: Any, dtype: Any, length: int) -> Any:
        known = {id(b) for b in pool._buffers.get((np.dtype(dtype), int(length)), [])}
        buf = take(pool, dtype, length)
        if id(buf) not in known:
            fresh.append(int(length))
        return buf

    buffer_pool.BufferPool.take = counted  # type: ignore[method-assign]
    strategy = crossdevice.MultiWorkerMirroredStrategy()
    with strategy.scope():
        net = mlp(torch)
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.full((4, 6), float(rank + 1))

    def step() -> None:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    for _ in range(2):
        strategy.run(step)
    fresh.clear()
    for _ in range(6):
        strategy.run(step)
    return {"fresh": fresh}


def resized_bucket(rank: int, world_size: int) -> dict[str, Any]:
    """A step, then the hidden layer of `mlp` widened from 8 to 10 units outside
    `strategy.run` (`.data` replaced, as model-surgery code does), then another step:
    each step's reduced gradients next to plain torch's sum over both workers' inputs."""
    del world_size
    import copy

    import torch

    import crossdevice
    import crossdevice.torch as cdt
    from tests.frameworks.helpers import mlp

    strategy = crossdevice.MultiWorkerMirroredStrategy()
    with strategy.scope():
        net = mlp(torch)
        model = cdt.prepare(net)
    inputs = [torch.full((4, 6), float(r + 1)) for r in range(2)]

    def step() -> list[Any]:
        model.zero_grad()
        model(inputs[rank]).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    def plain() -> list[Any]:
        copied = copy.deepcopy(net)
        for x in inputs:
            copied(x).sum().backward()
        return [p.grad for p in copied.parameters()]

    results = []
    for widen in (False, True):
        if widen:
            with torch.no_grad():
                first, second = net[0], net[2]
                first.weight.data = torch.cat([first.weight, torch.full((2, 6), 0.1)])
                first.bias.data = torch.cat([first.bias, torch.zeros(2)])
                second.weight.data = torch.cat([second.weight, torch.full((3, 2), 0.1)], dim=1)
        reduced = strategy.run(step)
        expected = plain()
        results.append(
            {
                "shapes": [tuple(g.shape) for g in reduced],
                "expected_shapes": [tuple(g.shape) for g in expected],
                "worst": max(
                    float((a - b).abs().max()) for a, b in zip(reduced, expected, strict=True)
                ),
            }
        )
    return {"steps": results}


def _failure(fn: Any) -> dict[str, Any] | None:
    try:
        fn()
    except Exception as e:  # what the test compares: the type and the text
        return {"type": type(e).__name__, "message": str(e)}
    return None


def skipped_step(rank: int, world_size: int, skipper: int, replicas: int) -> dict[str, Any]:
    """Worker `skipper` skips `optimizer.step()` at step 1; where each worker fails."""
    del world_size
    import torch

    import crossdevice.torch as cdt
    from tests.frameworks.helpers import mlp

    strategy = worker_strategy(replicas)
    with strategy.scope():
        net = mlp(torch)
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.full((4, 6), float(rank + 1))

    def step(k: int) -> None:
        optimizer.zero_grad()
        model(x).sum().backward()
        if k != 1 or rank != skipper:  # e.g. `if torch.isfinite(local_loss): opt.step()`
            optimizer.step()

    for k in range(4):
        failure = _failure(lambda k=k: strategy.run(step, args=(k,)))
        if failure is not None:
            return {"step": k, **failure}
    return {"step": None}


def different_setups(
    rank: int, world_size: int, what: str, replicas: int = 1
) -> dict[str, Any] | None:
    """Worker 1 builds another model or optimizer, or passes `prepare` a bad argument
    (`what`); what `prepare` raises."""
    del world_size
    import torch

    import crossdevice.torch as cdt

    strategy = worker_strategy(replicas)
    odd = rank == 1
    torch.manual_seed(0)
    with strategy.scope():
        width = 9 if odd and what == "shape" else 8
        net = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Linear(width, 3))
        if what == "buffer" and odd:
            net.append(torch.nn.BatchNorm1d(3))
        elif what == "buffer":
            net.append(torch.nn.LayerNorm(3))
        lr = 0.2 if odd and what == "lr" else 0.1
        kind = torch.optim.AdamW if odd and what == "class" else torch.optim.Adam
        optimizer = kind(net.parameters(), lr=lr)
        if odd and what == "frozen":
            net[0].bias.requires_grad_(False)
        cap = 1024 if odd and what == "bucket" else None
        precision = "fp8" if odd and what == "argument" else None  # refused on worker 1
        return _failure(
            lambda: cdt.prepare(net, optimizer, mixed_precision=precision, bucket_cap_bytes=cap)
        )


def batch_sizes(
    rank: int, world_size: int, sizes: list[int], last: list[int] | None = None
) -> dict[str, Any]:
    """Worker `rank` reads 10 examples in global batches of `sizes[rank]` (its last one
    of `last[rank]` examples instead, if given), each step an all-reduce; how it ends."""
    del world_size
    import numpy as np

    import crossdevice

    strategy = worker_strategy(1)
    data = np.arange(10.0)
    size = sizes[rank]
    batches = [data[i : i + size] for i in range(0, 10, size)]
    if last is not None:
        batches[-1] = np.arange(float(last[rank]))
    seen: list[float] = []

    def step(v: Any) -> Any:
        return crossdevice.get_replica_context().all_reduce("sum", np.sum(v))

    def epoch() -> None:
        for x in strategy.experimental_distribute_dataset(batches):
            seen.append(float(strategy.run(step, args=(x,))))

    return {"failure": _failure(epoch), "steps": len(seen)}


def max_norm_embedding(rank: int, world_size: int) -> list[Any]:
    """A `max_norm` embedding trained 3 steps on global batches of 8 (float64)."""
    del rank, world_size
    import torch

    import crossdevice.torch as cdt
    from tests.frameworks.helpers import max_norm_data, max_norm_net, max_norm_step

    torch.set_default_dtype(torch.float64)
    strategy = worker_strategy(1)
    with strategy.scope():
        net = max_norm_net(torch)
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for batch in strategy.experimental_distribute_dataset(max_norm_data(torch)):
        strategy.run(lambda b: max_norm_step(model, optimizer, *b), args=(batch,))
    return [p.detach().numpy() for p in model.parameters()]


def queued_failure(rank: int, world_size: int) -> dict[str, Any]:
    """Every bucket queued (`queue_min_bytes=0`, 4 buckets); at the third step rank 1's
    backward raises in the first layer, after the later layers' buckets were queued (on
    Gloo, after the pass's all-reduce sent its first buckets: `pass_reduce.py`). The
    health board looks every 3 s (`poll_seconds`): data that completed the peer's
    all-reduce before that (zeros for the buckets that never came) would be summed.
    Each worker's outcome of that step and how long it took (`timed_outcome`)."""
    del world_size
    import torch

    import crossdevice
    import crossdevice.torch as cdt
    from crossdevice._core import tuning
    from tests.comm.peers import timed_outcome
    from tests.frameworks.helpers import mlp

    tuning.set_tuning(queue_min_bytes=0, poll_seconds=3.0)
    strategy = crossdevice.MultiWorkerMirroredStrategy()
    with strategy.scope():
        net = mlp(torch)
        model, optimizer = cdt.prepare(
            net, torch.optim.SGD(net.parameters(), lr=0.1), bucket_cap_bytes=64
        )
    x = torch.full((4, 6), float(rank + 1))

    def step(fails: bool) -> None:
        optimizer.zero_grad()
        layers = model.module
        hidden = layers[0](x)
        if fails:

            def fail(grad: Any) -> Any:
                raise ValueError("bad batch")

            hidden.register_hook(fail)
        layers[2](layers[1](hidden)).sum().backward()
        optimizer.step()

    for _ in range(2):  # the buckets' layouts are learnt first
        strategy.run(step, args=(False,))
    queue = strategy.extended._worker_communicator._sequencer.queue
    assert queue is not None, "not queued"
    out = timed_outcome(lambda: strategy.run(step, args=(rank == 1,)))
    # The pass's all-reduce, filled as buckets complete, does not keep waiting for the
    # buckets a raising backward never completes (`PassReduce.abandon`).
    deadline = time.monotonic() + 5.0
    while not queue.idle and time.monotonic() < deadline:
        time.sleep(0.01)
    out["queue_idle"] = queue.idle
    return out


def chained_models(rank: int, world_size: int, steps: int) -> list[Any]:
    """Two prepared models, `inner` prepared first and `outer` applied to its output,
    several buckets each; `outer` has a layer no step uses, so one of its buckets is
    complete only when the pass returns. Backward reaches `outer`'s buckets first, so its
    pass's all-reduce is queued before `inner`'s and waits there for that last bucket:
    every module's last buckets must go before any pass waits. Float64, SGD; returns
    both models' final parameters (inner's, then outer's)."""
    del rank, world_size
    import torch

    import crossdevice
    import crossdevice.torch as cdt
    from tests.frameworks.helpers import GLOBAL_BATCH, global_batches

    torch.set_default_dtype(torch.float64)
    options = crossdevice.experimental.CommunicationOptions(timeout_seconds=20.0)
    strategy = crossdevice.MultiWorkerMirroredStrategy(communication_options=options)
    with strategy.scope():
        inner_net, outer_net = chained_nets(torch)
        params = [*inner_net.parameters(), *outer_net.parameters()]
        sgd = torch.optim.SGD(params, lr=0.5)
        inner, outer, optimizer = cdt.prepare(inner_net, outer_net, sgd, bucket_cap_bytes=256)

    def step(x: Any, y: Any) -> None:
        optimizer.zero_grad()
        logits = outer[3](outer[2](outer[1](inner(x))))
        (torch.nn.functional.cross_entropy(logits, y, reduction="sum") / GLOBAL_BATCH).backward()
        optimizer.step()

    for x, y in strategy.experimental_distribute_dataset(global_batches(torch, steps)):
        strategy.run(step, args=(x, y))
    return [p.detach().numpy() for p in [*inner.parameters(), *outer.parameters()]]


def chained_nets(torch: Any) -> tuple[Any, Any]:
    """`chained_models`' seeded nets: inner 6 -> 8 -> 8, outer 8 -> 8 -> 3 (and an unused
    3 -> 3, its first layer)."""
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    # Registered first, reduced last: the unused layer's bucket is outer's last.
    outer = torch.nn.Sequential(
        torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
    )
    return inner, outer


def collectives_in_backward(rank: int, world_size: int, steps: int, late: bool) -> dict[str, Any]:
    """A model whose backward starts collectives of its own: a SyncBatchNorm between two
    linear layers (its statistics' all-reduces are differentiable), several buckets,
    float64, SGD. `late=False`: in every step, so the buckets keep going one by one
    (`pass_reduce.py`). `late=True`: a plain BatchNorm's statistics until the third step,
    the synchronised ones from then on, so that step's backward starts a collective after
    its first bucket left as part of one all-reduce per pass. Returns the final
    parameters (or, late, that step's outcome) and whether the passes went as one."""
    del rank, world_size
    import torch

    import crossdevice
    import crossdevice.torch as cdt
    from tests.comm.peers import timed_outcome
    from tests.frameworks.helpers import GLOBAL_BATCH, global_batches

    torch.set_default_dtype(torch.float64)
    options = crossdevice.experimental.CommunicationOptions(timeout_seconds=20.0)
    strategy = crossdevice.MultiWorkerMirroredStrategy(communication_options=options)
    with strategy.scope():
        net = norm_net(torch, cdt.SyncBatchNorm(8))
        sgd = torch.optim.SGD(net.parameters(), lr=0.5)
        model, optimizer = cdt.prepare(net, sgd, bucket_cap_bytes=256)

    def step(x: Any, y: Any, synchronised: bool) -> None:
        optimizer.zero_grad()
        layers = model.module
        hidden = layers[0](x)
        if synchronised:
            hidden = layers[1](hidden)
        else:  # the same affine parameters, this worker's own statistics
            hidden = torch.nn.functional.batch_norm(
                hidden, None, None, layers[1].weight, layers[1].bias, training=True
            )
        logits = layers[3](layers[2](hidden))
        (torch.nn.functional.cross_entropy(logits, y, reduction="sum") / GLOBAL_BATCH).backward()
        optimizer.step()

    batches = strategy.experimental_distribute_dataset(global_batches(torch, steps))
    out: dict[str, Any] = {}
    for i, (x, y) in enumerate(batches):
        synchronised = not late or i >= 2
        if late and i == 2:
            out.update(timed_outcome(lambda x=x, y=y: strategy.run(step, args=(x, y, True))))
            break
        strategy.run(step, args=(x, y, synchronised))
    out["passes"] = model.__dict__["_gradients"]._passes
    out["params"] = [p.detach().numpy() for p in model.parameters()]
    return out


def norm_net(torch: Any, norm: Any) -> Any:
    """`collectives_in_backward`'s seeded net: 6 -> 8, `norm`, tanh, 8 -> 3."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), norm, torch.nn.Tanh(), torch.nn.Linear(8, 3))


def failed_forward(rank: int, world_size: int, replicas: int) -> dict[str, Any] | None:
    """BatchNorm on `replicas` local replicas; at step 1 worker 1's last replica raises
    ValueError before its forward while its others update BatchNorm and wait to combine.
    What `strategy.run` raised: type, message and the exception it was raised during
    the handling of (None: none)."""
    del world_size
    import torch

    import crossdevice as cd
    import crossdevice.torch as cdt

    strategy = worker_strategy(replicas)
    torch.manual_seed(0)
    with strategy.scope():
        net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
        )
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = torch.randn(8 * replicas, 4), torch.randint(0, 2, (8 * replicas,))

    def step(k: int) -> None:
        ctx = cd.get_replica_context()
        if rank == 1 and k == 1 and ctx.replica_id_in_sync_group % replicas == replicas - 1:
            raise ValueError("user error in step on worker 1")
        index = ctx.replica_id_in_sync_group % replicas
        xb, yb = x[index::replicas], y[index::replicas]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()

    for k in range(3):
        try:
            strategy.run(step, args=(k,))
        except Exception as e:  # what the test compares: the type, text and context
            context = e.__context__
            return {
                "type": type(e).__name__,
                "message": str(e),
                "context": None if context is None else type(context).__name__,
            }
    return None
