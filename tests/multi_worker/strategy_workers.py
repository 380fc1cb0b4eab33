"""Worker-side scenarios for the MultiWorkerMirroredStrategy tests (run in child processes)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def _strategy(local: int, timeout: float | None = 30.0) -> Any:
    import crossdevice as cd

    cd.config.set_logical_cpu_devices(max(local, 2))
    options = cd.experimental.CommunicationOptions(timeout_seconds=timeout, bytes_per_pack=64)
    return cd.MultiWorkerMirroredStrategy(
        communication_options=options, devices=[f"CPU:{i}" for i in range(local)]
    )


def _np(x: Any) -> Any:
    return np.asarray(x).tolist()


def scenarios(rank: int, world_size: int, local: int, use_torch: bool) -> dict[str, Any]:
    """Every collective through the strategy API; results go back to the test as lists."""
    import crossdevice as cd

    strategy = _strategy(local)
    make: Any = np.asarray
    if use_torch:
        import torch

        def make(x: Any) -> Any:
            return torch.as_tensor(np.asarray(x))

    out: dict[str, Any] = {"num_replicas": strategy.num_replicas_in_sync}

    def step() -> Any:
        ctx = cd.get_replica_context()
        r = ctx.replica_id_in_sync_group
        x = make(np.full((2, 3), r + 1.0, np.float32))
        return (
            r,
            ctx.all_reduce("sum", {"x": x, "y": [x * 2, make(np.int32(r))]}),
            ctx.all_reduce("mean", x),
            ctx.all_gather(make(np.full((r + 1, 2), r, np.int32)), axis=0),
        )

    results = strategy.experimental_local_results(strategy.run(step))
    out["ids"] = [r[0] for r in results]
    out["sum_x"] = [_np(r[1]["x"]) for r in results]
    out["sum_y"] = [_np(r[1]["y"][0]) for r in results]
    out["sum_int"] = [_np(r[1]["y"][1]) for r in results]
    out["mean"] = [_np(r[2]) for r in results]
    out["gather"] = [_np(r[3]) for r in results]

    # batch_reduce_to inside merge_call, several values in one batch.
    def batch_step() -> Any:
        ctx = cd.get_replica_context()
        r = ctx.replica_id_in_sync_group

        def merge_fn(s: Any, a: Any, b: Any) -> Any:
            return s.extended.batch_reduce_to("sum", [(a, a), (b, b)])

        return ctx.merge_call(merge_fn, args=(make(np.float32(r)), make(np.arange(3.0) * r)))

    batch = strategy.experimental_local_results(strategy.run(batch_step))
    out["batch"] = [[_np(x) for x in b] for b in batch]

    # Strategy.reduce with and without an axis, on a partial batch: replica r holds r + 1
    # elements valued r.
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: make(
            np.full(ctx.replica_id_in_sync_group + 1, float(ctx.replica_id_in_sync_group))
        )
    )
    out["reduce_sum_axis0"] = _np(strategy.reduce("sum", value, axis=0))
    out["reduce_mean_axis0"] = _np(strategy.reduce("mean", value, axis=0))
    scalar = strategy.experimental_distribute_values_from_function(
        lambda ctx: make(np.float32(ctx.replica_id_in_sync_group))
    )
    out["reduce_sum_none"] = _np(strategy.reduce("sum", scalar, axis=None))
    # A device string without job or task names this worker's device (TF fills them in).
    extended = strategy.extended
    out["reduce_to_cpu0"] = [
        float(_np(extended.reduce_to("sum", scalar, destinations="CPU:0"))),
        float(_np(extended.batch_reduce_to("sum", [(scalar, "CPU:0")])[0])),
    ]
    out["gather_cross_replica"] = _np(strategy.gather(value, axis=0))
    # What `run` returns (a plain value with one replica per worker), gathered.
    predicted = strategy.run(
        lambda: make(np.full(2, float(cd.get_replica_context().replica_id_in_sync_group)))
    )
    out["gather_run"] = _np(strategy.gather(predicted, axis=0))
    out["plain_sum"] = _np(strategy.reduce("sum", make(np.float32(1.0)), axis=None))
    # Along an axis a plain value counts once per replica in sync, as TF's `run` gives it
    # to every replica before the sum (MEAN: every worker's examples, each worker alike).
    mine = make(np.full(3, rank + 1.0))
    out["plain_sum_axis0"] = _np(strategy.reduce("sum", mine, axis=0))
    out["plain_mean_axis0"] = _np(strategy.reduce("mean", mine, axis=0))

    # Variables start from the chief's value; replica updates aggregate over all workers.
    with strategy.scope():
        v = cd.Variable(make(np.full(2, float(rank + 7), np.float32)), aggregation="sum")
    out["initial"] = [_np(c.numpy()) for c in v.values]

    def update() -> None:
        r = cd.get_replica_context().replica_id_in_sync_group
        v.assign_add(make(np.full(2, r + 1.0, np.float32)))

    strategy.run(update)
    out["updated"] = [_np(c.numpy()) for c in v.values]

    # ONLY_FIRST_REPLICA: the first replica of all (worker 0's), on every worker.
    first = cd.VariableAggregation.ONLY_FIRST_REPLICA
    with strategy.scope():
        w = cd.Variable(make(np.float32(10.0)), aggregation=first)
        m = cd.Variable(make(np.float32(0.0)), synchronization="ON_READ", aggregation=first)

    def update_first() -> None:
        r = cd.get_replica_context().replica_id_in_sync_group
        w.assign_add(make(np.float32(r + 1.0)))
        m.assign(make(np.float32(r + 1.0)))

    strategy.run(update_first)
    out["first_replica"] = [float(_np(w.numpy())), float(_np(m.numpy()))]

    # Dataset sharding: every worker reads the same global batches, keeps its replicas'.
    batches = [np.arange(14)[i : i + 8] for i in (0, 8)]
    shards = []
    for per_replica in strategy.experimental_distribute_dataset(batches):
        shards.append([_np(x) for x in strategy.experimental_local_results(per_replica)])
    out["shards"] = shards

    # A cross-replica assign of a SUM variable: every replica of every worker its share.
    with strategy.scope():
        count = cd.Variable(np.int64(0), synchronization="on_read", aggregation="sum")
        total = cd.Variable(np.float64(0), synchronization="on_read", aggregation="sum")
    assigned = count.assign(7)  # returns the cross-replica read: the SUM over all workers
    total.assign(6.0)
    count.assign(8, read_value=False)
    count.assign(7, read_value=False)
    out["count_assigned"] = int(np.asarray(assigned))
    e = strategy.extended
    out["roles"] = [
        e.should_checkpoint,
        e.should_save_summary,
        e.experimental_should_init,
        e.experimental_between_graph,
    ]
    out["count_parts"] = [int(c.numpy()) for c in count.values]
    out["total_parts"] = [float(c.numpy()) for c in total.values]
    out["count"], out["total"] = int(count.numpy()), float(total.numpy())
    return out


def stall_in_all_reduce(rank: int, world_size: int, culprit: int, how: str) -> Any:
    """Every worker all-reduces; the culprit sleeps (or dies) instead."""
    import os

    import crossdevice as cd

    strategy = _strategy(1, timeout=3.0)
    if rank == culprit:
        if how == "die":
            os._exit(3)
        time.sleep(60)
    start = time.monotonic()
    try:
        strategy.run(lambda: cd.get_replica_context().all_reduce("sum", np.float32(1)))
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "elapsed": time.monotonic() - start,
        }
    return {"type": None, "elapsed": time.monotonic() - start}


def raised_outside_run(rank: int, world_size: int, where: str) -> dict[str, Any]:
    """Worker 1 raises outside `run` (its dataset, or `strategy.reduce` refusing its value)
    where worker 0 waits for it in a collective; each worker's error type and text."""
    del world_size

    strategy = _strategy(1, timeout=60.0)  # a hang would show as a timeout a minute on

    def batches() -> Any:
        for i in range(3):
            if rank == 1 and i == 1 and where == "dataset":
                raise OSError("disk gone")
            yield np.arange(4.0) + i

    try:
        for x in strategy.experimental_distribute_dataset(batches()):
            value = strategy.run(lambda x: x * 2.0, args=(x,))
            strategy.reduce("sum", value, axis=3 if rank == 1 and where == "reduce" else 0)
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None}


