"""The fault matrix: every way a step can go wrong, on every in-process strategy and mode.

Each cell is (strategy, replica count, execution mode, fault). No timeout is configured
anywhere, so a cell that does not end is a hang (pytest's faulthandler_timeout prints the
stacks). Every cell must end in the step's own exception or in a clear error naming the
replicas' calls; the next normal run on the same strategy must give the right answer; and
a cell must end the same way (exception type and message) on replica threads and as
cooperative replicas.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._core.errors import ReplicaAbortedError
from tests.strategies.conftest import replica_execution


class BoomError(Exception):
    """The step's own error."""


def _devices(n: int) -> list[str]:
    return [f"CPU:{i}" for i in range(n)]


#: (id, factory(n), replica counts)
STRATEGIES: list[tuple[str, Callable[[int], Any], tuple[int, ...]]] = [
    ("mirrored", lambda n: cd.MirroredStrategy(_devices(n)), (1, 2, 3, 4, 8)),
    (
        "mirrored_reduce_to_one",
        lambda n: cd.MirroredStrategy(_devices(n), cross_device_ops=cd.ReductionToOneDevice()),
        (1, 2, 3, 4, 8),
    ),
    (
        "central_storage",
        lambda n: cd.experimental.CentralStorageStrategy(_devices(n), "CPU:0"),
        (1, 2, 3, 4, 8),
    ),
    ("one_device", lambda n: cd.OneDeviceStrategy("CPU:0"), (1,)),
    ("default", lambda n: cd.get_strategy(), (1,)),
]

MODES = ("threads", "cooperative")

X = np.ones(3, np.float32)


def _ctx() -> tuple[Any, int, int]:
    ctx = cd.get_replica_context()
    assert ctx is not None
    return ctx, ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync


def _raise(message: str) -> Any:
    raise BoomError(message)


def exception_in_every_replica() -> Any:
    _, r, _ = _ctx()
    raise BoomError(f"replica {r}")


def exception_in_one_replica() -> Any:
    ctx, r, n = _ctx()
    if r == n - 1:
        raise BoomError("the last replica")
    return ctx.merge_call(lambda strategy: 1)


def exception_in_merge_fn() -> Any:
    ctx, _, _ = _ctx()
    return ctx.merge_call(lambda strategy: _raise("in merge_fn"))


def exception_after_a_merge() -> Any:
    ctx, r, n = _ctx()
    ctx.all_reduce("sum", X)
    if r == n - 1:
        raise BoomError("after the merge")
    return ctx.all_reduce("sum", X)


def skips_a_merge_call() -> Any:
    ctx, r, n = _ctx()
    if r == n - 1:
        return None
    return ctx.merge_call(lambda strategy: 1)


def skips_an_all_reduce() -> Any:
    ctx, r, n = _ctx()
    if r == n - 1:
        return None
    return ctx.all_reduce("sum", X)


def makes_an_extra_merge_call() -> Any:
    ctx, r, n = _ctx()
    ctx.merge_call(lambda strategy: 1)
    if r == n - 1:
        ctx.merge_call(lambda strategy: 2)


def merge_call_against_all_reduce() -> Any:
    ctx, r, n = _ctx()
    if r == n - 1:
        return ctx.merge_call(lambda strategy: 1)
    return ctx.all_reduce("sum", X)


def different_shapes() -> Any:
    ctx, r, n = _ctx()
    return ctx.all_reduce("sum", np.ones(4 if r == n - 1 else 3, np.float32))


def different_dtypes() -> Any:
    ctx, r, n = _ctx()
    return ctx.all_reduce("sum", np.ones(3, np.float64 if r == n - 1 else np.float32))


def different_dict_keys() -> Any:
    ctx, r, n = _ctx()
    return ctx.all_reduce("sum", {"b" if r == n - 1 else "a": X})


def tuple_against_list() -> Any:
    ctx, r, n = _ctx()
    return ctx.all_reduce("sum", [X, X] if r == n - 1 else (X, X))


