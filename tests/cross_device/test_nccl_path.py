"""The NCCL path on CPU: dtype gate, MEAN in one pass, logical GPUs, the launch lock.

torch's CPU build has no CUDA, so these tests stand CPU tensors in for GPU tensors
(`GPU:i` maps to the host) and replace `torch.cuda.nccl` with an emulator that behaves
like torch's real one: bool and float8 go as uint8 (their sums are bit-pattern sums),
complex, int16 and unsigned 16/32/64-bit dtypes raise "Unconvertible NCCL type", and
ops are ncclRedOp_t numbers (0 sum, 2 max, 4 avg). Every test goes through the public
`NcclAllReduce` (or `nccl_status`), so it can fail on code without the fix.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from crossdevice._arrays.torch_backend import TorchBackend  # noqa: E402
from crossdevice._core import devices as devices_module  # noqa: E402
from crossdevice._core.devices import canonicalize  # noqa: E402
from crossdevice._cross_device import NcclAllReduce, ReductionToOneDevice  # noqa: E402
from crossdevice._cross_device import nccl as nccl_module  # noqa: E402
from crossdevice._values.values import Mirrored, PerReplica  # noqa: E402

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz]
#: What torch.cuda.nccl sends as ncclUint8 (nccl.cpp `to_nccl_data_type`).
AS_UINT8 = {torch.bool, torch.uint8, *FLOAT8}
#: What nccl.cpp sends natively (bfloat16 with NCCL >= 2.10).
NATIVE = {torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int8}
NATIVE |= {torch.int32, torch.int64}


class FakeNccl:
    """`torch.cuda.nccl` as torch's C++ binding behaves, on CPU tensors."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, int]] = []  # (collective, wire dtype, op)
        self.buffers: list[list[Any]] = []  # the tensors each all_reduce wrote
        self.read: list[list[Any]] = []  # the tensors each all_reduce read
        self.active = 0
        self.max_active = 0
        self.delay = 0.0
        self.lock = threading.Lock()

    def _enter(self) -> None:
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(self.delay)

    def _exit(self) -> None:
        with self.lock:
            self.active -= 1

    @staticmethod
    def _wire(tensors: list[Any]) -> list[Any]:
        dtype = tensors[0].dtype
        if dtype in AS_UINT8:
            return [t.view(torch.uint8) for t in tensors]
        if dtype not in NATIVE:
            raise RuntimeError(f"Unconvertible NCCL type {dtype}")
        return tensors

    def all_reduce(self, inputs: list[Any], outputs: Any = None, op: int = 0, **kw: Any) -> None:
        self._enter()
        try:
            assert not kw.get("streams")
            assert not kw.get("comms")
            outputs = inputs if outputs is None else outputs
            wire = self._wire(list(inputs))
            self.calls.append(("all_reduce", inputs[0].dtype, op))
            self.buffers.append(list(outputs))
            self.read.append(list(inputs))
            n = len(wire)
            if op == 0:
                total = wire[0].clone()
                for w in wire[1:]:
                    total += w
            elif op == 2:
                total = wire[0].clone()
                for w in wire[1:]:
                    total = torch.maximum(total, w)
            elif op == 4:
                if wire[0].is_floating_point():
                    # ncclAvg on floats is ncclPreMulSum with 1/n.
                    total = wire[0] * (1.0 / n)
                    for w in wire[1:]:
                        total += w * (1.0 / n)
                else:
                    total = wire[0].clone()
                    for w in wire[1:]:
                        total += w
                    total = torch.div(total, n, rounding_mode="floor")
            else:
                raise RuntimeError(f"unexpected ncclRedOp_t {op}")
            for out in self._wire(list(outputs)):
                out.copy_(total)
        finally:
            self._exit()

    @staticmethod
    def version() -> tuple[int, int, int]:
        return (2, 21, 5)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNccl]:
    """Four "GPUs" that are the host, with NCCL emulated (and torch built with NCCL)."""
    emulator = FakeNccl()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch._C, "_nccl_all_reduce", emulator.all_reduce, raising=False)
    monkeypatch.setattr(torch.cuda.nccl, "all_reduce", emulator.all_reduce)
    monkeypatch.setattr(torch.cuda.nccl, "version", emulator.version)
    monkeypatch.setattr(TorchBackend, "torch_device", lambda self, d: torch.device("cpu"))
    _forget_nccl_status()
    yield emulator
    devices_module.set_logical_gpu_devices(None)
    _forget_nccl_status()


