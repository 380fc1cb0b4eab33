"""Functions the multi-worker training tests run in each worker process."""

from __future__ import annotations

from typing import Any

from tests.frameworks.helpers import load_example


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
