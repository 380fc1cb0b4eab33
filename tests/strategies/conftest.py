"""Strategy fixtures: every strategy the contract suite runs against.

Strategies with several CPU replicas run both ways: on replica threads (the default) and
as cooperative replicas (`crossdevice.config.set_replica_execution("cooperative")`); a
mode changes speed, never results.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import crossdevice as cd


def _mirrored(n: int) -> Callable[[], Any]:
    return lambda: cd.MirroredStrategy([f"CPU:{i}" for i in range(n)])


def _central_storage() -> Any:
    return cd.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")


def _mirrored_gpus(n: int) -> Callable[[], Any]:
    return lambda: cd.MirroredStrategy([f"GPU:{i}" for i in range(n)])


#: (id, factory, replica execution) for every strategy of the contract suite. The GPU
#: ones run on fake CUDA (4 cards, or one card split into 4 logical GPUs) and on real
#: CUDA where there is one (logical GPUs making up 4); with them the torch backend makes
#: CUDA tensors.
STRATEGIES: list[tuple[str, Callable[[], Any], str]] = [
    *[(f"mirrored{n}", _mirrored(n), "threads") for n in (1, 2, 3, 4, 8)],
    ("one_device", lambda: cd.OneDeviceStrategy("CPU:0"), "threads"),
    ("central_storage2", _central_storage, "threads"),
    *[(f"mirrored{n}_coop", _mirrored(n), "cooperative") for n in (2, 3, 4, 8)],
    ("central_storage2_coop", _central_storage, "cooperative"),
    ("mirrored4_gpu_fake", _mirrored_gpus(4), "gpu:fake"),
    ("mirrored4_logical_gpu_fake", _mirrored_gpus(4), "gpu:fake-logical"),
    ("one_device_gpu_fake", lambda: cd.OneDeviceStrategy("GPU:0"), "gpu:fake"),
    ("mirrored4_gpu_cuda", _mirrored_gpus(4), "gpu:cuda"),
]


@contextlib.contextmanager
def replica_execution(mode: str) -> Iterator[None]:
    """Run the enclosed test with replica execution `mode`, then restore the default."""
    previous = cd.config.get_replica_execution()
    cd.config.set_replica_execution(mode)  # type: ignore[arg-type]
    try:
        yield
    finally:
        cd.config.set_replica_execution(previous)  # type: ignore[arg-type]


@pytest.fixture(
    params=[(factory, mode) for _, factory, mode in STRATEGIES],
    ids=[name for name, _, _ in STRATEGIES],
)
def strategy(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Each strategy of the contract suite (with several replicas: in both modes)."""
    factory, mode = request.param
    if mode.startswith("gpu:"):
        from tests.gpu.conftest import on_gpus

        pytest.importorskip("torch")
        with on_gpus(mode.removeprefix("gpu:"), torch_values=True):
            yield factory()
        return
    with replica_execution(mode):
        yield factory()


@pytest.fixture
def mirrored4() -> Any:
    """MirroredStrategy on four logical CPUs."""
    return cd.MirroredStrategy([f"CPU:{i}" for i in range(4)])
