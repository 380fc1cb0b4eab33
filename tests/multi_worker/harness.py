"""Spawn worker processes on 127.0.0.1, run one function in each, collect the results.

`run_workers(fn, world_size)` starts `world_size` fresh Python processes (subprocess,
so each gets its own interpreter and environment, as torchrun gives), describes the
cluster to them through torchrun's variables or `TF_CONFIG`, calls
`fn(rank, world_size, *args)` in each and returns one `WorkerResult` per rank: the value
returned, or the exception raised (type, message, traceback), or the exit code of a
worker that died. Children are always killed: at the deadline, when the required ranks
are done, and when anything goes wrong in the parent. Nothing here can hang.

`fn` must be a module-level function of an importable module (the children import it
by name) and its arguments and results must pickle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

__all__ = ["WorkerResult", "free_port", "run_workers", "torchrun"]

#: Repository root: the children import `tests.multi_worker...` from here.
_ROOT = Path(__file__).resolve().parents[2]
_POLL_SECONDS = 0.05


@dataclasses.dataclass
class WorkerResult:
    """What one worker process left behind."""

    rank: int
    value: Any = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    output: str = ""

    @property
    def ok(self) -> bool:
        """The function returned normally."""
        return self.error_type is None and self.exitcode == 0

    def unwrap(self) -> Any:
        """The returned value; AssertionError with the worker's traceback and output else."""
        if not self.ok:
            raise AssertionError(f"worker {self.rank} did not return: {self.describe()}")
        return self.value

    def describe(self) -> str:
        """A readable account of the outcome, for assertion messages."""
        if self.error_type is not None:
            what = f"raised {self.error_type}: {self.error_message}\n{self.traceback}"
        elif self.exitcode is None:
            what = "was killed by the harness (still running)"
        else:
            what = f"exited with code {self.exitcode}"
        return f"rank {self.rank} {what}\n--- output ---\n{self.output[-4000:]}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun(*args: str, nproc: int = 2, max_restarts: int = 0) -> list[str]:
    """The command that runs `args` (a script or `-m module` and its flags) under torchrun."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        *args,
    ]


def _cluster_env(
    rank: int, world_size: int, port: int, launcher: str, chief: bool
) -> dict[str, str]:
    if launcher == "torchrun":
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    # TF_CONFIG: rank 0's address is the rendezvous; the others' ports are never opened.
    addresses = [f"127.0.0.1:{port}"] + [f"127.0.0.1:{port + i}" for i in range(1, world_size)]
    if chief:
        cluster = {"chief": addresses[:1], "worker": addresses[1:]}
        task = {"type": "chief", "index": 0} if rank == 0 else {"type": "worker", "index": rank - 1}
    else:
        cluster = {"worker": addresses}
        task = {"type": "worker", "index": rank}
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": task})}


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 45.0,
    launcher: Literal["torchrun", "tf_config"] = "torchrun",
    chief: bool = False,
    required: Iterable[int] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[WorkerResult]:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes.

    Args:
        fn: a module-level function of an importable module.
        world_size: number of worker processes.
        args: extra arguments (picklable).
        timeout: hard deadline in seconds for the whole run; then every child is killed.
        launcher: describe the cluster with torchrun's variables or with `TF_CONFIG`.
        chief: with `TF_CONFIG`, make rank 0 a `"chief"` task (else all are workers).
        required: ranks whose outcome matters; once they have all finished, the others
            are killed (a stalled worker need not sleep out its stall). Default all.
        env: extra environment variables for every child.

    Returns:
        One `WorkerResult` per rank, in rank order.
    """
    required_ranks = set(range(world_size) if required is None else required)
    module = fn.__module__
    if module == "__main__":  # run as `python -m package.module`: import it by that name
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None:
            raise ValueError(f"{fn!r} lives in a script; move it to an importable module")
        module = spec.name
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="crossdevice-workers-") as tmp:
        workdir = Path(tmp)
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        try:
            for rank in range(world_size):
                payload = workdir / f"payload{rank}.pkl"
                payload.write_bytes(
                    pickle.dumps((module, fn.__qualname__, rank, world_size, args, timeout))
                )
                child_env = {
                    k: v
                    for k, v in os.environ.items()
                    if k not in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                }
                child_env.update(_cluster_env(rank, world_size, port, launcher, chief))
                # torchrun's default: one intra-op thread per worker, or the workers' OpenMP
                # threads fight over the cores (a 1 MiB clone took 4 ms instead of 0.02 ms).
                child_env.setdefault("OMP_NUM_THREADS", "1")
                child_env["PYTHONPATH"] = os.pathsep.join(
                    [str(_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
                )
                child_env.update(env or {})
                log = (workdir / f"out{rank}.txt").open("wb")
                logs.append(log)
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "tests.multi_worker._entry",
                            str(payload),
                            str(workdir / f"result{rank}.pkl"),
                        ],
                        cwd=_ROOT,
                        env=child_env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if all(procs[r].poll() is not None for r in required_ranks):
                    break
                time.sleep(_POLL_SECONDS)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):  # kill -9 failed?
                    proc.wait(timeout=10)
            for log in logs:
                log.close()
        return [_collect(workdir, rank, procs[rank]) for rank in range(world_size)]


def _collect(workdir: Path, rank: int, proc: subprocess.Popen[bytes]) -> WorkerResult:
    output = (workdir / f"out{rank}.txt").read_text(errors="replace")
    result = WorkerResult(rank=rank, exitcode=proc.returncode, output=output)
    path = workdir / f"result{rank}.pkl"
    if path.exists():
        outcome = pickle.loads(path.read_bytes())
        if outcome["ok"]:
            result.value = outcome["value"]
        else:
            result.error_type = outcome["type"]
            result.error_message = outcome["message"]
            result.traceback = outcome["traceback"]
    # A worker that raised or returned but was killed while tearing down still counts.
    if path.exists() and result.exitcode not in (0, None):
        result.exitcode = 0
    return result
