"""The `ops` fixture: one contract suite, bound to every CrossDeviceOps configuration."""

from __future__ import annotations

import pytest

from crossdevice._cross_device import CrossDeviceOps
from tests.cross_device.cases import IMPLEMENTATIONS


@pytest.fixture(params=list(IMPLEMENTATIONS))
def ops(request: pytest.FixtureRequest) -> CrossDeviceOps:
    """A fresh instance of each CrossDeviceOps configuration (ids name the configuration)."""
    return IMPLEMENTATIONS[request.param]()
