"""The workloads and timing loop every benchmark shares, NumPy and the standard library only.

`tf_reference.py` runs in TensorFlow's interpreter, where crossdevice is not installed,
and imports this module too: both sides time the same tensors the same way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["batch_sizes", "median_seconds"]


def batch_sizes() -> list[int]:
    """160 float32 tensor sizes from 64 to 600k elements, about 200 MB per replica.

    80 "weights" of 500k..600k elements interleaved with 80 "biases" log-spaced from 64 to
    600k elements: 49.6M elements, 198 MB of float32.
    """
    large = np.linspace(500_000, 600_000, 80).round().astype(int)
    small = np.geomspace(64, 600_000, 80).round().astype(int)
    sizes: list[int] = []
    for a, b in zip(small, large, strict=True):
        sizes += [int(a), int(b)]
    return sizes


def median_seconds(
    fn: Callable[[], Any], runs: int = 9, inner: int = 1, warmup: int = 2
) -> tuple[float, list[float]]:
    """Median (and all) of `runs` timings of `inner` back-to-back calls, per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times), times