def _forget_nccl_status() -> None:
    """Clear the cached NCCL answers (what torch saw before the patches above).

    Called by name, not through hasattr or __dict__.get: a renamed cache must fail the
    fixture, not silently keep answers cached from the real, GPU-less torch.
    """
    nccl_module.nccl_status.cache_clear()  # type: ignore[attr-defined]
    assert nccl_module._nccl_mode.cache_info().currsize == 0


def gpus(n: int) -> list[str]:
    return [canonicalize(f"GPU:{i}") for i in range(n)]


def per_replica(columns: list[Any], n: int) -> PerReplica:
    return PerReplica(columns, devices=gpus(n))


def components(result: Any) -> list[Any]:
    assert isinstance(result, Mirrored)
    return list(result.values)


def int_data(n: int, size: int = 6, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-3, 4, size=size) for _ in range(n)]


# --- the dtype gate -----------------------------------------------------------------------


def test_bool_sums_are_logical_or_as_on_the_cpu(fake: FakeNccl) -> None:
    # The public API refuses bool (as TF); the NCCL kernel must still never count bits.
    bits = [torch.tensor([True, False, True, False]), torch.tensor([True, False, False, False])]
    bits += [torch.tensor([True, False, False, False])] * 2
    out = nccl_module._nccl_all_reduce(bits, tuple(gpus(4)), False)
    in_order = bits[0] + bits[1] + bits[2] + bits[3]  # torch's bool sum: a logical or
    for c in out:
        assert c.dtype == torch.bool
        assert torch.equal(c.view(torch.uint8), in_order.view(torch.uint8)), c.view(torch.uint8)
    assert all(call[1] == torch.bool for call in fake.calls)


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_float8_is_summed_as_numbers_not_bit_patterns(fake: FakeNccl, dtype: Any, op: str) -> None:
    n = 3
    rng = np.random.default_rng(1)
    parts = [torch.tensor(rng.normal(size=8), dtype=torch.float32).to(dtype) for _ in range(n)]
    value = per_replica(parts, n)
    (result,) = NcclAllReduce().batch_reduce(op, [(value, value)])
    exact = sum(p.to(torch.float64) for p in parts)
    if op == "MEAN":
        exact = exact / n
    expected = exact.to(dtype)  # the exact sum (or mean), rounded once
    for c in components(result):
        assert c.dtype == dtype
        if op == "SUM":  # bit for bit: the exact sum whatever NCCL's order
            assert torch.equal(c.view(torch.uint8), expected.view(torch.uint8)), (c, expected)
        else:  # ncclAvg scales each input by 1/n first (-0.0 may come out as 0.0)
            assert torch.equal(c.float(), expected.float()), (c, expected)
    assert [call[1] for call in fake.calls] == [torch.float64]


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.int16], ids=str)
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_dtypes_nccl_cannot_convert_are_exact(fake: FakeNccl, dtype: Any, op: str) -> None:
    n = 4
    if dtype.is_complex:
        parts = [torch.tensor(d, dtype=torch.float64) + 1j * k for k, d in enumerate(int_data(n))]
        parts = [p.to(dtype) for p in parts]
        reference = sum(p.to(torch.complex128) for p in parts)
    else:
        parts = [torch.tensor(d % 200, dtype=torch.int64).to(dtype) for d in int_data(n)]
        reference = sum(p.to(torch.int64) for p in parts)
    value = per_replica(parts, n)
    (result,) = NcclAllReduce(num_packs=0).batch_reduce(op, [(value, value)])
    for c in components(result):
        if op == "SUM":
            assert c.dtype == dtype
            np.testing.assert_array_equal(c.to(reference.dtype).numpy(), reference.numpy())
        else:
            # Integer MEAN is a float (TF's true_divide), complex MEAN stays complex.
            assert c.dtype == (dtype if dtype.is_complex else torch.float32)
            np.testing.assert_allclose(c.numpy(), (reference / n).numpy(), rtol=1e-6)
    assert fake.calls, "NCCL did the work"


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_wide_unsigned_sums_wrap_like_unsigned_arithmetic(fake: FakeNccl, dtype: Any) -> None:
    # The public API refuses these (torch cannot add them on CPU); the kernel sums them right.
    width = {torch.uint16: 16, torch.uint32: 32, torch.uint64: 64}[dtype]
    top = 2**width - 2
    parts = [torch.tensor([top, 5], dtype=dtype), torch.tensor([3, 7], dtype=dtype)]
    out = nccl_module._nccl_all_reduce(parts, tuple(gpus(2)), False)
    unsigned = np.dtype(f"uint{width}")
    expected = np.array([(top + 3) % 2**width, 12], dtype=unsigned)
    for c in out:
        assert c.dtype == dtype
        signed = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
        np.testing.assert_array_equal(c.view(signed).numpy().view(unsigned), expected)


