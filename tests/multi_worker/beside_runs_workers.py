"""Worker side of `test_collectives_beside_runs.py`: a collective from a second thread.

Each worker runs a step on its main thread (an all-reduce of ones) while a "monitor"
thread makes one cross-worker collective through a public entry point (values of 100).
Results go back to the test as plain numbers, or as (error type, message).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

#: Seconds every collective may wait (a hang shows as this, not as the harness's).
TIMEOUT = 8.0


def _strategy() -> Any:
    import crossdevice as cd

    options = cd.experimental.CommunicationOptions(timeout_seconds=TIMEOUT)
    return cd.MultiWorkerMirroredStrategy(devices=["CPU:0"], communication_options=options)


def _number(value: Any) -> float:
    """The first element of `value` (a tensor, an array, a local result)."""
    import crossdevice as cd

    if isinstance(value, cd.DistributedValues):
        value = value.values[0]
    if hasattr(value, "numpy"):
        value = value.numpy()
    return float(np.asarray(value).reshape(-1)[0])


def _outcome(call: Callable[[], Any]) -> Any:
    """`call()`, or (type name, message) of what it raised."""
    try:
        return call()
    except Exception as exc:  # reported to the test process, which checks it
        return (type(exc).__name__, str(exc))


def _total(strategy: Any, value: Any) -> Any:
    """A metrics helper: the sum of `value` over every worker (one line, one call site)."""
    return strategy.extended.reduce_to("sum", value, "CPU:0")


def _entries(strategy: Any, rank: int) -> dict[str, Callable[[], float]]:
    """Each public way to make a cross-worker collective outside `run` (values of 100)."""
    import crossdevice as cd

    x = np.full(3, 100.0, np.float32)
    with strategy.scope():
        metric = cd.Variable(x, synchronization="ON_READ", aggregation="sum")

    def variable() -> float:
        with strategy.scope():
            return _number(cd.Variable(x * (rank + 1)).values[0].numpy())

    def checkpoint() -> float:
        with tempfile.TemporaryDirectory(prefix=f"beside-{rank}-") as folder:
            saved = cd.train.Checkpoint(metric=metric)
            path = saved.save(os.path.join(folder, "ckpt"))
            saved.sync()  # written (by the chief) before the folder goes
            return float(len(path) > 0)

    def dataset() -> float:
        return _number(next(iter(strategy.experimental_distribute_dataset([x, x]))))

    def prepare() -> float:
        import torch

        import crossdevice.torch as cdt

        model = torch.nn.Linear(1, 1, dtype=torch.float64)
        torch.nn.init.constant_(model.weight, float(rank + 1))
        mirrored = cdt.prepare(model, strategy=strategy)
        return float(mirrored.module.weight.detach().reshape(-1)[0])

    return {
        "helper": lambda: _number(_total(strategy, x)),
        "reduce": lambda: _number(strategy.reduce("sum", x, axis=None)),
        "gather": lambda: _number(strategy.gather(x, axis=0)),
        "sync_on_read": lambda: _number(metric.read_value()),
        "batch_reduce_to": lambda: _number(
            strategy.extended.batch_reduce_to("sum", [(x, "CPU:0")])[0]
        ),
        "reduce_to": lambda: _number(strategy.extended.reduce_to("sum", x, "CPU:0")),
        "local_results": lambda: _number(strategy.experimental_local_results(metric)[0]),
        "variable": variable,
        "checkpoint": checkpoint,
        "dataset": dataset,
        "prepare": prepare,
    }


def beside(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict[str, Any]:
    """`beside_one` for each (entry, order) of `cases`, each on a strategy of its own.

    The strategies join one default group made here (a strategy that made it would end
    it when closed), each with groups of its own: an ended one leaves the next intact.
    Results by "entry/order".
    """
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))  # env://
    outs = {f"{e}/{o}": beside_one(rank, world_size, e, o) for e, o in cases}
    # A worker that ended its group stays a moment: its peers read why (the store is
    # rank 0's, and goes with its process).
    time.sleep(1.0)
    return outs


def between(rank: int, world_size: int, entries: list[str]) -> dict[str, Any]:
    """`beside_one` "between" for each of `entries`, all on one strategy (none ends it)."""
    strategy = _strategy()
    outs = {entry: beside_one(rank, world_size, entry, "between", strategy) for entry in entries}
    strategy.close()
    return outs


def beside_one(
    rank: int, world_size: int, entry: str, order: str, strategy: Any = None
) -> dict[str, Any]:
    """A step on the main thread; `entry`'s collective from a "monitor" thread.

    `order` places the monitor's collective on each worker:

    * "during": inside the run (the step waits for it), on every worker;
    * "crossed": inside the run on rank 0, after it on rank 1 (what timing may give);
    * "before": before the run on rank 0 (the run starts while it waits for its peers),
      after it on rank 1;
    * "held": as "before", the run's all-reduce coming while the monitor's waits (rank 1
      starts late);
    * "between": between two runs on every worker, the main thread waiting for it.
    """
    import crossdevice as cd

    del world_size
    own = strategy is None
    if strategy is None:
        strategy = _strategy()
    entries = _entries(strategy, rank)
    ones = np.ones(3, np.float32)
    out: dict[str, Any] = {}
    started, tried, done = threading.Event(), threading.Event(), threading.Event()
    inside = order == "during" or (order == "crossed" and rank == 0)
    first = order in ("before", "held") and rank == 0

    def step(v: Any) -> Any:
        started.set()
        if inside:
            tried.wait(TIMEOUT)  # the monitor's collective comes now, inside the run
        context = cd.get_replica_context()
        if entry == "helper":  # the step reduces through the monitor's helper, too
            return context.merge_call(_total, args=(v,))
        return context.all_reduce("sum", v)

    def monitor() -> None:
        try:
            if inside:
                started.wait(TIMEOUT)
            elif not first:
                done.wait(TIMEOUT)  # after the run
            begin = time.monotonic()
            out["monitor"] = _outcome(entries[entry])
            out["monitor_seconds"] = round(time.monotonic() - begin, 2)
        finally:
            tried.set()

    def run() -> None:
        begin = time.monotonic()
        out["run"] = _outcome(lambda: _number(strategy.run(step, args=(ones,))))
        out["run_seconds"] = round(time.monotonic() - begin, 2)

    thread = threading.Thread(target=monitor, name="monitor")
    if order == "between":
        run()
        done.set()
        thread.start()
        thread.join(3 * TIMEOUT)  # the program orders it: after the run, before the next
    else:
        thread.start()
        if first:
            time.sleep(0.5)  # the monitor's collective waits for its peers
        elif order == "held":
            time.sleep(2.0)  # ... and still does when rank 0's run makes its all-reduce
        run()
        done.set()
        thread.join(3 * TIMEOUT)
    out["after"] = _outcome(lambda: _number(strategy.run(step, args=(ones,))))
    if own:
        strategy.close()
    return out
