"""Fixtures of the torch training tests."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def torch(torch_module: Any) -> Any:
    """torch, with its intra-op thread count and default dtype restored after the test."""
    threads = torch_module.get_num_threads()
    dtype = torch_module.get_default_dtype()
    yield torch_module
    torch_module.set_num_threads(threads)
    torch_module.set_default_dtype(dtype)


@pytest.fixture
def cdt(torch: Any) -> Any:
    """`crossdevice.torch` (imports torch)."""
    import crossdevice.torch

    return crossdevice.torch


@pytest.fixture
def float64(torch: Any) -> None:
    """float64 by default for the test: comparisons with plain torch to 1e-12."""
    torch.set_default_dtype(torch.float64)
