"""Sparse-gradient training, shared by `test_sparse_gradients.py` and its worker processes.

A model mixing a sparse embedding with dense layers (`SparseNet`), per-replica slices of
seeded global batches (`slices`), one training step on a replica (`replica_step`) and the
same step in plain torch on the global batch (`plain_step`), and the worker function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.frameworks.helpers import worker_strategy

VOCAB = 12
DIM = 3
FEATURES = 4
#: Classes: 5, so that no replica's `cross_entropy(..., "sum")` has GLOBAL elements (the
#: DDP-loss warning reads a sum divided by that as a local mean).
CLASSES = 5
LOOKUPS = 2
GLOBAL = 12  # examples per global batch: 2, 3 and 4 replicas get equal slices

#: A replica's slice: (ids (b, LOOKUPS) int64, x (b, FEATURES), y (b,)).
Slice = tuple[Any, Any, Any]


def sparse_net(torch: Any, bag: bool = False, dense: bool = True) -> Any:
    """A seeded `SparseNet`: an `Embedding(sparse=True)` (or `EmbeddingBag`) and dense layers."""
    torch.manual_seed(0)
    return _net_class(torch)(bag, dense)


def _net_class(torch: Any) -> Any:
    class SparseNet(torch.nn.Module):
        """ids and features -> class logits; the lookups go through a sparse embedding.

        With dense layers, a batch with no ids (`ids.shape[1] == 0`) never calls the
        embedding: the replica's pass gives it no gradient at all. Without, the logits
        are the looked-up rows summed (no ids: an empty gradient).
        """

        def __init__(self, bag: bool, dense: bool) -> None:
            super().__init__()
            dim = DIM if dense else CLASSES
            if bag:
                self.emb: Any = torch.nn.EmbeddingBag(VOCAB, dim, mode="sum", sparse=True)
            else:
                self.emb = torch.nn.Embedding(VOCAB, dim, sparse=True)
            self.bag = bag
            if dense:
                self.hidden = torch.nn.Linear(FEATURES, DIM)
                self.out = torch.nn.Linear(DIM, CLASSES)
            self.dense = dense

        def lookup(self, ids: Any) -> Any:
            return self.emb(ids) if self.bag else self.emb(ids).sum(1)

        def forward(self, ids: Any, x: Any) -> Any:
            if not self.dense:
                return self.lookup(ids)
            h = torch.tanh(self.hidden(x))
            if ids.shape[1]:
                h = h + self.lookup(ids)
            return self.out(h)

    return SparseNet


def slices(
    torch: Any, replicas: int, steps: int, seed: int = 1, no_lookups: int | None = None
) -> list[list[Slice]]:
    """`steps` seeded global batches of GLOBAL examples, each cut into `replicas` slices.

    Ids are drawn from VOCAB, so rows repeat within and across replicas. `no_lookups`:
    at step 1 that replica's slice has no ids (its pass never calls the embedding).
    """
    generator = torch.Generator().manual_seed(seed)
    out = []
    b = GLOBAL // replicas
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (GLOBAL, LOOKUPS), generator=generator)
        x = torch.randn(GLOBAL, FEATURES, generator=generator, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (GLOBAL,), generator=generator)
        cut = [
            (ids[r * b : (r + 1) * b], x[r * b : (r + 1) * b], y[r * b : (r + 1) * b])
            for r in range(replicas)
        ]
        if step == 1 and no_lookups is not None:
            i, xs, ys = cut[no_lookups]
            cut[no_lookups] = (i[:, :0], xs, ys)
        out.append(cut)
    return out


def loss_of(torch: Any, model: Any, piece: Slice, divisor: int = GLOBAL) -> Any:
    """Cross entropy summed over `piece`, over `divisor` (the global batch: TF's SUM rule)."""
    ids, x, y = piece
    logits = model(ids, x)
    return torch.nn.functional.cross_entropy(logits, y, reduction="sum") / divisor


def halves(piece: Slice) -> list[Slice]:
    """A slice cut in two micro-batches."""
    half = len(piece[2]) // 2
    return [tuple(t[:half] for t in piece), tuple(t[half:] for t in piece)]  # type: ignore[misc]


def replica_step(
    torch: Any,
    model: Any,
    optimizers: list[Any],
    piece: Slice,
    passes: str = "one",
    set_to_none: bool = True,
    divisor: int = GLOBAL,
) -> None:
    """One step on a replica's slice. `passes`: "one" backward; "two" (each reduced);
    "no_sync" (the first micro-batch accumulated inside `model.no_sync()`)."""
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=set_to_none)
    if passes == "one":
        loss_of(torch, model, piece, divisor).backward()
    else:
        first, second = halves(piece)
        if passes == "no_sync":
            with model.no_sync():
                loss_of(torch, model, first, divisor).backward()
        else:
            loss_of(torch, model, first, divisor).backward()
        loss_of(torch, model, second, divisor).backward()
    for optimizer in optimizers:
        optimizer.step()


