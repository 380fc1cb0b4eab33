"""Workers that iterate different global batches through experimental_distribute_dataset.

The bug hunt (58, finding 1): each worker keeps its own replicas' slices of the global
batch *it* read, so a DDP habit (a DataLoader with a DistributedSampler, each worker's
shard as a list, a shuffle seeded by rank) trained 12 of 23 examples per epoch and never
the rest, silently. Every step the workers now compare a digest of their global batches
in a collective the step makes anyway: the has-data agreement, or, where that is skipped
(a list's exact length), the state of the step's next collective. A difference is an
error on every worker before the step combines anything; a DistributedSampler is refused
at once. The same seeded shuffle on every worker still trains as plain torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from crossdevice._comm.workers.has_data import different_batches
from crossdevice._core.errors import CollectiveMismatchError
from crossdevice._input.batch_digest import batch_digest
from crossdevice._input.batching import last_split, split_batch_leaves
from tests.input.worker_batches_workers import problem, train
from tests.multi_worker.harness import run_workers

#: (local replicas, environment) of each run: shared memory on and off.
SETUPS = [
    pytest.param(1, {}, id="2x1"),
    pytest.param(1, {"CROSSDEVICE_SHARED_MEMORY": "0"}, id="2x1-no-shm"),
    pytest.param(2, {}, id="2x2"),
    pytest.param(2, {"CROSSDEVICE_SHARED_MEMORY": "0"}, id="2x2-no-shm"),
]
_DIFFERENT = "the workers hold different global batches at step {}"


def _run(kind: str, replicas: int, env: dict[str, str]) -> list[dict[str, Any]]:
    results = run_workers(train, 2, args=(kind, replicas), timeout=90.0, env=env)
    return [r.unwrap() for r in results]


def _plain_torch(global_batches: list[list[int]]) -> list[list[float]]:
    """Plain torch's parameters after SGD on `global_batches` (mean loss, float64)."""
    import torch

    features, targets, net = problem()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for ids in global_batches:
        index = torch.tensor(ids)
        loss = ((net(features[index]).squeeze(1) - targets[index]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach().reshape(-1).tolist() for p in net.parameters()]


def _global_batches(outs: list[dict[str, Any]]) -> list[list[int]]:
    """Each step's global batch: every worker's replicas' slices, in replica order."""
    steps = len(outs[0]["steps"])
    assert all(len(out["steps"]) == steps for out in outs)
    return [[i for out in outs for part in out["steps"][s] for i in part] for s in range(steps)]


def _assert_refused(outs: list[dict[str, Any]]) -> None:
    for out in outs:
        assert out["refused"] is not None, "a DistributedSampler was not refused"
        assert "sampler is a DistributedSampler" in out["refused"]
        assert "distribute_datasets_from_function" in out["refused"]


@pytest.mark.parametrize(("replicas", "env"), SETUPS)
def test_the_same_seeded_shuffle_trains_as_plain_torch(replicas: int, env: dict[str, str]) -> None:
    outs = _run("same_shuffle", replicas, env)
    _assert_refused(outs)  # (tried first: refused before any collective)
    for out in outs:
        assert out["error"] is None, out["error"]
    batches = _global_batches(outs)
    assert sorted(i for batch in batches for i in batch) == list(range(24))  # each once
    expected = _plain_torch(batches)
    for out in outs:
        np.testing.assert_allclose(np.concatenate(out["params"]), np.concatenate(expected))


@pytest.mark.parametrize(("replicas", "env"), SETUPS)
@pytest.mark.parametrize(("kind", "step"), [("shards", 1), ("rank_shuffle", 1), ("diverging", 3)])
def test_different_global_batches_are_an_error_before_the_step_combines(
    kind: str, step: int, replicas: int, env: dict[str, str]
) -> None:
    """Each worker's shard, or a rank-seeded shuffle: caught at the first step. A list of
    exact length alike for 2 steps, then per worker: step 3, whose has-data agreement is
    skipped (the lengths agreed), caught in the state of its first gradient collective."""
    outs = _run(kind, replicas, env)
    for out in outs:
        assert out["error"] is not None, f"{kind}: trained {out['steps']} without an error"
        kind_of, message = out["error"]
        assert kind_of == "CollectiveMismatchError", message
        assert _DIFFERENT.format(step) in message, message
        assert "distribute_datasets_from_function" in message
        assert len(out["steps"]) == step - 1  # the step that differed trained nothing
    # Every worker holds what plain torch has after the steps before it: nothing combined.
    expected = _plain_torch(_global_batches(outs))
    for out in outs:
        np.testing.assert_allclose(np.concatenate(out["params"]), np.concatenate(expected))


def test_the_digest_is_exact_and_tells_batches_apart() -> None:
    torch = pytest.importorskip("torch")
    images = torch.randn(64, 1, 28, 28)
    labels = torch.randint(0, 10, (64,))
    digest = batch_digest([images, labels])
    assert digest == batch_digest([images.clone(), labels.clone()])
    # The same values in another memory layout: the same digest.
    transposed = images.transpose(0, 3).contiguous().transpose(0, 3)
    assert not transposed.is_contiguous()
    assert batch_digest([transposed, labels]) == digest
    # Another batch, the same examples in another order, another dtype: another digest.
    assert batch_digest([images[torch.randperm(64)], labels]) != digest
    assert batch_digest([images, labels.flip(0)]) != digest
    assert batch_digest([images.double(), labels]) != digest
    assert 0 <= digest < 2**63


def test_the_agreement_digests_the_batch_just_split() -> None:
    batch = {"x": np.arange(12.0).reshape(6, 2), "y": np.arange(6)}
    _, _, size = split_batch_leaves(batch, 2)
    leaves = last_split(size)
    assert leaves is not None
    assert batch_digest(leaves) == batch_digest([batch["x"], batch["y"]])
    assert last_split(size) is None  # taken once


def test_a_carried_digest_mismatch_reads_as_different_batches() -> None:
    detail = "the global batch of step {} (experimental_distribute_dataset): {:016x}"
    error = CollectiveMismatchError(
        "all_reduce #9 on rank 0: ... rank 0: ...\n  " + detail.format(3, 1) + "; lr=0.1\n"
        "  rank 1: ...\n  " + detail.format(3, 2) + "; lr=0.1"
    )
    clearer = different_batches(error)
    assert clearer is not None
    assert _DIFFERENT.format(3) in str(clearer)
    same = CollectiveMismatchError(detail.format(3, 1) + detail.format(3, 1) + " lr differs")
    assert different_batches(same) is None  # the batches agree: another cause
