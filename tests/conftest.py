"""Shared fixtures: logical devices, array backends, optional-import policy.

Tests that need torch fail when it is missing, unless `--skip-optional-imports` is
given (trio's rule: an optional dependency never silently turns tests into skips).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from crossdevice._core import devices as _devices

#: Logical CPU devices offered to every test: enough for the largest device count used.
TEST_LOGICAL_CPUS = 16


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-optional-imports",
        action="store_true",
        default=False,
        help="skip (instead of failing) tests whose optional dependency (torch) is missing",
    )


def pytest_configure(config: pytest.Config) -> None:
    _devices.set_logical_cpu_devices(TEST_LOGICAL_CPUS)
    # Flight-recorder reports of the errors tests provoke go to a directory of this run
    # (inherited by the worker processes tests start), not the user's temp dir.
    os.environ.setdefault("CROSSDEVICE_FLIGHT_DIR", tempfile.mkdtemp(prefix="crossdevice-flight-"))


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt) while the test runs.

    A process started with SIGINT ignored (a background job of a non-interactive shell,
    `nohup`) keeps it ignored, and Python then installs no handler of its own: a test
    that sends SIGINT would wait in vain for its KeyboardInterrupt (seen: three tests
    failed when the suite ran as a background job). Processes the test starts get
    SIGINT's default action back too (exec resets a handler, but keeps an ignore).
    """
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT handlers can only be set from the main thread")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def _logical_cpus() -> Iterator[None]:
    """Every test starts with TEST_LOGICAL_CPUS logical CPU devices (tests may change it)."""
    _devices.set_logical_cpu_devices(TEST_LOGICAL_CPUS)
    yield
    _devices.set_logical_cpu_devices(TEST_LOGICAL_CPUS)


@pytest.fixture(autouse=True)
def _torch_default_dtype() -> Iterator[None]:
    """torch's default dtype is process-wide: what a test (or a plain-torch reference it
    computes in this process) sets must not reach the next tests (CI saw float64 leak
    from one into 16 others, in order only)."""
    torch = sys.modules.get("torch")
    before = torch.get_default_dtype() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_default_dtype(torch.float32 if before is None else before)


def require_torch(request: pytest.FixtureRequest) -> Any:
    """Import torch, or fail (skip only under --skip-optional-imports)."""
    if importlib.util.find_spec("torch") is None:
        if request.config.getoption("--skip-optional-imports"):
            pytest.skip("torch is not installed and --skip-optional-imports was given")
        pytest.fail("torch is not installed: pip install torch==2.13.0 (CPU build)")
    import torch

    return torch


class Backend:
    """How a test makes values of one array library from NumPy data."""

    def __init__(self, name: str, make: Callable[[Any], Any]) -> None:
        self.name = name
        self.make = make

    def __repr__(self) -> str:
        return self.name


#: Where the torch backend makes its tensors: "cpu", or "cuda" (the current CUDA device:
#: inside a GPU replica, its GPU) while a GPU strategy of the contract suite runs.
TORCH_DEVICE = "cpu"


@pytest.fixture(params=["numpy", "torch"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Run a test once with NumPy values and once with torch tensors (CPU, or CUDA with a
    GPU strategy of the contract suite)."""
    if request.param == "numpy":
        return Backend("numpy", np.asarray)
    torch = require_torch(request)
    return Backend("torch", lambda x: torch.as_tensor(np.asarray(x), device=TORCH_DEVICE))


@pytest.fixture
def torch_module(request: pytest.FixtureRequest) -> Any:
    """The torch module (see `require_torch`)."""
    return require_torch(request)
