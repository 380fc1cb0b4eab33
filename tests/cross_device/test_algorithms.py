"""The pure collective algorithms, and HierarchicalCopyAllReduce built on them.

The hierarchical copy must give the exact sum and mean for every N (TF drops device
N-1 for odd N) and any num_packs >= 0, including more packs than elements.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from crossdevice._comm.devices import algorithms
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._cross_device import HierarchicalCopyAllReduce
from crossdevice._values.values import Mirrored, PerReplica
from tests.conftest import Backend
from tests.cross_device.cases import (
    assert_unchanged,
    cpu,
    dtype_name,
    make,
    per_replica,
    reference,
    snapshot,
)
from tests.helpers import to_numpy


@pytest.mark.parametrize("n", range(2, 10))
def test_hierarchical_roots_cover_both_halves(n: int) -> None:
    half = n // 2
    for index in range(2 * n + 1):
        m0, m1 = algorithms.hierarchical_roots(n, index)
        assert m0 == index % n
        assert (m0 < half) != (m1 < half), "the roots lie in different halves"
        assert 0 <= m1 < n
    if n % 2 == 0:  # TF's (m0 + g) % N for even N
        assert all(algorithms.hierarchical_roots(n, i)[1] == (i % n + half) % n for i in range(n))
    with pytest.raises(ValueError, match="at least 2 devices, got 1"):
        algorithms.hierarchical_roots(1, 0)


@pytest.mark.parametrize("n", range(1, 10))
def test_hierarchical_copy_all_reduce_sums_every_device(backend: Backend, n: int) -> None:
    # Powers of two make each device's contribution visible in the total.
    values = [make(backend, [2**j, -(2**j)], "int64") for j in range(n)]
    devices = [cpu(j) for j in range(n)]
    before = snapshot(*values)
    for index in range(n + 1):
        out = algorithms.hierarchical_copy_all_reduce(values, devices, ReduceOp.SUM, index)
        assert len(out) == n
        for result in out:
            np.testing.assert_array_equal(to_numpy(result), [2**n - 1, -(2**n - 1)])
        mean = algorithms.hierarchical_copy_all_reduce(values, devices, ReduceOp.MEAN, index)
        for result in mean:
            np.testing.assert_allclose(to_numpy(result), [(2**n - 1) / n, -(2**n - 1) / n])
    assert_unchanged(before, *values)


def test_tf_odd_n_bug_is_fixed(backend: Backend) -> None:
    # TF's g = N // 2 = 1 sums devices [0, 1) and [1, 2): device 2's 100 would be lost.
    values = [make(backend, [v], "float32") for v in (1.0, 10.0, 100.0)]
    out = algorithms.hierarchical_copy_all_reduce(values, [cpu(0), cpu(1), cpu(2)])
    assert [float(to_numpy(o)[0]) for o in out] == [111.0, 111.0, 111.0]


def test_reduce_to_one_and_broadcast(backend: Backend) -> None:
    values = [make(backend, [1.0, 2.0], "float32"), make(backend, [3.0, 6.0], "float32")]
    before = snapshot(*values)
    total = algorithms.reduce_to_one(values, cpu(1))
    np.testing.assert_array_equal(to_numpy(total), [4.0, 8.0])
    mean = algorithms.reduce_to_one(values, cpu(0), ReduceOp.MEAN)
    np.testing.assert_array_equal(to_numpy(mean), [2.0, 4.0])
    custom = algorithms.reduce_to_one(values, cpu(0), accumulation_fn=lambda xs: xs[1] - xs[0])
    np.testing.assert_array_equal(to_numpy(custom), [2.0, 4.0])
    gathered = algorithms.gather_to_one(values, cpu(0), 0)
    np.testing.assert_array_equal(to_numpy(gathered), [1.0, 2.0, 3.0, 6.0])
    copies = algorithms.broadcast(total, [cpu(0), cpu(3)])
    assert len(copies) == 2
    assert_unchanged(before, *values)
    with pytest.raises(ValueError, match="non-empty"):
        algorithms.reduce_to_one([], cpu(0))
    with pytest.raises(ValueError, match="one device per value, got 2 values and 1 devices"):
        algorithms.hierarchical_copy_all_reduce(values, [cpu(0)])


def test_default_accumulation_goes_through_sum_n(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = algorithms.sum_n

    def counting(values: Any) -> Any:
        calls.append(len(values))
        return real(values)

    monkeypatch.setattr(algorithms, "sum_n", counting)
    value = per_replica(backend, 4)
    from crossdevice._cross_device import ReductionToOneDevice

    ReductionToOneDevice().reduce("sum", value, "CPU:0")
    assert calls == [4]
    calls.clear()
    HierarchicalCopyAllReduce().reduce("sum", value, value)
    assert calls == [2, 3]  # the other half onto its root, then this half plus that sum


@pytest.mark.parametrize("num_packs", [0, 1, 2, 3, 5, 7, 64])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_hierarchical_copy_exact_for_every_n(
    backend: Backend, num_packs: int, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    indices: list[int] = []
    real = algorithms.hierarchical_copy_all_reduce

    def spy(*args: Any, **kwargs: Any) -> Any:
        indices.append(kwargs["index"])
        return real(*args, **kwargs)

    monkeypatch.setattr(algorithms, "hierarchical_copy_all_reduce", spy)
    ops = HierarchicalCopyAllReduce(num_packs=num_packs)
    for n in range(1, 10):
        batch = [
            per_replica(backend, n, "float32", (3, 2), seed=n),
            per_replica(backend, n, "int64", (4,), seed=n + 1),
            per_replica(backend, n, "float32", (), seed=n + 2),
            per_replica(backend, n, "float64", (0, 3), seed=n + 3),
        ]
        before = snapshot(*batch)
        indices.clear()
        results = ops.batch_reduce(op, [(v, v) for v in batch])
        # one all-reduce per piece: num_packs per dtype group (3 groups), or per tensor;
        # one replica takes TF's single-replica shortcut (a copy, no all-reduce).
        pieces = 3 * num_packs if num_packs else len(batch)
        assert indices == (list(range(pieces)) if n > 1 else []), n
        for value, result in zip(batch, results, strict=True):
            components = result.values if isinstance(result, Mirrored) else (result,)
            assert len(components) == n
            for c in components:
                expected = reference(value, op)
                assert to_numpy(c).shape == expected.shape
                np.testing.assert_allclose(to_numpy(c), expected, rtol=1e-6, err_msg=f"n={n}")
                if op == "SUM":
                    assert dtype_name(c) == dtype_name(value.values[0])
        assert_unchanged(before, *batch)


def test_falls_back_when_not_an_all_reduce(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = algorithms.hierarchical_copy_all_reduce
    monkeypatch.setattr(
        algorithms,
        "hierarchical_copy_all_reduce",
        lambda *a, **k: calls.append(1) or real(*a, **k),
    )
    value = per_replica(backend, 4)
    other = PerReplica(value.values[:3], devices=value._devices[:3])
    result = HierarchicalCopyAllReduce().reduce("sum", value, other)
    assert calls == []
    assert result._devices == other._devices
    np.testing.assert_array_equal(to_numpy(result.values[2]), reference(value, "SUM"))
    HierarchicalCopyAllReduce().reduce("sum", value, value)
    assert calls == [1]
