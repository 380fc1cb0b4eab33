"""ThreadCommunicator: results, packing, gathers, broadcasts, failures, stress.

Every test runs its replicas on real threads through `run_replicas`, whose joins are
bounded, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import optree
import pytest

from crossdevice._comm.local import host_all_reduce as host_all_reduce_module
from crossdevice._comm.local import host_reduce as host_reduce_module
from crossdevice._comm.local.thread import ThreadCommunicator
from crossdevice._core import tuning
from crossdevice._core.errors import CollectiveTimeoutError, ReplicaAbortedError
from tests.collectives.replicas import raise_first, run_replicas
from tests.conftest import Backend
from tests.helpers import parametrize, to_numpy

#: Generous bound for "released promptly" (the timeouts under test are 0.2-0.5 s); a
#: release that needed the full wait would take 30 s.
PROMPT_S = 10.0


def chain(xs: list[np.ndarray]) -> np.ndarray:
    """The in-order reference sum x0 + x1 + ... (one pass per input)."""
    out = np.asarray(xs[0]).copy()
    if len(xs) > 1:
        out = np.asarray(np.add(xs[0], xs[1]))
    for x in xs[2:]:
        out = np.asarray(np.add(out, x))
    return out


def same_bits(a: Any, b: np.ndarray) -> bool:
    a = to_numpy(a)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(params=["one-thread", "sharded"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run once with the last-arriver path and once with every replica sharing the work.

    "sharded" lowers the size from which a round's work is shared (reductions: each
    replica reduces pieces; gathers and broadcasts: each copies its part) to zero, and
    checks at the end that the rounds really took that path: each kind of round the test
    ran with several replicas on host arrays must have shared its work at least once (the
    threshold once moved to another module, and for a while no gather or broadcast in the
    suite took the path).
    """
    if request.param == "one-thread":
        yield "one-thread"
        return
    rounds: collections.Counter[str] = collections.Counter()
    shared: collections.Counter[str] = collections.Counter()
    complete = ThreadCommunicator.complete

    def counted(self: Any, rnd: Any, replica_id: int) -> None:
        complete(self, rnd, replica_id)
        arrivals = rnd.arrivals
        # A broadcast copies the root's host array; the other rounds need every replica's.
        sources = [arrivals[arrivals[0].extra]] if rnd.kind == "broadcast" else arrivals
        if len(arrivals) > 1 and rnd.error is None and all(a.arrays for a in sources):
            rounds[rnd.kind] += 1
            shared[rnd.kind] += rnd.work is not None

    monkeypatch.setattr(ThreadCommunicator, "complete", counted)
    with tuning.overridden(shared_work_min_bytes=0, pool_min_bytes=0):
        yield "sharded"
    for kind, count in rounds.items():
        assert shared[kind] > 0, f"none of {count} {kind} rounds shared its work"


def replica_data(n: int, shapes: list[tuple[int, ...]], dtype: Any, seed: int = 0) -> list[Any]:
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(s) * 100).astype(dtype) for s in shapes] for _ in range(n)]


@parametrize(n=[1, 2, 3, 4, 8], op=["sum", "mean"])
def test_all_reduce_equals_the_in_order_chain(n: int, op: str, backend: Backend, path: str) -> None:
    shapes = [(), (3,), (5, 7), (1000,)]
    data = replica_data(n, shapes, np.float32, seed=n)
    comm = ThreadCommunicator(n)
    inputs = [[backend.make(x) for x in xs] for xs in data]
    results, errors = run_replicas(n, lambda r: comm.all_reduce(r, inputs[r], op, timeout=30))
    raise_first(errors)
    for i in range(len(shapes)):
        expected = chain([data[r][i] for r in range(n)])
        if op == "mean":
            expected = np.true_divide(expected, n).astype(np.float32)
        for r in range(n):
            assert same_bits(results[r][i], expected), (path, r, i)
            assert type(results[r][i]) is type(inputs[r][i])


