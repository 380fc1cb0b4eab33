"""Shared pieces of the torch training tests: example loading, small models, strategies."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import crossdevice as cd

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """Import `examples/<name>.py` as a module (examples are scripts, not a package)."""
    key = f"crossdevice_example_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def mirrored(n: int) -> Any:
    """MirroredStrategy on `n` logical CPUs."""
    return cd.MirroredStrategy([f"CPU:{i}" for i in range(n)])


def bn_dropout_model(torch: Any) -> Any:
    """A small CNN with BatchNorm and Dropout, for buffer and randomness tests."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 8 * 8, 10),
    )
