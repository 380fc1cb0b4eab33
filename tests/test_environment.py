"""Settings read from environment variables: one parser, alike for every variable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from crossdevice._arrays import heap
from crossdevice._core import devices, environment

_NAME = "CROSSDEVICE_TEST_SETTING"


@pytest.mark.parametrize("word", ["1", "true", "TRUE", "Yes", "on", " 1 ", "On\n"])
@pytest.mark.parametrize("default", [True, False])
def test_a_switch_turns_on(monkeypatch: pytest.MonkeyPatch, word: str, default: bool) -> None:
    monkeypatch.setenv(_NAME, word)
    assert environment.env_switch(_NAME, default=default) is True


@pytest.mark.parametrize("word", ["0", "false", "False", "NO", "off", " 0 "])
@pytest.mark.parametrize("default", [True, False])
def test_a_switch_turns_off(monkeypatch: pytest.MonkeyPatch, word: str, default: bool) -> None:
    monkeypatch.setenv(_NAME, word)
    assert environment.env_switch(_NAME, default=default) is False


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_blank_is_the_default(monkeypatch: pytest.MonkeyPatch, default: bool) -> None:
    monkeypatch.delenv(_NAME, raising=False)
    assert environment.env_switch(_NAME, default=default) is default
    monkeypatch.setenv(_NAME, "  ")
    assert environment.env_switch(_NAME, default=default) is default


@pytest.mark.parametrize("word", ["2", "maybe", "disable", "00", "o"])
def test_anything_else_is_an_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, word: str
) -> None:
    monkeypatch.setenv(_NAME, word)
    with pytest.raises(ValueError, match=rf"{_NAME} must be 1 or 0 .* got '{word}'"):
        environment.env_switch(_NAME, default=True)


def test_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_NAME, raising=False)
    assert environment.env_int(_NAME, minimum=1) is None
    monkeypatch.setenv(_NAME, " 7 ")
    assert environment.env_int(_NAME, minimum=1) == 7
    monkeypatch.setenv(_NAME, "0")
    assert environment.env_int(_NAME, minimum=0) == 0
    for bad in ("0", "-3", "1.5", "many"):
        monkeypatch.setenv(_NAME, bad)
        with pytest.raises(ValueError, match=rf"{_NAME} must be an integer >= 1, got '{bad}'"):
            environment.env_int(_NAME, minimum=1)


def test_every_reader_goes_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's switches and counts reject what the parser rejects."""
    monkeypatch.setenv("CROSSDEVICE_KEEP_HEAP", "off")
    assert heap._set_thresholds() is False  # "off" is off (nothing else said so before)
    monkeypatch.setenv("CROSSDEVICE_KEEP_HEAP", "sometimes")
    with pytest.raises(ValueError, match="CROSSDEVICE_KEEP_HEAP must be 1 or 0"):
        heap._set_thresholds()
    monkeypatch.setenv("CROSSDEVICE_LOGICAL_CPUS", "0")
    with pytest.raises(ValueError, match="CROSSDEVICE_LOGICAL_CPUS must be an integer >= 1"):
        devices._env_logical_cpus()


def test_the_shared_memory_threshold_is_a_count(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from crossdevice._comm.workers import shared_memory as shm

    monkeypatch.setenv(shm.MIN_BYTES_ENV_VAR, "lots")
    with pytest.raises(ValueError, match="CROSSDEVICE_SHARED_MEMORY_MIN_BYTES must be a byte"):
        shm.min_bytes_from_env()


#: A child's environment with none of ours but where crossdevice is imported from (a
#: checkout run with PYTHONPATH=src, as scripts/gpu_check.sh does, installs nothing).
_BARE: dict[str, str] = {"PATH": ""} | (
    {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
)


@pytest.mark.parametrize(("value", "native"), [("off", False), ("true", True)])
def test_the_native_kernel_switch(value: str, native: bool) -> None:
    code = "from crossdevice._arrays import native; print(native.available())"
    env = {"CROSSDEVICE_NATIVE": value, **_BARE}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    built = subprocess.run(
        [sys.executable, "-c", code], env=_BARE, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out.stdout.strip() == str(native and built == "True")


def test_the_trace_window_is_a_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from crossdevice._trace import session

    monkeypatch.setenv(session.ENV_REPORT_EVERY, "25")
    assert session._report_every(None) == 25
    for bad in ("0", "-1", "ten"):
        monkeypatch.setenv(session.ENV_REPORT_EVERY, bad)
        with pytest.raises(ValueError, match="CROSSDEVICE_TRACE_REPORT_EVERY must be a whole"):
            session._report_every(None)


def test_prepare_rejects_a_bad_heap_switch_before_it_wraps_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    import crossdevice
    import crossdevice.torch as cdt

    monkeypatch.setenv("CROSSDEVICE_KEEP_HEAP", "sometimes")
    strategy = crossdevice.MirroredStrategy(["CPU:0"])
    with strategy.scope():
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="CROSSDEVICE_KEEP_HEAP must be 1 or 0"):
        cdt.prepare(model, optimizer, strategy=strategy)
    # Nothing was prepared: with the switch fixed, the same objects prepare.
    monkeypatch.setenv("CROSSDEVICE_KEEP_HEAP", "0")
    prepared, _ = cdt.prepare(model, optimizer, strategy=strategy)
    assert type(prepared).__name__ == "MirroredModule"


@pytest.mark.parametrize(
    ("value", "outcome"),
    [("maybe", "ValueError"), ("true", "loud"), ("off", "quiet"), ("", "quiet")],
)
def test_the_debug_switch_is_read_where_the_store_is_wrapped(value: str, outcome: str) -> None:
    """A bad `CROSSDEVICE_DEBUG` raises where a communicator wraps its store (its start),
    not later in the health board's thread, where an error would stop the heartbeats."""
    pytest.importorskip("torch")
    code = (
        "import torch\n"
        "from crossdevice._comm.workers import store_logging as s\n"
        "try:\n"
        "    s.quiet_store(object())\n"
        "except ValueError as err:\n"
        "    print('ValueError', err)\n"
        "else:\n"
        "    print('quiet' if s._log_level_flag() is not None else 'loud')\n"
    )
    env = {"CROSSDEVICE_DEBUG": value, **_BARE}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split()[0] == outcome, done.stdout
    if outcome == "ValueError":
        assert "CROSSDEVICE_DEBUG must be 1 or 0" in done.stdout


def test_the_heartbeat_patience_is_a_duration(monkeypatch: pytest.MonkeyPatch) -> None:
    """`CROSSDEVICE_DEAD_AFTER_SECONDS` gives peers more patience with a stalled worker
    (the advice of the error a resumed, declared-dead worker raises)."""
    pytest.importorskip("torch")
    from crossdevice._comm.workers import start
    from crossdevice._core import tuning

    with tuning.overridden():
        monkeypatch.setenv(start.DEAD_AFTER_ENV, " 20 ")
        start.patience_from_environment()
        assert tuning.TUNING.dead_after_seconds == 20.0
    for bad in ("soon", "0.1", "nan", "-5"):
        monkeypatch.setenv(start.DEAD_AFTER_ENV, bad)
        with pytest.raises(ValueError, match=rf"CROSSDEVICE_DEAD_AFTER_SECONDS.*{bad!r}"):
            start.patience_from_environment()
    monkeypatch.delenv(start.DEAD_AFTER_ENV)
    with tuning.overridden():
        start.patience_from_environment()
        assert tuning.TUNING.dead_after_seconds == tuning.Tuning().dead_after_seconds