@parametrize(
    n=[1, 2, 4],
    op=["sum", "mean"],
    dtype=[np.float16, np.float32, np.float64, np.int32, np.complex64],
    shape=[(), (256,), (3, 5)],
)
def test_one_small_array_is_the_in_order_chain(
    n: int, op: str, dtype: Any, shape: tuple[int, ...]
) -> None:
    """A step's loss or metric: one small array per replica (its own fast path)."""
    data = replica_data(n, [shape], dtype, seed=len(shape) + n)
    comm = ThreadCommunicator(n)
    results, errors = run_replicas(n, lambda r: comm.all_reduce(r, data[r], op, timeout=30))
    raise_first(errors)
    expected = chain([data[r][0] for r in range(n)])
    if op == "mean":
        expected = np.asarray(np.true_divide(expected, n))
        if np.dtype(dtype).kind in "fc":
            expected = expected.astype(dtype)
    for r in range(n):
        result = results[r][0]
        assert same_bits(result, expected), (r, result, expected)
        assert result is results[0][0]  # one shared result
        if isinstance(result, np.ndarray):
            assert not result.flags.writeable


def test_mixed_dtypes_are_packed_per_dtype_and_returned_as_views(path: str) -> None:
    n = 4
    rng = np.random.default_rng(7)
    shapes_dtypes = [
        ((3,), np.float32),
        ((), np.float16),
        ((2, 2), np.int32),
        ((50_000,), np.float64),  # large: reduced in place, not packed
        ((7,), np.float32),
        ((4,), np.int32),
        ((9, 3), np.float16),
        ((70_000,), np.float32),
    ]
    data = [[(rng.standard_normal(s) * 10).astype(d) for s, d in shapes_dtypes] for _ in range(n)]
    comm = ThreadCommunicator(n)
    results, errors = run_replicas(n, lambda r: comm.all_reduce(r, data[r], "sum", timeout=30))
    raise_first(errors)
    for i in range(len(shapes_dtypes)):
        expected = chain([data[r][i] for r in range(n)])
        for r in range(n):
            assert same_bits(results[r][i], expected)
    # Replicas share read-only results; small same-dtype arrays live in one flat buffer.
    assert results[0][0] is results[1][0]
    assert not results[0][0].flags.writeable
    assert results[0][0].base is results[0][4].base is not None
    assert results[0][2].base is results[0][5].base is not None


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_integer_reductions_follow_each_library(op: str, torch_module: Any, path: str) -> None:
    n = 3
    data = [np.arange(6, dtype=np.int32) * (r + 1) for r in range(n)]
    comm = ThreadCommunicator(n)

    def replica(r: int) -> list[Any]:
        value = torch_module.as_tensor(data[r]) if r == 1 else data[r]
        return comm.all_reduce(r, [value], op, timeout=30)

    results, errors = run_replicas(n, replica)
    raise_first(errors)
    total = chain(data)
    if op == "sum":
        assert same_bits(results[0][0], total)
        assert results[1][0].dtype == torch_module.int32
    else:  # NumPy's true division gives float64, torch's the default float dtype
        assert same_bits(results[0][0], np.true_divide(total, n))
        assert results[1][0].dtype == torch_module.float32
        np.testing.assert_allclose(to_numpy(results[1][0]), total / n, rtol=1e-6)


def test_bfloat16_and_bool_take_the_library_path(torch_module: Any) -> None:
    n = 3
    comm = ThreadCommunicator(n)
    values = [torch_module.full((4,), 1.5 * (r + 1), dtype=torch_module.bfloat16) for r in range(n)]
    flags = [np.array([r == 0, False, r == 2]) for r in range(n)]
    results, errors = run_replicas(
        n, lambda r: comm.all_reduce(r, [values[r], flags[r]], "sum", timeout=30)
    )
    raise_first(errors)
    for r in range(n):
        assert results[r][0].dtype == torch_module.bfloat16
        assert results[r][0].tolist() == [9.0] * 4
        np.testing.assert_array_equal(results[r][1], [True, False, True])


def test_results_survive_later_collectives(path: str) -> None:
    n = 3
    comm = ThreadCommunicator(n)
    first = replica_data(n, [(300_000,)], np.float32, seed=1)
    second = replica_data(n, [(300_000,)], np.float32, seed=2)
    held, errors = run_replicas(n, lambda r: comm.all_reduce(r, first[r], "sum", timeout=30))
    raise_first(errors)
    for _ in range(3):  # enough rounds to recycle every pooled buffer not in use
        _, errors = run_replicas(n, lambda r: comm.all_reduce(r, second[r], "sum", timeout=30))
        raise_first(errors)
    assert same_bits(held[0][0], chain([first[r][0] for r in range(n)]))


