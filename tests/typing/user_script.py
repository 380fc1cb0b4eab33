"""A user's data-parallel program, type-checked with `mypy --strict` by `test_typing.py`.

It must pass without casts, ignore comments or None checks the library could spare:
what a user writes against crossdevice's public annotations.
"""

from __future__ import annotations

from typing import Any, assert_type

import numpy as np
import numpy.typing as npt

import crossdevice
from crossdevice.datasets import load_digits, train_test_split

Array = npt.NDArray[np.float32]


def step(x: Array, w: crossdevice.Variable) -> Array:
    ctx = crossdevice.replica_context()
    assert_type(ctx, crossdevice.ReplicaContext)
    replica = ctx.replica_id_in_sync_group
    replicas = ctx.num_replicas_in_sync
    assert_type(replica, int)
    assert_type(replicas, int)
    strategy = ctx.strategy
    assert_type(strategy, crossdevice.Strategy)
    assert_type(strategy.extended, crossdevice.StrategyExtended)
    assert strategy.num_replicas_in_sync == replicas
    assert 0 <= replica < replicas
    grad = np.asarray(x.mean(axis=0), dtype=np.float32)

    def apply(strategy: crossdevice.Strategy, grad: crossdevice.PerReplica) -> None:
        total = strategy.extended.reduce_to("mean", grad, destinations=w)
        strategy.extended.update(w, lambda v, g: v.assign_sub(0.1 * g), args=(total,))

    ctx.merge_call(apply, args=(grad,))
    summed: Array = ctx.all_reduce(crossdevice.ReduceOp.SUM, grad)
    return summed


def main() -> float:
    images, labels = load_digits()
    x_train, _, _, _ = train_test_split(images, labels, 0.2, seed=0)
    x = (x_train[:64] / 16.0).astype(np.float32)

    strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope() as scoped:
        assert_type(scoped, crossdevice.Strategy)
        current = crossdevice.get_strategy()
        assert_type(current, crossdevice.Strategy)
        assert_type(crossdevice.get_cross_replica_context(), crossdevice.Strategy | None)
        assert_type(crossdevice.get_replica_context(), crossdevice.ReplicaContext | None)
        assert current is scoped is strategy
        assert crossdevice.get_cross_replica_context() is strategy
        w = crossdevice.Variable(np.zeros(64, np.float32))
    batches = strategy.experimental_distribute_values_from_function(
        lambda ctx: x[ctx.replica_id_in_sync_group :: ctx.num_replicas_in_sync]
    )
    result = strategy.run(step, args=(batches, w))
    locals_ = strategy.experimental_local_results(result)
    assert_type(locals_, tuple[Any, ...])
    n = strategy.num_replicas_in_sync
    assert_type(n, int)
    assert len(locals_) == n
    return float(np.asarray(strategy.reduce("sum", result, axis=None)).sum())


if __name__ == "__main__":
    print(f"{main():.4f}")
