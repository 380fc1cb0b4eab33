"""Fixtures of the checkpoint tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def unwritable(tmp_path: Path) -> Iterator[Path]:
    """A directory this process cannot write: read-only for a user, /sys for root."""
    if os.geteuid() == 0:
        yield Path("/sys/crossdevice-test")
        return
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    yield locked
    locked.chmod(0o700)
