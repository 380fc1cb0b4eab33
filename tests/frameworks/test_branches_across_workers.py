"""A parameter that one worker's replicas leave unused in a step trains like plain torch.

Data-dependent control flow (a branch, a routed expert) can leave a layer without a
gradient on some workers only. Its bucket is then issued at the end of the backward pass
on those workers and from a backward hook on the others: the workers compared the call
sites found by walking the stack, torch's own frames in each case, and stopped with a
false `CollectiveMismatchError`. The gradient buckets now carry one fixed site.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.frameworks.branch_workers import (
    PER_REPLICA,
    STEPS,
    batches,
    branch_net,
    branch_training,
    skips,
)
from tests.multi_worker.harness import run_workers

pytestmark = [pytest.mark.multiprocess]


def _plain(torch: Any, replicas: int, workers: int) -> list[Any]:
    """Plain torch on the global batches, each replica's slice through its own path."""
    torch.set_default_dtype(torch.float64)
    try:
        net = branch_net(torch)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.3, momentum=0.5)
        global_batch = PER_REPLICA * replicas * workers
        for k, (x, y) in enumerate(batches(torch, global_batch)):
            loss = 0
            for g in range(replicas * workers):
                part = slice(g * PER_REPLICA, (g + 1) * PER_REPLICA)
                out = net(x[part], skips(k, g // replicas))
                loss = loss + torch.nn.functional.cross_entropy(out, y[part], reduction="sum")
            optimizer.zero_grad()
            (loss / global_batch).backward()
            optimizer.step()
        return [p.detach().numpy() for p in net.parameters()]
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize(
    ("replicas", "env"),
    [(1, {}), (1, {"CROSSDEVICE_SHARED_MEMORY": "0"}), (2, {})],
    ids=["1-replica", "1-replica-gloo", "2-replicas"],
)
def test_a_layer_one_worker_skips_trains_like_plain_torch(
    torch_module: Any, replicas: int, env: dict[str, str]
) -> None:
    assert STEPS > 2
    expected = _plain(torch_module, replicas, 2)
    results = run_workers(branch_training, 2, args=(replicas,), env=env, timeout=120)
    for result in results:
        for got, want in zip(result.unwrap(), expected, strict=True):
            assert np.max(np.abs(got - want)) <= 1e-12
