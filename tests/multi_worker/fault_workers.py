"""Worker side of the fault matrix: each function runs several cells in one process group.

Every cell records, per worker, the exception type and message it got (or the value)
and how long it took, so the test can check that every surviving rank raised a clear
error in time and that no result was silently wrong.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _strategy(local: int, timeout: float | None) -> Any:
    import crossdevice as cd

    cd.config.set_logical_cpu_devices(max(local, 2))
    options = cd.experimental.CommunicationOptions(timeout_seconds=timeout)
    return cd.MultiWorkerMirroredStrategy(
        communication_options=options, devices=[f"CPU:{i}" for i in range(local)]
    )


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        value = fn()
    except Exception as err:
        return {
            "type": type(err).__name__,
            "message": str(err),
            "elapsed": time.monotonic() - start,
        }
    return {"type": None, "value": value, "elapsed": time.monotonic() - start}


def _reduce_a(ctx: Any, x: Any) -> Any:
    return ctx.all_reduce("sum", x)


def _reduce_b(ctx: Any, x: Any) -> Any:
    return ctx.all_reduce("sum", x)


def _mismatch_step(cell: str, rank: int, world_size: int) -> Callable[[], Any]:
    import crossdevice as cd

    odd = rank == world_size - 1  # the worker that disagrees

    def step() -> Any:
        ctx = cd.get_replica_context()
        x = np.ones((2, 3), np.float32)
        if cell == "shape":
            return ctx.all_reduce("sum", x.reshape(3, 2) if odd else x)
        if cell == "dtype":
            return ctx.all_reduce("sum", x.astype(np.int32) if odd else x)
        if cell == "order":
            y = np.full((2, 3), 5.0, np.float32)
            first, second = (_reduce_b, _reduce_a) if odd else (_reduce_a, _reduce_b)
            return first(ctx, x), second(ctx, y)
        if cell == "op":
            return ctx.all_reduce("mean" if odd else "sum", x)
        if cell == "kind":
            return ctx.all_gather(x, axis=0) if odd else ctx.all_reduce("sum", x)
        if cell == "structure":
            return ctx.all_reduce("sum", [x] if odd else [x, x])
        if cell == "same_leaves":  # the same leaves in another nest: no leaf differs
            return ctx.all_reduce("sum", {"a": x, "b": x} if odd else [x, x])
        if cell.startswith("predicted_"):
            for _ in range(3):  # teach every worker: after _reduce_a comes _reduce_b of x
                _reduce_a(ctx, x)
                _reduce_b(ctx, x)
            _reduce_a(ctx, x)
            if not odd:
                return _reduce_b(ctx, x)
            if cell == "predicted_shape":  # the predicted layout: this worker's data is sent
                return _reduce_b(ctx, x.reshape(3, 2))
            if cell == "predicted_size":
                return _reduce_b(ctx, np.ones(7, np.float32))
            if cell == "predicted_dtype":
                return _reduce_b(ctx, x.astype(np.float64))
            return ctx.all_gather(x, axis=0)
        raise AssertionError(cell)

    return step


MISMATCH_CELLS = (
    "shape",
    "dtype",
    "order",
    "op",
    "kind",
    "structure",
    "same_leaves",
    # After a warm-up, every worker predicts the next all-reduce's layout and sends its
    # data with the fingerprint inside it (speculation.py): the disagreement is then
    # found in the summed data, on buffers of the predicted sizes, never by Gloo.
    "predicted_shape",
    "predicted_size",
    "predicted_dtype",
    "predicted_kind",
)


def mismatches(rank: int, world_size: int, local: int) -> dict[str, Any]:
    """Every mismatch cell in turn, a correct all-reduce after each; then raise-and-carry-on."""
    import crossdevice as cd

    strategy = _strategy(local, timeout=20.0)
    out: dict[str, Any] = {"shared_memory": _shared_rounds(strategy) is not None}

    def good() -> Any:
        results = strategy.run(lambda: cd.get_replica_context().all_reduce("sum", np.float32(1)))
        return [float(v) for v in strategy.experimental_local_results(results)]

    for cell in MISMATCH_CELLS:
        out[cell] = _outcome(lambda cell=cell: strategy.run(_mismatch_step(cell, rank, world_size)))
        out[f"{cell}/after"] = _outcome(good)
    # A worker whose step raises, caught by the user, who carries on.
    culprit = world_size - 1

    def failing_step() -> Any:
        if rank == culprit:
            raise ValueError("bad batch")
        return cd.get_replica_context().all_reduce("sum", np.float32(1))

    out["raise"] = _outcome(lambda: strategy.run(failing_step))
    out["carry_on"] = _outcome(good)
    # Rank 0 serves the c10d store: exiting at once would take it down while a slower
    # peer still reads the abort mark (that peer would then name rank 0, correctly, as
    # unreachable). A real job's chief outlives its peers' error handling too.
    time.sleep(1.5)
    return out


def _shared_rounds(strategy: Any) -> int | None:
    """Rounds run through shared memory so far; None when the workers do not share it."""
    shared = strategy.extended._worker_communicator.shared_memory
    return None if shared is None else int(shared._round)


def replica_counts(rank: int, world_size: int) -> dict[str, Any]:
    """The last worker runs two local replicas, the others one."""
    local = 2 if rank == world_size - 1 else 1
    return _outcome(lambda: _strategy(local, timeout=20.0).num_replicas_in_sync)


def lost_worker(
    rank: int,
    world_size: int,
    local: int,
    culprit: int,
    how: str,
    timeout: float | None,
    warmups: int = 1,
) -> dict[str, Any]:
    """Good all-reduces, then `culprit` is killed (SIGKILL), frozen (SIGSTOP: its
    connections stay open, and rank 0's store stops answering) or stalls; the others
    reduce."""
    import crossdevice as cd
    from crossdevice._core import tuning

    if timeout is None:
        tuning.set_tuning(default_timeout_seconds=3.0)  # the default, shortened
    strategy = _strategy(local, timeout=timeout)

    def step() -> Any:
        return cd.get_replica_context().all_reduce("sum", np.float32(1))

    for _ in range(warmups):
        strategy.run(step)
    before = _shared_rounds(strategy)
    if rank == culprit:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)  # the harness kills us once the others are done
    out = _outcome(lambda: strategy.run(step))
    # Whether the failed all-reduce waited in a shared-memory round.
    out["shared_rounds"] = before is not None and _shared_rounds(strategy) != before
    return out


def frozen_store_at_start(rank: int, world_size: int, when: str) -> dict[str, Any]:
    """Rank 0, which serves the c10d store, freezes (SIGSTOP) while the workers start:
    `rendezvous`, once its store listens, before torch's rendezvous; `first-groups`,
    between the rendezvous and the strategy's own groups; `groups`, after a first
    strategy, before a second one creates its groups. The others build a strategy."""
    import torch.distributed as dist

    if when == "groups":
        _strategy(1, timeout=30.0)
    if rank == 0:
        if when == "groups":
            os.kill(os.getpid(), signal.SIGSTOP)
        # `rendezvous`: its store server was started just before torch's rendezvous;
        # `first-groups`: the default group is up, the strategy's own groups come next.
        name = "init_process_group" if when == "rendezvous" else "new_group"
        real = getattr(dist, name)

        def frozen(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGSTOP)
            return real(*args, **kwargs)

        setattr(dist, name, frozen)
    return _outcome(lambda: _strategy(1, timeout=30.0).num_replicas_in_sync)


def _own_listening_sockets() -> list[str]:
    """This process's listening TCP sockets as `address:port` (from /proc/net/tcp{,6})."""
    pid = os.getpid()
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                    found.append(fields[1])
    return found


def listening_sockets(rank: int, world_size: int) -> dict[str, Any]:
    """After a collective, the listening sockets of this worker (hex, as /proc shows them)."""
    import crossdevice as cd

    strategy = _strategy(1, timeout=20.0)
    total = strategy.run(lambda: cd.get_replica_context().all_reduce("sum", np.float32(1)))
    return {"total": float(total), "listening": _own_listening_sockets()}


def uneven_shards(rank: int, world_size: int, local: int) -> dict[str, Any]:
    """Pipelines of different lengths on each worker, through both dataset APIs.

    With `distribute_datasets_from_function`, worker w's pipeline yields 5 - 2w batches
    of `local` elements (worker 0: 5, worker 1: 3); TF gives the worker that ran out an
    empty batch so both run 5 steps. Each step reduces MEAN along the batch axis (the
    partial-batch rule: divide by the real number of elements) and SUM of the counts.
    """
    strategy = _strategy(local, timeout=20.0)
    steps = 5 - 2 * rank

    def dataset_fn(ctx: Any) -> Any:
        base = 100.0 * ctx.input_pipeline_id
        return [
            np.array([base + 10 * s + e], np.float32) for s in range(steps) for e in range(local)
        ]

    def step(x: Any) -> Any:
        return x

    out: dict[str, Any] = {"from_function": [], "dataset": []}
    for batch in strategy.distribute_datasets_from_function(dataset_fn):
        values = strategy.run(step, args=(batch,))
        count = strategy.reduce(
            "sum", strategy.run(lambda x: np.float32(len(x)), args=(batch,)), axis=None
        )
        out["from_function"].append((float(strategy.reduce("mean", values, axis=0)), float(count)))
    # experimental_distribute_dataset: worker 1 reads one global batch fewer.
    global_batch = world_size * local
    batches = [np.arange(global_batch, dtype=np.float32) + 10 * s for s in range(3 - rank)]
    for batch in strategy.experimental_distribute_dataset(batches):
        values = strategy.run(step, args=(batch,))
        out["dataset"].append(float(strategy.reduce("mean", values, axis=0)))
    return out


def frozen_then_resumed(
    rank: int, world_size: int, culprit: int, freeze: float, done: str
) -> dict[str, Any]:
    """`culprit` freezes (SIGSTOP) between steps for `freeze` s, longer than its peers'
    patience (`dead_after_seconds`, shortened to 2.5 s here), then resumes and runs the
    step its peers gave up on. The survivors close their communicator once they failed
    (a program that ends) but keep running until the culprit is done (`done` appears),
    rank 0 keeping the c10d store up."""
    import subprocess

    import crossdevice as cd
    from crossdevice._core import tuning

    tuning.set_tuning(dead_after_seconds=2.5)
    strategy = _strategy(1, timeout=25.0)

    def step() -> Any:
        return cd.get_replica_context().all_reduce("sum", np.float32(1))

    strategy.run(step)
    if rank == culprit:
        # A stopped process cannot wake itself: a helper sends SIGCONT.
        waker = subprocess.Popen(["sh", "-c", f"sleep {freeze}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        waker.wait()
        out = _outcome(lambda: strategy.run(step))
        with open(done, "w"):
            pass
        return out
    out = _outcome(lambda: strategy.run(step))
    strategy.extended._worker_communicator.close()
    deadline = time.monotonic() + 60.0
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)
    return out
