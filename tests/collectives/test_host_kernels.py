"""The host kernels equal the naive in-order `np.add` chain, bit for bit.

Every test here runs with the NumPy kernels only, and then with the compiled fused kernel
(`crossdevice._arrays.native`) taking every range it accepts, small ones included, writing
with streaming stores: once per vector loop this CPU can run (AVX2, SSE2, scalar).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossdevice._arrays import NUMPY, host_kernels, native
from crossdevice._core import tuning
from tests.helpers import parametrize

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8, np.complex64]


@pytest.fixture(
    autouse=True, scope="module", params=["numpy", "native-avx2", "native-sse2", "native-scalar"]
)
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the module once per kernel (the compiled one for every size it accepts)."""
    name: str = request.param
    if name.startswith("native"):
        if not native.available():
            pytest.skip("the compiled kernel is not built here (no C compiler at install)")
        isa = name.removeprefix("native-")
        if isa not in native.instruction_sets():
            pytest.skip(f"this CPU cannot run the kernel's {isa} loop")
    with pytest.MonkeyPatch.context() as mp:
        if name == "numpy":
            mp.setattr(native, "_KERNEL", None)
        else:
            mp.setattr(native, "_ISA", name.removeprefix("native-"))
            mp.setattr(
                tuning,
                "TUNING",
                dataclasses.replace(tuning.TUNING, native_min_bytes=0, stream_min_bytes=0),
            )
        yield name


def naive_chain(xs: list[np.ndarray]) -> np.ndarray:
    """The reference: x0 + x1, then += x2, ... one full pass per input."""
    out = np.array(xs[0], copy=True)
    if len(xs) > 1:
        out = np.add(xs[0], xs[1])
    for x in xs[2:]:
        out = np.add(out, x)
    return np.asarray(out)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@st.composite
def operand_lists(draw: Any) -> list[np.ndarray]:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40))
    n = draw(st.integers(1, 7))
    if dtype.kind == "f":
        elements = st.floats(-1e4, 1e4, width=dtype.itemsize * 8, allow_subnormal=False)
    elif dtype.kind == "c":
        elements = st.complex_numbers(max_magnitude=1e4, width=64, allow_subnormal=False)
    else:
        elements = None  # hypothesis picks values across the whole integer range
    return [draw(hnp.arrays(dtype, shape, elements=elements)) for _ in range(n)]


@settings(max_examples=150, deadline=None)
@given(xs=operand_lists(), block=st.integers(1, 50), split=st.integers(0, 60), stream=st.booleans())
def test_sum_slice_in_blocks_is_bitwise_the_naive_chain(
    xs: list[np.ndarray], block: int, split: int, stream: bool
) -> None:
    flats = [x.reshape(-1) for x in xs]
    size = flats[0].shape[0]
    split = min(split, size)
    out = np.empty_like(flats[0])
    # Two "replicas" reduce disjoint slices of one output, in blocks of `block` elements.
    # An odd split leaves the second range's start off the 16-byte grid of the streaming
    # stores: the compiled kernel's scalar head must cover it.
    host_kernels.sum_slice(flats, out, 0, split, block_elements=block, stream=stream)
    host_kernels.sum_slice(flats, out, split, size, block_elements=block, stream=stream)
    assert same_bits(out.reshape(xs[0].shape), naive_chain(xs))


@settings(max_examples=60, deadline=None)
@given(xs=operand_lists())
def test_sum_n_fast_paths_are_bitwise_the_naive_chain(xs: list[np.ndarray]) -> None:
    # Take the blocked, pooled path for tiny arrays, in tiny blocks.
    with pytest.MonkeyPatch.context() as mp:
        fast = dataclasses.replace(
            tuning.TUNING, blocked_min_bytes=0, kernel_parallel_min_bytes=0, block_bytes=16
        )
        mp.setattr(tuning, "TUNING", fast)
        assert same_bits(host_kernels.sum_n(xs), naive_chain(xs))
        assert same_bits(NUMPY.sum_n(xs), naive_chain(xs))


@parametrize(dtype=[np.float16, np.float32, np.float64, np.complex64], divisor=[3, 4])
def test_divisor_matches_true_divide_of_the_sum(dtype: Any, divisor: int) -> None:
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(1000).astype(dtype) for _ in range(4)]
    out = np.empty_like(xs[0])
    host_kernels.sum_slice(xs, out, 0, 1000, divisor=divisor, block_elements=37)
    assert same_bits(out, NUMPY.divide(naive_chain(xs), divisor))
    # Unaligned ranges (the scalar head and tail of the compiled kernel) and streaming.
    out = np.empty_like(xs[0])
    host_kernels.sum_slice(xs, out, 0, 3, divisor=divisor, stream=True)
    host_kernels.sum_slice(xs, out, 3, 1000, divisor=divisor, stream=True)
    assert same_bits(out, NUMPY.divide(naive_chain(xs), divisor))


@pytest.mark.parametrize("n", [2, 4, 5])
def test_large_arrays_use_every_path_and_stay_bitwise(n: int) -> None:
    rng = np.random.default_rng(n)
    size = tuning.TUNING.kernel_parallel_min_bytes // 4 + 12345  # pooled, uneven split
    xs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    assert same_bits(host_kernels.sum_n(xs), naive_chain(xs))
    assert same_bits(host_kernels.sum_n(xs, parallel=False), naive_chain(xs))
    out = np.full_like(xs[0], np.nan)
    assert host_kernels.sum_n(xs, out) is out
    assert same_bits(out, naive_chain(xs))


def test_in_place_accumulation_into_the_first_input() -> None:
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(300_000).astype(np.float32) for _ in range(4)]
    expected = naive_chain(xs)
    host_kernels.sum_n(xs, xs[0])
    assert same_bits(xs[0], expected)


