"""What the workers of the `scale_grad_by_freq` tests run (`test_embedding_frequencies`)."""

from __future__ import annotations

from typing import Any

from tests.frameworks.helpers import worker_strategy


def frequency_net(torch: Any, reference: bool = False) -> Any:
    """A seeded model of every lookup that scales gradients by frequency.

    `Embedding` (with a padding row), `EmbeddingBag` in modes "mean" and "sum" (with
    per-sample weights) and `F.embedding` on a plain weight. (torch refuses the option
    with sparse gradients, and `EmbeddingBag` refuses it in mode "max".)

    `reference`: the bags computed by `F.embedding` from the same weights, for plain
    torch's run: torch 2.13's CPU kernel for `EmbeddingBag` divides a row's gradient by
    the count of another row when a row that occurs once sorts after a repeated one
    (pytorch/pytorch#190063); `Embedding`'s kernel divides by the right counts.
    """
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            nn = torch.nn
            self.emb = nn.Embedding(9, 3, padding_idx=0, scale_grad_by_freq=True)
            self.mean = nn.EmbeddingBag(9, 3, mode="mean", scale_grad_by_freq=True)
            self.sum = nn.EmbeddingBag(9, 3, mode="sum", scale_grad_by_freq=True)
            self.table = nn.Parameter(torch.randn(9, 3))
            self.head = nn.Linear(12, 1)

        def forward(self, x: Any) -> Any:
            weights = 0.5 + x.to(torch.get_default_dtype()) / 4  # per example, not per slice
            look = torch.nn.functional.embedding
            f = look(x, self.table, scale_grad_by_freq=True)
            if reference:
                mean = look(x, self.mean.weight, scale_grad_by_freq=True).mean(1)
                sum_ = look(x, self.sum.weight, scale_grad_by_freq=True)
                sum_ = (sum_ * weights.unsqueeze(2)).sum(1)
            else:
                mean, sum_ = self.mean(x), self.sum(x, per_sample_weights=weights)
            parts = [self.emb(x).sum(1), mean, sum_, f.sum(1)]
            return self.head(torch.cat(parts, 1))

    return Net()


#: The global batch: 12 examples (2, 3 or 4 replicas, or 2 workers, split it evenly).
GLOBAL_BATCH = 12


def frequency_data(torch: Any, steps: int = 3) -> list[Any]:
    """Global batches of index rows, few rows often repeated across the slices."""
    generator = torch.Generator().manual_seed(4)
    return [
        (
            torch.randint(0, 5, (GLOBAL_BATCH, 4), generator=generator),
            torch.randn(GLOBAL_BATCH, 1, generator=generator),
        )
        for _ in range(steps)
    ]


def frequency_step(model: Any, optimizer: Any, x: Any, y: Any) -> None:
    """A step whose loss is this slice's share of the global batch (TF's SUM rule)."""
    optimizer.zero_grad()
    ((model(x) - y) ** 2).sum().div(GLOBAL_BATCH).backward()
    optimizer.step()


def frequency_training(rank: int, world_size: int, replicas: int) -> list[Any]:
    """`frequency_net` trained on `frequency_data` by this worker's `replicas` (float64)."""
    del rank, world_size
    import torch

    import crossdevice.torch as cdt

    torch.set_default_dtype(torch.float64)
    strategy = worker_strategy(replicas)
    with strategy.scope():
        net = frequency_net(torch)
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.2))
    for batch in strategy.experimental_distribute_dataset(frequency_data(torch)):
        strategy.run(lambda b: frequency_step(model, optimizer, *b), args=(batch,))
    return [[p.detach().numpy() for p in r.parameters()] for r in model.replicas]