def test_the_gate_is_per_dtype_not_per_batch(fake: FakeNccl) -> None:
    n = 2
    floats = per_replica([torch.ones(3), torch.full((3,), 2.0)], n)
    e4m3 = torch.float8_e4m3fn
    small = per_replica([torch.tensor([1.5, 2.0]).to(e4m3), torch.tensor([0.5, 3.0]).to(e4m3)], n)
    pairs = [(floats, floats), (small, small)]
    out = NcclAllReduce().batch_reduce("sum", pairs)
    # float32 goes to NCCL as it is, float8 as float64: one launch per dtype's pack.
    assert sorted(str(call[1]) for call in fake.calls) == ["torch.float32", "torch.float64"]
    assert [c.tolist() for c in components(out[0])] == [[3.0] * 3] * 2
    assert [c.float().tolist() for c in components(out[1])] == [[2.0, 5.0]] * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("version", [(2, 21, 5), (2, 9, 9)], ids=["nccl-bf16", "nccl-no-bf16"])
def test_half_precision_is_summed_in_float32_and_rounded_once(
    fake: FakeNccl, monkeypatch: pytest.MonkeyPatch, dtype: Any, version: tuple[int, ...]
) -> None:
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: version)
    generator = torch.Generator().manual_seed(0)
    parts = [
        (torch.randn(4096, generator=generator) * (1 + 100 * (k % 2))).to(dtype) for k in range(4)
    ]
    value = per_replica(parts, 4)
    (result,) = NcclAllReduce().batch_reduce("sum", [(value, value)])
    once = (parts[0].float() + parts[1].float() + parts[2].float() + parts[3].float()).to(dtype)
    for c in components(result):
        assert c.dtype == dtype
        assert torch.equal(c, once)
    assert [call[1] for call in fake.calls] == [torch.float32]  # the wire is float32
    per_addition = parts[0] + parts[1] + parts[2] + parts[3]
    assert not torch.equal(per_addition, once)  # rounding at every addition differs


# --- MEAN without a second pass -----------------------------------------------------------


@pytest.mark.parametrize("version", [(2, 21, 5), (2, 9, 0)], ids=["ncclAvg", "no-ncclAvg"])
def test_float_mean_is_written_where_nccl_wrote(
    fake: FakeNccl, monkeypatch: pytest.MonkeyPatch, version: tuple[int, int, int]
) -> None:
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: version)
    n = 4
    parts = [torch.arange(6.0) * (i + 1) for i in range(n)]
    value = per_replica(parts, n)
    (result,) = NcclAllReduce(num_packs=1).batch_reduce("mean", [(value, value)])
    assert len(fake.calls) == 1
    _, _dtype, op = fake.calls[0]
    assert op == (4 if version >= (2, 10) else 0)
    written = {b.untyped_storage().data_ptr() for b in fake.buffers[0]}
    for c in components(result):
        # The result lives in the buffer NCCL wrote: no new tensor per device for MEAN.
        assert c.untyped_storage().data_ptr() in written
        np.testing.assert_allclose(c.numpy(), (torch.arange(6.0) * 10 / n).numpy(), rtol=1e-6)


def test_integer_mean_matches_the_cpu_path_exactly(fake: FakeNccl) -> None:
    n = 3
    data = int_data(n)
    value = per_replica([torch.tensor(d, dtype=torch.int32) for d in data], n)
    (result,) = NcclAllReduce().batch_reduce("mean", [(value, value)])
    on_cpu = PerReplica(
        [torch.tensor(d, dtype=torch.int32) for d in data], devices=["CPU:0", "CPU:1", "CPU:2"]
    )
    expected = ReductionToOneDevice().reduce("mean", on_cpu, "CPU:0")
    assert fake.calls == [("all_reduce", torch.int32, 0)]  # never ncclAvg: it floors
    for c in components(result):
        assert c.dtype == expected.dtype == torch.float32
        assert torch.equal(c, expected)


