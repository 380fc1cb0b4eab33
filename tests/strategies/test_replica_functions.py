"""What `run` and `merge_call` accept from user code: functions whose bodies run, and
distributed values with one component per replica.

Found by the bug hunt of session 57: a generator function or `async def` given to `run`
returned unevaluated generators or coroutines, whose `all_reduce` ran later in the
default context (a sum over one replica: `[1, 1, 1]` for `[2, 2, 2]`), silently; a
`merge_fn` returning `PerReplica([a, b, c])` to 2 replicas lost `c`, and one of one
component raised a bare `IndexError`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from tests.strategies.conftest import replica_execution

MODES = ["threads", "cooperative"]


def _sum_of_ones() -> Any:
    return cd.get_replica_context().all_reduce("sum", np.ones(3, np.float32))


def _generator_fn() -> Any:
    yield _sum_of_ones()


async def _async_fn() -> Any:
    return _sum_of_ones()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("fn", "kind"), [(_generator_fn, "a generator function"), (_async_fn, "an async function")]
)
def test_a_function_whose_body_would_run_later_is_refused(mode: str, fn: Any, kind: str) -> None:
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    with replica_execution(mode), pytest.raises(TypeError, match=f"got {kind}"):
        strategy.run(fn)
    with replica_execution(mode), pytest.raises(TypeError, match=f"got {kind}"):
        strategy.run(lambda: cd.get_replica_context().merge_call(fn))
    with replica_execution(mode):  # the strategy is still usable
        total = strategy.run(_sum_of_ones)
    assert strategy.experimental_local_results(total)[0].tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("mode", MODES)
def test_a_generator_returned_by_each_replica_is_refused(mode: str) -> None:
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    with replica_execution(mode), pytest.raises(TypeError, match="returned a generator whose"):
        strategy.run(lambda: (x for x in [_sum_of_ones()]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("parts", [1, 3])
def test_a_merge_fn_result_of_another_replica_count_is_an_error(mode: str, parts: int) -> None:
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])

    def step() -> Any:
        return cd.get_replica_context().merge_call(lambda s: cd.PerReplica(list(range(parts))))

    counts = rf"merge_fn's result: .* has {parts} components, but .* has 2 local replicas"
    with replica_execution(mode), pytest.raises(ValueError, match=counts):
        strategy.run(step)
    with replica_execution(mode):
        got = strategy.run(
            lambda: cd.get_replica_context().merge_call(lambda s: cd.PerReplica([7, 8]))
        )
    assert strategy.experimental_local_results(got) == (7, 8)


@pytest.mark.parametrize("mode", MODES)
def test_a_variable_of_another_strategy_updated_in_run_names_both(mode: str) -> None:
    """It failed deep inside with "requires being in cross-replica context"."""
    strategy, other = cd.MirroredStrategy(["CPU:0", "CPU:1"]), cd.MirroredStrategy(["CPU:0"])
    with other.scope():
        v = cd.Variable(np.zeros(3, np.float32))
    with replica_execution(mode), pytest.raises(RuntimeError, match="mixing different crossdevice"):
        strategy.run(lambda: v.assign_add(np.ones(3, np.float32)))
    assert v.numpy().tolist() == [0.0, 0.0, 0.0]
