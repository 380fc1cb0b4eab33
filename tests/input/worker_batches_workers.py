"""Worker side of `test_worker_batches.py`: each worker's input to experimental_distribute_dataset.

Each worker trains a prepared `Linear(3, 1)` (float64, SGD) on the global batches of
ids its input gives, and returns what it trained on (its replicas' slices of each
step), the parameters it ended with, and the error its steps raised, if any.
"""

from __future__ import annotations

from typing import Any

#: Examples in the dataset, and the global batch size.
N = 24
BATCH = 4
#: Seconds every collective may wait (a hang shows as this, not as the harness's).
TIMEOUT = 15.0


def problem() -> tuple[Any, Any, Any]:
    """(features, targets, the untrained Linear): the same in every process."""
    import torch

    generator = torch.Generator().manual_seed(0)
    features = torch.randn(N, 3, dtype=torch.float64, generator=generator)
    targets = torch.randn(N, dtype=torch.float64, generator=generator)
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1).double()
    return features, targets, net


def _input(kind: str, rank: int, world: int) -> Any:
    """The iterable of global batches (of ids) this worker passes, by `kind`."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    ids = TensorDataset(torch.arange(N))
    if kind == "same_shuffle":  # every worker the same seeded order: right
        generator = torch.Generator().manual_seed(7)
        return DataLoader(ids, batch_size=BATCH, shuffle=True, generator=generator)
    if kind == "rank_shuffle":  # a shuffle seeded by rank
        generator = torch.Generator().manual_seed(rank)
        return DataLoader(ids, batch_size=BATCH, shuffle=True, generator=generator)
    if kind == "shards":  # each worker its own shard, of equal length: a list
        own = torch.arange(N)[rank::world]
        return [own[i : i + BATCH] for i in range(0, len(own), BATCH)]
    if kind == "diverging":  # a list, alike for 2 steps, then each worker's own batches
        alike = [torch.arange(i, i + BATCH) for i in range(0, 2 * BATCH, BATCH)]
        own = torch.arange(2 * BATCH, N)[rank::world]
        return alike + [own[i : i + BATCH] for i in range(0, len(own), BATCH)]
    if kind == "sampler":
        sampler = DistributedSampler(ids, world, rank, shuffle=False)
        return DataLoader(ids, batch_size=BATCH, sampler=sampler)
    raise ValueError(f"expected a kind of input, got {kind!r}")


def train(rank: int, world: int, kind: str, replicas: int) -> dict[str, Any]:
    """Train on `kind`'s input; also try a DistributedSampler first (refused at once)."""
    import torch

    import crossdevice as cd
    import crossdevice.torch as cdt

    if replicas > 1:
        cd.config.set_logical_cpu_devices(replicas)
    options = cd.experimental.CommunicationOptions(timeout_seconds=TIMEOUT)
    strategy = cd.MultiWorkerMirroredStrategy(
        devices=[f"CPU:{i}" for i in range(replicas)], communication_options=options
    )
    features, targets, net = problem()
    with strategy.scope():
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    out: dict[str, Any] = {"steps": [], "error": None, "refused": None}
    try:
        strategy.experimental_distribute_dataset(_input("sampler", rank, world))
    except ValueError as err:
        out["refused"] = str(err)

    def step(ids: Any) -> Any:
        ids = ids[0] if isinstance(ids, list | tuple) else ids
        per_example = (model(features[ids]).squeeze(1) - targets[ids]) ** 2
        loss = cdt.compute_average_loss(per_example, global_batch_size=BATCH)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return ids

    try:
        for batch in strategy.experimental_distribute_dataset(_input(kind, rank, world)):
            done = strategy.run(step, args=(batch,))
            out["steps"].append([x.tolist() for x in strategy.experimental_local_results(done)])
    except Exception as err:  # what the test checks: type and words
        out["error"] = (type(err).__name__, str(err))
    out["params"] = [p.detach().reshape(-1).tolist() for p in net.parameters()]
    return out
