"""Packing (property tests): pack then unpack is identity; packed all-reduce = NumPy."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossdevice._cross_device import HierarchicalCopyAllReduce, NcclAllReduce
from crossdevice._cross_device.packing import pack, plan_packs, split_sizes, unpack
from crossdevice._values.values import Mirrored, PerReplica
from tests.conftest import Backend
from tests.cross_device.cases import (
    DTYPES,
    assert_unchanged,
    dtype_name,
    make,
    reference,
    snapshot,
)
from tests.helpers import to_numpy

# The `backend` fixture only says which library to build values with; it holds no state
# between examples, so reusing it across hypothesis examples is safe.
PROPERTY = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def batches(draw: st.DrawFn, library: str) -> tuple[list[tuple[int, ...]], list[str]]:
    """Shapes and dtypes of a batch of 0 to 6 arrays."""
    count = draw(st.integers(0, 6))
    return (
        [draw(shapes) for _ in range(count)],
        [draw(st.sampled_from(DTYPES[library])) for _ in range(count)],
    )


def test_split_sizes_follow_tf() -> None:
    assert split_sizes(10, 1) == (10,)
    assert split_sizes(10, 3) == (3, 3, 4)
    assert split_sizes(3, 5) == (0, 0, 0, 0, 3)
    assert split_sizes(0, 2) == (0, 0)
    with pytest.raises(ValueError, match="num_packs >= 1, got 0"):
        split_sizes(4, 0)


@PROPERTY
@given(data=st.data(), num_packs=st.integers(0, 12))
def test_pack_then_unpack_is_identity(
    backend: Backend, data: st.DataObject, num_packs: int
) -> None:
    batch_shapes, dtypes = data.draw(batches(backend.name))
    rng = np.random.default_rng(len(batch_shapes))
    arrays = [
        make(backend, rng.integers(-100, 100, size=shape), dtype)
        for shape, dtype in zip(batch_shapes, dtypes, strict=True)
    ]
    before = snapshot(*arrays)
    plan = plan_packs(arrays, num_packs)
    pieces = pack(plan, arrays)
    assert len(pieces) == plan.num_pieces == len(plan.borrowed_pieces())
    assert plan.borrows == any(plan.borrowed_pieces()) or (num_packs == 0 and not arrays)
    if num_packs:
        groups = {dtype: [i for i, d in enumerate(dtypes) if d == dtype] for dtype in dtypes}
        assert plan.num_pieces == num_packs * len(groups)
        for group, sizes in zip(plan.groups, plan.piece_sizes, strict=True):
            total = sum(math.prod(batch_shapes[i]) for i in group)
            assert sizes == split_sizes(total, num_packs)
            assert len({dtypes[i] for i in group}) == 1  # packed by dtype
        # The pieces themselves are cut at TF's sizes, in order.
        cut = [n for sizes in plan.piece_sizes for n in sizes]
        assert [tuple(p.shape) for p in pieces] == [(n,) for n in cut]
    restored = unpack(plan, pieces)
    assert len(restored) == len(arrays)
    for original, back in zip(arrays, restored, strict=True):
        assert tuple(back.shape) == tuple(original.shape)
        assert dtype_name(back) == dtype_name(original)
        np.testing.assert_array_equal(to_numpy(back), to_numpy(original))
    assert_unchanged(before, *arrays)


@PROPERTY
@given(
    data=st.data(),
    n=st.integers(1, 9),
    num_packs=st.integers(0, 8),
    op=st.sampled_from(["SUM", "MEAN"]),
    nccl=st.booleans(),
)
def test_packed_all_reduce_equals_numpy(
    backend: Backend, data: st.DataObject, n: int, num_packs: int, op: str, nccl: bool
) -> None:
    batch_shapes, dtypes = data.draw(batches(backend.name))
    rng = np.random.default_rng(n)
    devices = [f"CPU:{i}" for i in range(n)]
    values = [
        PerReplica(
            [make(backend, rng.integers(-4, 5, size=shape), dtype) for _ in range(n)], devices
        )
        for shape, dtype in zip(batch_shapes, dtypes, strict=True)
    ]
    ops: Any = NcclAllReduce(num_packs) if nccl else HierarchicalCopyAllReduce(num_packs)
    before = snapshot(*values)
    results = ops.batch_reduce(op, [(v, v) for v in values])
    assert len(results) == len(values)
    for value, result in zip(values, results, strict=True):
        components = result.values if isinstance(result, Mirrored) else (result,)
        dtype = dtype_name(value.values[0])
        rtol, atol = ((1e-2, 5e-2) if "16" in dtype else (1e-6, 1e-6)) if op == "MEAN" else (0, 0)
        for c in components:
            np.testing.assert_allclose(
                to_numpy(c).astype(np.float64), reference(value, op), rtol=rtol, atol=atol
            )
    assert_unchanged(before, *values)


def test_a_lone_array_is_packed_as_a_view(backend: Backend) -> None:
    big = make(backend, np.arange(12).reshape(3, 4), "float32")
    pair = [make(backend, np.ones(2), "int32"), make(backend, np.ones(3), "int32")]
    plan = plan_packs([big, *pair], num_packs=2)
    pieces = pack(plan, [big, *pair])
    assert plan.borrowed_pieces() == [True, True, False, False]
    flat_big = to_numpy(big).reshape(-1)
    np.testing.assert_array_equal(np.concatenate([to_numpy(p) for p in pieces[:2]]), flat_big)
    if backend.name == "numpy":
        assert np.shares_memory(pieces[0], big)  # no copy of a large single tensor
    else:
        assert pieces[0].data_ptr() == big.data_ptr()


@pytest.mark.parametrize("num_packs", [1, 2])
def test_numpy_and_torch_of_one_dtype_pack_apart(num_packs: int, torch_module: Any) -> None:
    """A NumPy float32 (a Python float) beside a torch float32 is never concatenated."""
    arrays = [torch_module.ones(3), np.float32(2.0) * np.ones((), np.float32), torch_module.ones(2)]
    plan = plan_packs(arrays, num_packs)
    assert sorted(plan.groups) == [(0, 2), (1,)]
    out = unpack(plan, pack(plan, arrays))
    assert torch_module.equal(out[0], arrays[0])
    assert torch_module.equal(out[2], arrays[2])
    assert isinstance(out[1], np.ndarray)
    assert float(out[1]) == 2.0