def test_results_are_distinct_and_inputs_untouched(fake: FakeNccl) -> None:
    n = 3
    parts = [torch.full((4,), float(i)) for i in range(n)]
    before = [p.clone() for p in parts]
    value = per_replica(parts, n)
    for num_packs in (0, 1):
        (result,) = NcclAllReduce(num_packs).batch_reduce("mean", [(value, value)])
        ptrs = {c.untyped_storage().data_ptr() for c in components(result)}
        assert len(ptrs) == n
    for p, b in zip(parts, before, strict=True):
        assert torch.equal(p, b)


# --- logical GPUs ---------------------------------------------------------------------------


def test_nccl_status_compares_physical_gpus(
    fake: FakeNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    devices_module.set_logical_gpu_devices(4)
    status = nccl_module.nccl_status
    assert status(tuple(gpus(2))) == (True, "")  # GPU:0, GPU:1 -> cuda:0, cuda:1
    assert status((canonicalize("GPU:1"), canonicalize("GPU:2"))) == (True, "")  # 1, 0
    ok, reason = status((canonicalize("GPU:0"), canonicalize("GPU:2")))
    assert not ok
    assert "share CUDA device" in reason
    assert "GPU:2" in reason
    ok, reason = status(tuple(gpus(5)))
    assert not ok
    assert "only 4 logical GPUs" in reason
    devices_module.set_logical_gpu_devices(None)
    ok, reason = status((canonicalize("GPU:0"), canonicalize("GPU:2")))
    assert not ok
    assert "only 2 CUDA devices" in reason


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_logical_gpus_on_one_card_sum_in_order_on_the_card(
    fake: FakeNccl, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, op: str
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    devices_module.set_logical_gpu_devices(4)
    n = 4
    rng = np.random.default_rng(3)
    parts = [torch.tensor(rng.normal(size=5), dtype=torch.float32) for _ in range(n)]
    value = per_replica(parts, n)
    ops = NcclAllReduce()
    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        for _ in range(2):
            (result,) = ops.batch_reduce(op, [(value, value)])
    warnings = [r.getMessage() for r in caplog.records if "NcclAllReduce" in r.getMessage()]
    assert len(warnings) == 1
    assert "share CUDA device" in warnings[0]
    assert not fake.calls, "NCCL refuses two ranks on one device: it must not be called"
    in_order = parts[0] + parts[1] + parts[2] + parts[3]
    if op == "MEAN":
        in_order = torch.true_divide(in_order, n)
    comps = components(result)
    assert len({c.untyped_storage().data_ptr() for c in comps}) == n  # one tensor each
    for c in comps:
        assert torch.equal(c, in_order)


# --- NCCL launches are serialised ---------------------------------------------------------


def test_nccl_launches_never_interleave_across_threads(fake: FakeNccl) -> None:
    fake.delay = 0.05
    n = 2
    errors: list[BaseException] = []

    def work() -> None:
        try:
            value = per_replica([torch.ones(3), torch.ones(3)], n)
            NcclAllReduce().batch_reduce("sum", [(value, value)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert len(fake.calls) == 4
    assert fake.max_active == 1, "two torch.cuda.nccl launches ran at once"


def test_users_tensors_are_read_out_of_place_not_cloned(fake: FakeNccl) -> None:
    n = 2
    parts = [torch.full((5,), float(i + 1)) for i in range(n)]
    value = per_replica(parts, n)
    (result,) = NcclAllReduce(num_packs=0).batch_reduce("sum", [(value, value)])
    user = {p.untyped_storage().data_ptr() for p in parts}
    # NCCL reads the user's tensors themselves (no clone pass) and writes new buffers.
    assert {t.untyped_storage().data_ptr() for t in fake.read[0]} == user
    written = {t.untyped_storage().data_ptr() for t in fake.buffers[0]}
    assert not written & user
    assert {c.untyped_storage().data_ptr() for c in components(result)} == written
    assert [p.tolist() for p in parts] == [[1.0] * 5, [2.0] * 5]


# --- end to end on the fake-CUDA harness (tests/fake_cuda.py) ---------------------------


@pytest.fixture
def four_gpus() -> Iterator[Any]:
    from tests.fake_cuda import fake_cuda

    with fake_cuda(4) as state:
        yield state


def on_gpus(make: Any, n: int = 4, device: Any = None) -> PerReplica:
    parts = [make(i).to(device or f"cuda:{i}") for i in range(n)]
    return PerReplica(parts, devices=gpus(n))


def passes(counts: Any, prefix: str = "op:") -> dict[str, int]:
    return {k: v for k, v in counts.items() if k.startswith(prefix) and v}


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("num_packs", [0, 1])
def test_fake_cuda_nccl_all_reduce_places_and_launches_once_per_pack(
    four_gpus: Any, op: str, num_packs: int
) -> None:
    value = on_gpus(lambda i: torch.arange(6.0) * (i + 1))
    other = on_gpus(lambda i: torch.full((2, 2), float(i)))
    four_gpus.counts.clear()
    out = NcclAllReduce(num_packs).batch_reduce(op, [(value, value), (other, other)])
    counts = four_gpus.counts
    assert counts["nccl_all_reduce"] == (2 if num_packs == 0 else 1)
    # No copies between devices or to the host, no host sync, no division pass: MEAN
    # is ncclAvg, and the user's tensors are read out of place rather than cloned.
    assert counts["D2D"] == counts["H2D"] == counts["D2H"] == counts["sync"] == 0
    kernels = passes(counts)
    assert not {k for k in kernels if "div" in k or "clone" in k}, kernels
    scale = 1 / 4 if op == "mean" else 1
    for result, expected in (
        (out[0], torch.arange(6.0) * 10 * scale),
        (out[1], torch.full((2, 2), 6.0 * scale)),
    ):
        comps = components(result)
        assert [c.device for c in comps] == [torch.device("cuda", i) for i in range(4)]
        assert len({c.untyped_storage().data_ptr() for c in comps}) == 4
        for c in comps:
            assert torch.equal(c.cpu(), expected)


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, torch.int16], ids=str
)
def test_fake_cuda_dtype_fallbacks_are_exact(four_gpus: Any, dtype: Any) -> None:
    rng = np.random.default_rng(7)
    data = [rng.integers(-4, 5, size=8).astype(np.float32) / 4 for _ in range(4)]
    if dtype.is_complex:
        make = lambda i: (torch.tensor(data[i]) + 1j * torch.tensor(data[3 - i])).to(dtype)  # noqa: E731
        exact = sum(make(i).to(torch.complex128) for i in range(4))
    elif dtype == torch.int16:
        make = lambda i: torch.tensor(data[i] * 4 + 30000).to(dtype)  # noqa: E731 - wraps
        exact = sum(make(i).to(torch.int64) for i in range(4)).to(torch.int16)
    else:
        make = lambda i: torch.tensor(data[i]).to(dtype)  # noqa: E731
        exact = sum(make(i).to(torch.float64) for i in range(4)).to(dtype)
    value = on_gpus(make)
    four_gpus.counts.clear()
    (result,) = NcclAllReduce().batch_reduce("sum", [(value, value)])
    assert four_gpus.counts["nccl_all_reduce"] == 1
    for i, c in enumerate(components(result)):
        assert c.device == torch.device("cuda", i)
        assert c.dtype == dtype
        got = c.cpu()
        assert torch.equal(got.view(torch.uint8), exact.to(dtype).view(torch.uint8)), (got, exact)


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_fake_logical_gpus_share_a_card_without_nccl(
    op: str, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.fake_cuda import fake_cuda

    with fake_cuda(1) as state:
        devices_module.set_logical_gpu_devices(4)
        try:
            parts = [torch.tensor([0.1, 0.2, 0.3]) * (i + 1) for i in range(4)]
            value = on_gpus(lambda i: parts[i], device="cuda:0")
            small = on_gpus(lambda i: torch.tensor([float(i)]), device="cuda:0")
            state.counts.clear()
            with caplog.at_level(logging.WARNING, logger="crossdevice"):
                out = NcclAllReduce().batch_reduce(op, [(value, value), (small, small)])
            assert state.counts["nccl_all_reduce"] == 0
            # One in-order chain over the pack for the whole batch (3 adds, 4 replicas).
            assert state.counts["op:add"] + state.counts["op:add_"] == 3
            messages = [r.getMessage() for r in caplog.records]
            assert [m for m in messages if "share CUDA device" in m]
            in_order = parts[0] + parts[1] + parts[2] + parts[3]
            if op == "mean":
                in_order = torch.true_divide(in_order, 4)
            comps = components(out[0])
            assert {c.device for c in comps} == {torch.device("cuda", 0)}
            assert len({c.untyped_storage().data_ptr() for c in comps}) == 4
            for c in comps:
                assert torch.equal(c.cpu(), in_order)
        finally:
            devices_module.set_logical_gpu_devices(None)


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_fake_cuda_reduction_to_one_device_is_one_reduce_and_one_broadcast(
    four_gpus: Any, op: str
) -> None:
    value = on_gpus(lambda i: torch.arange(5.0) + i)
    four_gpus.counts.clear()
    result = ReductionToOneDevice().reduce(op, value, value)
    counts = four_gpus.counts
    assert (counts["nccl_reduce"], counts["nccl_broadcast"], counts["D2D"]) == (1, 1, 0)
    expected = (torch.arange(5.0) * 4 + 6) / (4 if op == "mean" else 1)
    comps = components(result)
    assert [c.device for c in comps] == [torch.device("cuda", i) for i in range(4)]
    for c in comps:
        assert torch.equal(c.cpu(), expected)


def test_fake_cuda_accumulation_fn_keeps_the_copies(four_gpus: Any) -> None:
    value = on_gpus(lambda i: torch.arange(5.0) + i)
    four_gpus.counts.clear()
    result = ReductionToOneDevice(accumulation_fn=lambda xs: sum(xs[1:], xs[0])).reduce(
        "sum", value, value
    )
    assert four_gpus.counts["nccl_reduce"] == 0
    assert four_gpus.counts["D2D"] >= 3  # the user's function adds on one device
    for c in components(result):
        assert torch.equal(c.cpu(), torch.arange(5.0) * 4 + 6)


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_fake_cuda_hierarchical_copy_reduces_and_broadcasts_with_nccl(
    four_gpus: Any, op: str
) -> None:
    from crossdevice._cross_device import HierarchicalCopyAllReduce

    value = on_gpus(lambda i: torch.arange(4.0) * (i + 1))
    four_gpus.counts.clear()
    (result,) = HierarchicalCopyAllReduce().batch_reduce(op, [(value, value)])
    counts = four_gpus.counts
    # Two half reduces, two half broadcasts, and one copy each way between the roots.
    assert (counts["nccl_reduce"], counts["nccl_broadcast"], counts["D2D"]) == (2, 2, 2)
    expected = torch.arange(4.0) * 10 / (4 if op == "mean" else 1)
    comps = components(result)
    assert [c.device for c in comps] == [torch.device("cuda", i) for i in range(4)]
    assert len({c.untyped_storage().data_ptr() for c in comps}) == 4
    for c in comps:
        assert torch.equal(c.cpu(), expected)


def test_fake_cuda_broadcast_is_one_nccl_broadcast_of_any_dtype(four_gpus: Any) -> None:
    source = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64, device="cuda:1")
    destination = on_gpus(lambda i: torch.zeros(2, dtype=torch.complex64))
    four_gpus.counts.clear()
    result = ReductionToOneDevice().broadcast(source, destination)
    assert (four_gpus.counts["nccl_broadcast"], four_gpus.counts["D2D"]) == (1, 0)
    comps = components(result)
    assert [c.device for c in comps] == [torch.device("cuda", i) for i in range(4)]
    for c in comps:
        assert torch.equal(c.cpu(), source.cpu())
    assert all(c is not source for c in comps)  # results never alias the input


# --- real NCCL (a host with 2+ GPUs; skipped elsewhere) ---------------------------------

REAL_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(REAL_GPUS < 2, reason="real NCCL needs 2 CUDA GPUs")
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.complex64, torch.int16],
    ids=str,
)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_real_nccl_dtypes_and_mean(dtype: Any, op: str) -> None:
    n = min(REAL_GPUS, 4)
    data = [torch.arange(8, dtype=torch.float32) / 4 + i for i in range(n)]
    parts = [(d + 1j * d if dtype.is_complex else d).to(dtype) for d in data]
    value = PerReplica([p.to(f"cuda:{i}") for i, p in enumerate(parts)], devices=gpus(n))
    (result,) = NcclAllReduce().batch_reduce(op, [(value, value)])
    wide = torch.complex128 if dtype.is_complex else torch.float64
    exact = sum(p.to(wide) for p in parts) / (n if op == "mean" else 1)
    for i, c in enumerate(components(result)):
        assert c.device == torch.device("cuda", i)
        assert c.dtype == (torch.float32 if op == "mean" and dtype == torch.int16 else dtype)
        np.testing.assert_allclose(c.cpu().to(wide).numpy(), exact.numpy(), rtol=0.07)
