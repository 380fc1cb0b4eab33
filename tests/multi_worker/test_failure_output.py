"""Issue 23: when rank 0 dies, the survivors print our error, not the c10d store's C++ frames.

torch's TCPStore client logs a C++ warning with some thirty stack frames for a call that
finds its server gone; the survivors' health checks make such calls by design. They run
under torch's ERROR log level (`crossdevice._comm.workers.store_logging`); the frames stay
available with `CROSSDEVICE_DEBUG=1` or torch's own `TORCH_CPP_LOG_LEVEL`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multi_worker.harness import free_port

pytestmark = [pytest.mark.multiprocess]

_ROOT = Path(__file__).resolve().parents[2]
#: A line of every C++ stack trace c10 prints.
_FRAME = "frame #0: c10::Error::Error"
_SECONDS = 60


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("CROSSDEVICE_DEBUG", "TORCH_CPP_LOG_LEVEL")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    """Each process's (exit code, stdout, stderr), within `_SECONDS`; killed otherwise."""
    try:
        outputs = [p.communicate(timeout=_SECONDS) for p in procs]
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)


@pytest.mark.parametrize(
    ("debug", "frames"),
    [({}, False), ({"CROSSDEVICE_DEBUG": "1"}, True), ({"TORCH_CPP_LOG_LEVEL": "WARNING"}, True)],
    ids=["default", "CROSSDEVICE_DEBUG=1", "TORCH_CPP_LOG_LEVEL=WARNING"],
)
def test_a_dead_store_host_costs_no_cpp_frames(
    tmp_path: Path, debug: dict[str, str], frames: bool
) -> None:
    """The board's calls to a store whose server exited fail (deterministically: the
    server is gone before the first call); only under a debug setting do frames print."""
    port = str(free_port())
    env = _env(**debug)
    server = _start(["tests.multi_worker.store_host_exit", "serve", port, str(tmp_path)], env)
    looker = _start(["tests.multi_worker.store_host_exit", "look", port, str(tmp_path)], env)
    try:
        server.wait(timeout=_SECONDS)
        (tmp_path / "gone").touch()
    finally:
        _, (code, out, err) = _finish([server, looker])
    assert code == 0, err
    assert "failure: rank 0 is unreachable: the c10d store does not answer" in out, out
    assert (_FRAME in err) == frames, err


def test_survivors_of_a_dead_rank_0_print_our_error_only() -> None:
    """Three workers of a user script (`dying_chief`): rank 0 is killed mid-training and
    the others' uncaught `WorkerFailedError` is all they print, interpreter exit included."""
    port = str(free_port())
    procs = []
    for rank in range(3):
        env = _env(
            RANK=str(rank),
            WORLD_SIZE="3",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(_start(["tests.multi_worker.dying_chief"], env))
    outcomes = _finish(procs)
    assert outcomes[0][0] == -9  # SIGKILL
    for rank, (code, _, err) in enumerate(outcomes[1:], start=1):
        assert code == 1, err
        last = err.strip().splitlines()[-1]
        assert "crossdevice.WorkerFailedError: all_reduce" in last, err
        assert f"on rank {rank} of 3: a peer failed: rank 0" in last, err
        for cpp in ("frame #", "c10::", ".cpp"):
            assert cpp not in err, err


@pytest.mark.parametrize(
    ("how", "code", "told"),
    [
        ("raise", 1, "raised ValueError: the config file is unreadable (uncaught outside"),
        ("sigint", -2, "raised KeyboardInterrupt (uncaught outside strategy.run"),
        ("exit", 3, "exited (closed its communicator) after its collective #"),
    ],
)
def test_a_worker_ended_between_steps_is_named_with_its_exception(
    how: str, code: int, told: str
) -> None:
    """A worker whose program ends outside `run` (an uncaught exception, Ctrl-C) tells
    its peers the exception; a deliberate `sys.exit` reads as an exit."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = _env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(_start(["tests.multi_worker.ending_worker", how], env))
    (code0, out, err), (code1, _, err1) = _finish(procs)
    assert code1 == code, err1
    assert code0 == 0, err
    last = out.strip().splitlines()[-1]
    assert last.startswith("ERROR WorkerFailedError: all_reduce #"), out
    assert f"rank 1 (global replicas [1]) {told}" in last, out
