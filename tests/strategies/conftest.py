"""Strategy fixtures: every strategy the contract suite runs against."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import crossdevice as cd

#: (id, factory) for every strategy of the contract suite.
STRATEGIES: list[tuple[str, Callable[[], Any]]] = [
    *[
        (f"mirrored{n}", lambda n=n: cd.MirroredStrategy([f"CPU:{i}" for i in range(n)]))
        for n in (1, 2, 3, 4, 8)
    ],
    ("one_device", lambda: cd.OneDeviceStrategy("CPU:0")),
    (
        "central_storage2",
        lambda: cd.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0"),
    ),
]


@pytest.fixture(params=[factory for _, factory in STRATEGIES], ids=[n for n, _ in STRATEGIES])
def strategy(request: pytest.FixtureRequest) -> Any:
    """Each strategy of the contract suite."""
    return request.param()


@pytest.fixture
def mirrored4() -> Any:
    """MirroredStrategy on four logical CPUs."""
    return cd.MirroredStrategy([f"CPU:{i}" for i in range(4)])