def test_partially_overlapping_out_takes_the_plain_path() -> None:
    base = np.arange(600_000, dtype=np.float64)
    xs = [base[:500_000], base[1:500_001], base[2:500_002]]
    expected = naive_chain([x.copy() for x in xs])
    out = base[50:500_050]  # overlaps every input at an offset
    assert not host_kernels.can_sum_fast(xs, out)
    reference = base.copy()
    host_kernels.plain_sum(
        [reference[:500_000], reference[1:500_001], reference[2:500_002]],
        reference[50:500_050],
    )
    host_kernels.sum_n(xs, out)
    assert same_bits(base, reference)
    assert expected.shape == out.shape


def test_broadcasting_and_mixed_dtypes_follow_numpy() -> None:
    xs = [np.ones((3, 4), np.float32), np.arange(4, dtype=np.float32), np.float32(2)]
    assert same_bits(host_kernels.sum_n(xs), naive_chain(xs))
    mixed = [np.ones(5, np.int32), np.ones(5, np.float64)]
    assert same_bits(host_kernels.sum_n(mixed), naive_chain(mixed))


def test_scalars_give_0d_arrays_and_one_input_is_copied() -> None:
    result = NUMPY.sum_n([np.float32(1), np.float32(2)])
    assert isinstance(result, np.ndarray)
    assert result.shape == ()
    x = np.arange(3.0)
    copy = host_kernels.sum_n([x])
    assert copy is not x
    np.testing.assert_array_equal(copy, x)


def test_empty_input_list_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        host_kernels.sum_n([])
    with pytest.raises(ValueError, match="at least one"):
        host_kernels.sum_slice([], np.empty(3), 0, 3)


def test_run_parallel_runs_every_part_and_reraises() -> None:
    seen: list[int] = []
    host_kernels.run_parallel(seen.append, 5)
    assert sorted(seen) == [0, 1, 2, 3, 4]
    failure = ArithmeticError("part 3")

    def task(k: int) -> None:
        if k == 3:
            raise failure

    with pytest.raises(ArithmeticError) as info:
        host_kernels.run_parallel(task, 4)
    assert info.value is failure


def test_large_results_reuse_buffers_nobody_holds_and_never_live_ones() -> None:
    rng = np.random.default_rng(7)
    size = tuning.TUNING.blocked_min_bytes // 4 + 5
    xs = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
    ys = [x * 2 for x in xs]
    first = host_kernels.sum_n(xs)
    second = host_kernels.sum_n(ys)
    # Both alive: two different buffers, neither overwritten by the other sum.
    assert not np.shares_memory(first, second)
    assert same_bits(first, naive_chain(xs))
    assert same_bits(second, naive_chain(ys))
    address = second.__array_interface__["data"][0]
    del second  # nobody holds it: the next sum of that size may reuse it
    third = host_kernels.sum_n(ys)
    assert third.__array_interface__["data"][0] == address
    assert same_bits(third, naive_chain(ys))
    assert same_bits(first, naive_chain(xs))
    assert third.flags.writeable  # a result the caller owns, like np.add's


@parametrize(dtype=[np.float32, np.float64, np.int32, np.uint64], stream=[False, True])
def test_every_alignment_and_length_around_the_vector_loop(dtype: Any, stream: bool) -> None:
    # Offsets 0-17 elements put the output at every 4-byte position of a 32-byte AVX2
    # line, lengths around multiples of two vectors leave every possible tail.
    rng = np.random.default_rng(3)
    base = [rng.integers(-1000, 1000, 160).astype(dtype) for _ in range(3)]
    divisors = [None, 3] if np.dtype(dtype).kind == "f" else [None]
    for offset in range(18):
        for length in (*range(40), 63, 64, 65, 127, 128, 129):
            xs = [b[offset : offset + length] for b in base]
            for divisor in divisors:
                out = np.empty(160, dtype)[offset : offset + length]
                host_kernels.sum_slice(xs, out, divisor=divisor, stream=stream)
                expected = naive_chain(xs)
                if divisor is not None:
                    expected = np.true_divide(expected, divisor).astype(dtype)
                assert same_bits(out, expected), (offset, length, divisor)


def test_the_compiled_kernel_takes_what_it_supports_and_nothing_else(kernel: str) -> None:
    native_on = kernel.startswith("native")
    if native_on:
        assert native.instruction_set() == kernel.removeprefix("native-")
        assert native.instruction_sets()[-1] == "scalar"
    else:
        assert native.instruction_set() == ""
        assert native.instruction_sets() == ()
    xs = [np.ones(8, np.float32)] * 3
    out = np.empty(8, np.float32)
    assert native.can_sum(xs, out, None) is native_on
    assert native.can_sum(xs, out, 3) is native_on
    ints = [np.ones(8, np.int32)] * 3
    assert native.can_sum(ints, np.empty(8, np.int32), None) is native_on
    assert not native.can_sum(ints, np.empty(8, np.int32), 3)  # integer MEAN: NumPy's path
    halves = [np.ones(8, np.float16)] * 3
    assert not native.can_sum(halves, np.empty(8, np.float16), None)
    unaligned = np.zeros(8 * 4 + 1, np.uint8)[1:].view(np.float32)
    assert not unaligned.flags.aligned
    assert not native.can_sum(xs, unaligned, None)
    strided = np.ones(16, np.float32)[::2]
    assert not native.can_sum([strided, *xs[1:]], out, None)


def test_crossdevice_native_0_turns_the_compiled_kernel_off() -> None:
    code = "from crossdevice._arrays import native; print(native.available())"
    env = {**os.environ, "CROSSDEVICE_NATIVE": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stdout.strip() == "False", done.stderr