def plain_step(
    torch: Any,
    model: Any,
    optimizers: list[Any],
    pieces: list[Slice],
    passes: str = "one",
    set_to_none: bool = True,
) -> None:
    """The step in plain torch on the global batch (every replica's slice, in order)."""
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=set_to_none)
    if passes == "one":
        sum(loss_of(torch, model, p) for p in pieces).backward()
    else:
        parts = [halves(p) for p in pieces]
        for k in range(2):
            sum(loss_of(torch, model, p[k]) for p in parts).backward()
    for optimizer in optimizers:
        optimizer.step()


def optimizers_for(torch: Any, kind: str, net: Any) -> list[Any]:
    """The optimizers of a test: "sgd" and "adagrad" over every parameter (one group for
    the embedding, one for the dense layers), "sparse_adam" for the embedding with Adam for
    the dense layers."""
    emb = list(net.emb.parameters())
    dense = [p for n, p in net.named_parameters() if not n.startswith("emb.")]
    if kind == "sgd":
        return [torch.optim.SGD([{"params": emb, "lr": 0.3}, {"params": dense}], lr=0.1)]
    if kind == "adagrad":
        return [torch.optim.Adagrad([{"params": emb}, {"params": dense, "lr": 0.05}], lr=0.2)]
    assert kind == "sparse_adam"
    out = [torch.optim.SparseAdam(emb, lr=0.05)]
    return out + ([torch.optim.Adam(dense, lr=0.02)] if dense else [])


def run_replicas(
    strategy: Any, data: list[list[Slice]], step: Callable[[Slice, int], None]
) -> None:
    """`step(replica's slice, step index)` on every replica, for each global batch."""
    for i, pieces in enumerate(data):
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx, pieces=pieces: pieces[ctx.replica_id_in_sync_group]
        )
        strategy.run(lambda piece, i=i: step(piece, i), args=(values,))


def sparse_training(rank: int, world_size: int, replicas: int, steps: int) -> dict[str, Any]:
    """`world_size` workers x `replicas` train `sparse_net` with SparseAdam and Adam (float64),
    each dense parameter a gradient bucket of its own (across workers with one replica
    each, the pass's buckets go as one all-reduce from the second pass on).

    Step 1: the last replica's slice has no ids; step 2: two backward passes, the first
    inside `no_sync`; the others one pass. Returns every local replica's parameters and
    embedding gradient (dense).
    """
    del rank
    import torch

    import crossdevice.torch as cdt

    torch.set_default_dtype(torch.float64)
    strategy = worker_strategy(replicas)
    total = world_size * replicas
    with strategy.scope():
        net = sparse_net(torch)
        optimizers = optimizers_for(torch, "sparse_adam", net)
        prepared = cdt.prepare(net, *optimizers, bucket_cap_bytes=64)
    model, optimizers = prepared[0], list(prepared[1:])
    data = slices(torch, total, steps, no_lookups=total - 1)

    def step(piece: Slice, i: int) -> None:
        replica_step(torch, model, optimizers, piece, passes="no_sync" if i == 2 else "one")

    run_replicas(strategy, data, step)
    return {
        "params": [[p.detach().numpy() for p in r.parameters()] for r in model.replicas],
        "grads": [r.emb.weight.grad.to_dense().numpy() for r in model.replicas],
    }


def plain_training(torch: Any, world_size: int, replicas: int, steps: int) -> list[Any]:
    """What `sparse_training` trains, in plain torch on the global batches."""
    total = world_size * replicas
    net = sparse_net(torch)
    optimizers = optimizers_for(torch, "sparse_adam", net)
    for i, pieces in enumerate(slices(torch, total, steps, no_lookups=total - 1)):
        plain_step(torch, net, optimizers, pieces, passes="two" if i == 2 else "one")
    return [p.detach().numpy() for p in net.parameters()]