def test_large_output_buffers_are_recycled_once_released(path: str) -> None:
    n = 2
    comm = ThreadCommunicator(n)
    # The real threshold (the "sharded" path lowers it to 0): a large array either way.
    data = replica_data(n, [(tuning.Tuning().pool_min_bytes // 4 + 3,)], np.float32)
    addresses = set()
    for _ in range(4):
        results, errors = run_replicas(n, lambda r: comm.all_reduce(r, data[r], "sum"))
        raise_first(errors)
        addresses.add(results[0][0].__array_interface__["data"][0])
        del results  # nobody holds the result: its buffer may serve the next call
    assert len(addresses) == 1


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_all_gather_with_uneven_sizes(n: int, backend: Backend, path: str) -> None:
    comm = ThreadCommunicator(n)
    pieces = [
        np.arange((r + 1) * 2 * 3, dtype=np.float32).reshape(r + 1, 2, 3) + r for r in range(n)
    ]
    columns = [np.full((2, r + 2, 3), r, dtype=np.int64) for r in range(n)]

    def replica(r: int) -> tuple[Any, Any]:
        rows = comm.all_gather(r, backend.make(pieces[r]), axis=0, timeout=30)
        cols = comm.all_gather(r, backend.make(columns[r]), axis=-2, timeout=30)
        return rows, cols

    results, errors = run_replicas(n, replica)
    raise_first(errors)
    for rows, cols in results:
        assert same_bits(rows, np.concatenate(pieces, axis=0))
        assert same_bits(cols, np.concatenate(columns, axis=1))


def test_all_gather_shape_mismatch_names_both_shapes() -> None:
    comm = ThreadCommunicator(3)
    values = [np.zeros((2, 3)), np.zeros((2, 4)), np.zeros((1, 3))]
    _, errors = run_replicas(3, lambda r: comm.all_gather(r, values[r], axis=0, timeout=30))
    for exc in errors:
        assert isinstance(exc, ValueError)
        assert "(2, 3)" in str(exc)
        assert "(2, 4)" in str(exc)
    _, errors = run_replicas(3, lambda r: comm.all_gather(r, np.float32(r), axis=0, timeout=30))
    assert all(isinstance(e, ValueError) and "0-d" in str(e) for e in errors)
    _, errors = run_replicas(3, lambda r: comm.all_gather(r, np.zeros(2), axis=1, timeout=30))
    assert all(isinstance(e, ValueError) and "out of range" in str(e) for e in errors)


@pytest.mark.parametrize("root", [0, 2])
def test_broadcast_copies_the_root_value(root: int, backend: Backend, path: str) -> None:
    n = 3
    comm = ThreadCommunicator(n)
    source = np.arange(100_000, dtype=np.float32).reshape(100, 1000)

    def replica(r: int) -> Any:
        mine = backend.make(source) if r == root else (None if r == 1 else backend.make(source * 0))
        return comm.broadcast(r, mine, root=root, timeout=30)

    results, errors = run_replicas(n, replica)
    raise_first(errors)
    for value in results:
        assert same_bits(value, source)
    assert not np.shares_memory(to_numpy(results[0]), source)


def test_broadcast_mismatch_and_missing_root_are_value_errors() -> None:
    comm = ThreadCommunicator(2)
    values = [np.zeros(3), np.zeros(4)]
    _, errors = run_replicas(2, lambda r: comm.broadcast(r, values[r], root=0, timeout=30))
    assert all(isinstance(e, ValueError) and "float64[3]" in str(e) for e in errors)
    _, errors = run_replicas(2, lambda r: comm.broadcast(r, None, root=0, timeout=30))
    assert all(isinstance(e, ValueError) and "passed None" in str(e) for e in errors)


def test_mismatched_shapes_raise_in_every_replica_and_the_communicator_survives() -> None:
    n = 4
    comm = ThreadCommunicator(n)
    shapes = [(3,), (3,), (4,), (3,)]
    _, errors = run_replicas(
        n, lambda r: comm.all_reduce(r, [np.ones(shapes[r], np.float32)], "sum", timeout=30)
    )
    for exc in errors:
        assert isinstance(exc, ValueError)
        message = str(exc)
        assert "(3,)" in message
        assert "(4,)" in message
        assert "replica 2" in message
    results, errors = run_replicas(n, lambda r: comm.all_reduce(r, [np.ones(2)], "sum"))
    raise_first(errors)
    assert results[3][0].tolist() == [4.0, 4.0]


def test_mismatched_structure_dtype_and_op_are_value_errors() -> None:
    comm = ThreadCommunicator(2)
    cases = {
        "expected 1 arrays": lambda r: comm.all_reduce(r, [np.ones(2)] * (r + 1), "sum"),
        "dtype float32": lambda r: comm.all_reduce(
            r, [np.ones(2, [np.float32, np.int32][r])], "sum"
        ),
        "replica 0: all_reduce(SUM, [float64[2]]) #2; replica 1: all_reduce(MEAN, [": lambda r: (
            comm.all_reduce(r, [np.ones(2)], ["sum", "mean"][r], structure=_LIST1)
        ),
        "different nest structures": lambda r: comm.all_reduce(
            r, [np.ones(2)], "sum", structure=[_LIST1, _TUPLE1][r]
        ),
    }
    for fragment, fn in cases.items():
        _, errors = run_replicas(2, fn)
        for exc in errors:
            assert isinstance(exc, ValueError), fragment
            assert fragment in str(exc)


_LIST1 = optree.tree_structure([0], none_is_leaf=True, namespace="crossdevice")
_TUPLE1 = optree.tree_structure((0,), none_is_leaf=True, namespace="crossdevice")


def test_different_collectives_are_a_runtime_error_naming_each_call() -> None:
    comm = ThreadCommunicator(2)

    def fn(r: int) -> Any:
        if r == 0:
            return comm.all_reduce(r, [np.ones(3, np.float32)], "sum")
        return comm.all_gather(r, np.ones(2), axis=0)

    _, errors = run_replicas(2, fn)
    assert len(errors) == 2
    for exc in errors:
        assert isinstance(exc, RuntimeError)
        assert (
            "replica 0: all_reduce(SUM, float32[3]) #0; replica 1: all_gather(axis=0, "
            "float64[2]) #0" in str(exc)
        )


def test_abort_releases_every_waiter_and_reset_restores_the_communicator() -> None:
    n = 4
    comm = ThreadCommunicator(n)
    failure = RuntimeError("replica 3 failed")

    def replica(r: int) -> Any:
        if r == 3:
            time.sleep(0.2)  # let the peers block first
            comm.abort(failure)
            raise failure
        return comm.all_reduce(r, [np.ones(3)], "sum", timeout=30)

    start = time.monotonic()
    _, errors = run_replicas(n, replica)
    assert time.monotonic() - start < PROMPT_S
    for exc in errors[:3]:
        assert isinstance(exc, ReplicaAbortedError)
        assert exc.__cause__ is failure
    with pytest.raises(ReplicaAbortedError):
        comm.all_reduce(0, [np.ones(3)], "sum", timeout=1)
    comm.reset()
    results, errors = run_replicas(n, lambda r: comm.all_reduce(r, [np.ones(3)], "sum", timeout=30))
    raise_first(errors)
    assert results[0][0].tolist() == [4.0, 4.0, 4.0]


def test_a_replica_that_never_arrives_times_out_by_name() -> None:
    n = 4
    comm = ThreadCommunicator(n, name="test-comm")
    timeout = 0.3
    start = time.monotonic()
    _, errors = run_replicas(
        n, lambda r: None if r == 2 else comm.all_reduce(r, [np.ones(3)], "sum", timeout=timeout)
    )
    elapsed = time.monotonic() - start
    assert elapsed < timeout + PROMPT_S
    for r in (0, 1, 3):
        exc = errors[r]
        assert isinstance(exc, CollectiveTimeoutError)
        assert isinstance(exc, TimeoutError)
        message = str(exc)
        assert "test-comm" in message
        assert "all_reduce #0" in message
        assert "replicas [2] did not arrive" in message
    # The late replica finds the communicator broken instead of waiting for no one.
    with pytest.raises(CollectiveTimeoutError, match="replicas \\[2\\]"):
        comm.all_reduce(2, [np.ones(3)], "sum", timeout=30)
    comm.reset()
    results, errors = run_replicas(n, lambda r: comm.all_reduce(r, [np.ones(3)], "sum", timeout=30))
    raise_first(errors)
    assert results[2][0].tolist() == [4.0, 4.0, 4.0]


def test_a_failure_inside_one_replicas_share_releases_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        tuning, "TUNING", dataclasses.replace(tuning.TUNING, shared_work_min_bytes=0)
    )
    real = host_reduce_module.sum_slice
    failure = MemoryError("injected")

    def flaky(inputs: Any, out: Any, start: int, stop: int, **kw: Any) -> None:
        if start == 0 and out.shape[0] >= 1000:  # the first replica's share only
            raise failure
        real(inputs, out, start, stop, **kw)

    monkeypatch.setattr(host_reduce_module, "sum_slice", flaky)
    comm = ThreadCommunicator(3)
    _, errors = run_replicas(3, lambda r: comm.all_reduce(r, [np.ones(3000)], "sum", timeout=30))
    # Whichever replica took the failing piece re-raises it; its peers are released.
    assert sum(e is failure for e in errors) == 1
    others = [e for e in errors if e is not failure]
    assert all(isinstance(e, ReplicaAbortedError) for e in others)
    assert all(e.__cause__ is failure for e in others)
    monkeypatch.setattr(host_reduce_module, "sum_slice", real)
    results, errors = run_replicas(3, lambda r: comm.all_reduce(r, [np.ones(3000)], "sum"))
    raise_first(errors)
    assert results[1][0][-1] == 3.0


def test_a_replica_that_finishes_early_is_a_runtime_error_not_a_hang() -> None:
    n = 3
    comm = ThreadCommunicator(n)

    def replica(r: int) -> Any:
        if r == 1:
            time.sleep(0.1)
            comm.finish(1)
            return None
        return comm.all_reduce(r, [np.ones(2)], "sum")  # no timeout: finish() releases

    _, errors = run_replicas(n, replica)
    for r in (0, 2):
        assert isinstance(errors[r], RuntimeError)
        assert "replicas [1] returned" in str(errors[r])
    comm.reset()
    _, errors = run_replicas(n, lambda r: comm.all_reduce(r, [np.ones(2)], "sum", timeout=30))
    raise_first(errors)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        ThreadCommunicator(0)
    with pytest.raises(TypeError, match="int"):
        ThreadCommunicator(2.0)  # type: ignore[arg-type]
    comm = ThreadCommunicator(2)
    with pytest.raises(ValueError, match="replica_id"):
        comm.all_reduce(2, [np.ones(2)], "sum")
    with pytest.raises(ValueError, match="unknown reduce op"):
        comm.all_reduce(0, [np.ones(2)], "max")
    with pytest.raises(ValueError, match="root"):
        comm.broadcast(0, np.ones(2), root=5)


@pytest.mark.parametrize("n", [2, 4])
def test_stress_many_consecutive_collectives_are_identical(n: int) -> None:
    rng = np.random.default_rng(11)
    sizes = [1, 17, 4096, 70_000, 3, 300_000]
    steps = [
        [
            [rng.standard_normal(sizes[(k + i) % len(sizes)]).astype(np.float32) for i in range(2)]
            for _ in range(n)
        ]
        for k in range(len(sizes))
    ]
    comm = ThreadCommunicator(n)
    rounds = 40

    def replica(r: int) -> list[bytes]:
        digests = []
        for k in range(rounds):
            step = steps[k % len(steps)]
            out = comm.all_reduce(r, step[r], "sum" if k % 3 else "mean", timeout=30)
            digests.append(b"".join(np.asarray(x).tobytes() for x in out))
            if k % 5 == 0:
                g = comm.all_gather(r, step[r][0][:5], timeout=30)
                digests.append(np.asarray(g).tobytes())
        return digests

    first, errors = run_replicas(n, replica)
    raise_first(errors)
    second, errors = run_replicas(n, replica)
    raise_first(errors)
    for r in range(n):
        assert first[r] == first[0] == second[r]
    step = steps[1]
    expected = chain([step[r][0] for r in range(n)])
    assert first[0][2][: expected.nbytes] == expected.tobytes()  # k=1 follows k=0 and a gather


@pytest.mark.parametrize("n", [1, 3, 4])
def test_all_reduce_host_from_one_thread(n: int, backend: Backend, path: str) -> None:
    shapes = [(), (5,), (3, 4), (70_000,), (2,)]
    data = replica_data(n, shapes, np.float32, seed=3)
    per_replica = [[backend.make(x) for x in xs] for xs in data]
    for op in ("sum", "mean"):
        results = host_all_reduce_module.all_reduce_host(per_replica, op)
        assert len(results) == n
        for i in range(len(shapes)):
            expected = chain([data[r][i] for r in range(n)])
            if op == "mean":
                expected = np.true_divide(expected, n).astype(np.float32)
            for r in range(n):
                assert same_bits(results[r][i], expected)
                assert type(results[r][i]) is type(per_replica[r][i])


def test_all_reduce_host_validates() -> None:
    with pytest.raises(ValueError, match="at least one"):
        host_all_reduce_module.all_reduce_host([], "sum")
    with pytest.raises(ValueError, match=r"expected shape \(2,\)"):
        host_all_reduce_module.all_reduce_host([[np.ones(2)], [np.ones(3)]], "sum")