def sync_on_read_on_chief_only(rank: int, world_size: int, local: int) -> dict[str, Any]:
    """A metric (a SyncOnRead variable) read on the chief only, as a user logging it might;
    the other workers go on to the next step, whose dataset check is a collective too."""
    import crossdevice as cd

    strategy = _strategy(local, timeout=20.0)
    with strategy.scope():
        total = cd.Variable(0.0, synchronization="ON_READ", aggregation="sum", name="loss_sum")
    batches = [np.ones((2 * world_size * local, 1), np.float32)] * 3
    iterator = iter(strategy.experimental_distribute_dataset(batches))

    def step(x: Any) -> None:
        total.assign_add(float(np.sum(x)))

    strategy.run(step, args=(next(iterator),))
    start = time.monotonic()
    try:
        if rank == 0:
            print(float(total.numpy()))  # the chief logs the metric: a collective
        strategy.run(step, args=(next(iterator),))
    except Exception as err:
        return {
            "type": type(err).__name__,
            "message": str(err),
            "elapsed": time.monotonic() - start,
        }
    return {"type": None}


def has_data_in_flight(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 comes to each `next(iterator)` a second late; rank 0 times its own calls."""
    del world_size
    import crossdevice as cd

    strategy = _strategy(1)
    batches = [np.full((2, 1), float(i + 1), np.float32) for i in range(3)]
    iterator = iter(strategy.experimental_distribute_dataset(batches))

    def step(x: Any) -> Any:
        return cd.get_replica_context().all_reduce("sum", x)

    waits, sums = [], []
    for _ in batches:
        if rank == 1:
            time.sleep(1.0)
        start = time.monotonic()
        x = next(iterator)
        waits.append(time.monotonic() - start)
        sums.append(_np(strategy.run(step, args=(x,))))
    try:
        next(iterator)
    except StopIteration:
        return {"waits": waits, "sums": sums}
    raise AssertionError("the iterator went on past the data")


def has_data_per_pass(rank: int, world_size: int, how: str) -> dict[str, Any]:
    """Passes over a list of global batches, counting the has-data collectives sent.

    `how`: "train" (each step all-reduces), "quiet" (steps with no collective), "ahead"
    (rank 1 takes one `next()` more than rank 0 mid-pass) or "lying" (a Sequence whose
    `len()` is one short of what it yields).
    """
    from collections.abc import Sequence

    import crossdevice as cd

    strategy = _strategy(1, timeout=20.0)
    communicator = strategy.extended._worker_communicator
    sent = []
    issue = communicator.any_has_data_async

    def counting(*args: Any, **kwargs: Any) -> Any:
        sent.append(kwargs.get("steps"))
        return issue(*args, **kwargs)

    communicator.any_has_data_async = counting
    batches = [np.full((2, 1), float(i + 1), np.float32) for i in range(4)]

    class Lying(Sequence):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(batches) - 1

        def __getitem__(self, i: Any) -> Any:
            return batches[i]

        def __iter__(self) -> Any:
            return iter(batches)

    def step(x: Any) -> Any:
        return cd.get_replica_context().all_reduce("sum", x)

    sums: list[Any] = []
    try:
        for _ in range(2):  # two passes: each agrees on the length once
            iterator = iter(
                strategy.experimental_distribute_dataset(Lying() if how == "lying" else batches)
            )
            for i, x in enumerate(iterator):
                if how == "quiet":  # a step that makes no collective
                    got = strategy.experimental_local_results(strategy.run(lambda v: v, args=(x,)))
                    sums.append(_np(got[0]))
                    continue
                sums.append(_np(strategy.run(step, args=(x,))))
                if how == "ahead" and rank == 1 and i == 1:
                    next(iterator)  # after a collective: its agreement is skipped, numbered
    except Exception as err:
        return {"type": type(err).__name__, "message": str(err), "sent": sent}
    return {"type": None, "sums": sums, "sent": sent}
