"""A user's typed program passes `mypy --strict` with no casts: the public API is typed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import crossdevice

pytestmark = pytest.mark.slow

USER_SCRIPT = Path(__file__).with_name("user_script.py")


def test_user_script_passes_mypy_strict_without_casts(tmp_path: Path) -> None:
    source = USER_SCRIPT.read_text()
    assert not re.search(r"\bcast\(|type:\s*ignore", source), "the script must need no casts"
    # Stock --strict, not the project's configuration (which relaxes two checks for the
    # package's own NumPy-heavy code): what a user's CI would run.
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--config-file",
            str(config),
            "--cache-dir",
            str(tmp_path / "cache"),
            str(USER_SCRIPT),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_user_script_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(USER_SCRIPT)], capture_output=True, text=True, timeout=120, check=True
    )
    assert float(out.stdout) > 0


def test_replica_context_in_a_replica_and_by_default() -> None:
    strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])

    def step() -> int:
        return crossdevice.replica_context().replica_id_in_sync_group

    assert strategy.experimental_local_results(strategy.run(step)) == (0, 1)
    default = crossdevice.replica_context()
    assert default is crossdevice.get_replica_context()
    assert default.replica_id_in_sync_group == 0


def test_replica_context_in_cross_replica_context_says_where_to_call_it() -> None:
    strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
    with (
        strategy.scope(),
        pytest.raises(RuntimeError, match=r"cross-replica context.*strategy\.run"),
    ):
        crossdevice.replica_context()

    def merge_fn(strategy: crossdevice.Strategy) -> None:
        crossdevice.replica_context()

    def step() -> None:
        crossdevice.replica_context().merge_call(merge_fn)

    with pytest.raises(RuntimeError, match="get_replica_context"):
        strategy.run(step)