def different_reduce_ops() -> Any:
    ctx, r, n = _ctx()
    return ctx.all_reduce("mean" if r == n - 1 else "sum", X)


def different_gather_axes() -> Any:
    ctx, r, n = _ctx()
    return ctx.all_gather(np.ones((2, 2), np.float32), axis=1 if r == n - 1 else 0)


#: The step's own error must reach the caller in these cells.
RAISING = [
    exception_in_every_replica,
    exception_in_one_replica,
    exception_in_merge_fn,
    exception_after_a_merge,
]
#: The replicas disagree: a clear error once there are two of them.
DISAGREEING = [
    skips_a_merge_call,
    skips_an_all_reduce,
    makes_an_extra_merge_call,
    merge_call_against_all_reduce,
    different_shapes,
    different_dtypes,
    different_dict_keys,
    tuple_against_list,
    different_reduce_ops,
    different_gather_axes,
]


def _outcome(strategy: Any, step: Callable[[], Any]) -> tuple[str, str]:
    """How one run of `step` ends: ("ok", "") or (exception type, message)."""
    try:
        strategy.run(step)
    except ReplicaAbortedError as exc:  # must never reach the caller
        pytest.fail(f"{step.__name__}: ReplicaAbortedError reached the caller: {exc!r}")
    except (BoomError, RuntimeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def _without_report(outcome: tuple[str, str]) -> tuple[str, str]:
    """An outcome without the flight recorder's line end (where its report went)."""
    kind, message = outcome
    return kind, re.sub(r" Flight recorder[^\n]*$", "", message)


def _works(strategy: Any) -> None:
    n = strategy.num_replicas_in_sync
    result = strategy.run(lambda: cd.get_replica_context().all_reduce("sum", np.float32(1)))
    assert [float(x) for x in strategy.experimental_local_results(result)] == [n] * n


def _cells() -> Iterator[Any]:
    for name, factory, counts in STRATEGIES:
        for n in counts:
            yield pytest.param(factory, n, id=f"{name}{n}")


@pytest.mark.parametrize(("factory", "n"), list(_cells()))
def test_every_fault_ends_clearly_and_the_same_way_in_every_mode(
    factory: Callable[[int], Any], n: int
) -> None:
    outcomes: dict[str, list[tuple[str, str]]] = {}
    for mode in MODES:
        with replica_execution(mode):
            strategy = factory(n)
            ended = outcomes[mode] = []
            for step in RAISING + DISAGREEING:
                ended.append(_outcome(strategy, step))
                _works(strategy)
    threads = outcomes["threads"]
    for step, (kind, message) in zip(RAISING + DISAGREEING, threads, strict=True):
        if step in RAISING:
            assert kind == "BoomError", (step.__name__, kind, message)
            if step is exception_in_every_replica:
                assert message == "replica 0"
        elif n == 1:
            assert kind == "ok", (step.__name__, kind, message)  # nobody to disagree with
        else:
            assert kind in ("RuntimeError", "ValueError"), (step.__name__, kind, message)
            assert f"replica {n - 1}" in message or f"replicas [{n - 1}]" in message, (
                step.__name__,
                message,
            )
    for step, on_threads, cooperatively in zip(
        RAISING + DISAGREEING, threads, outcomes["cooperative"], strict=True
    ):
        # Each mode's flight recorder report has a name of its own (its time, its
        # number), and the process's quota may run out between the modes ("no more"):
        # run alone, the test compared those and failed.
        assert _without_report(on_threads) == _without_report(cooperatively), step.__name__


def test_the_matrix_covers_each_reported_case() -> None:
    """The issue's list, by name: a fault added to it must be added to the matrix."""
    names = {step.__name__ for step in RAISING + DISAGREEING}
    assert {
        "exception_in_every_replica",
        "exception_in_one_replica",
        "exception_in_merge_fn",
        "exception_after_a_merge",
        "skips_a_merge_call",
        "skips_an_all_reduce",
        "different_shapes",
        "different_dtypes",
        "different_dict_keys",
        "tuple_against_list",
        "different_reduce_ops",
        "merge_call_against_all_reduce",
    } <= names
