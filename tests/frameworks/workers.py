"""Functions the multi-worker training tests run in each worker process."""

from __future__ import annotations

from typing import Any

from tests.frameworks.helpers import load_example


def train_example(rank: int, world_size: int, argv: list[str]) -> dict[str, Any]:
    """Run examples/custom_training_loop.py in this worker; return its result."""
    del rank, world_size
    out = load_example("custom_training_loop").main(argv)
    return {k: out[k] for k in ("params", "replica_params", "test_accuracy", "steps")}
