"""MirroredStrategy on GPUs: placement, replica threads, streams, uploads, every cross-device op.

Bound to fake CUDA, fake logical GPUs and real CUDA (`gpus` fixture). On fake CUDA each
test also checks what the GPU would have done: copies, host synchronisations, races.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import crossdevice
from tests.gpu.conftest import NUM_GPUS, Gpus

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

OPS: dict[str, Callable[[], Any]] = {
    "nccl": crossdevice.NcclAllReduce,
    "hierarchical_copy": crossdevice.HierarchicalCopyAllReduce,
    "reduction_to_one_device": crossdevice.ReductionToOneDevice,
    "host": crossdevice.HostAllReduce,
}


def _strategy(gpus: Gpus, ops: str | None = None) -> crossdevice.MirroredStrategy:
    cross_device_ops = OPS[ops]() if ops is not None else None
    return crossdevice.MirroredStrategy(gpus.names, cross_device_ops=cross_device_ops)


def _on_gpus(strategy: crossdevice.MirroredStrategy, gpus: Gpus, make: Callable[[int], Any]) -> Any:
    """A PerReplica of `make(i)` made on replica i's GPU."""

    def value_fn(ctx: Any) -> Any:
        i = ctx.replica_id_in_sync_group
        return make(i).to(gpus.torch_device(i))

    return strategy.experimental_distribute_values_from_function(value_fn)


def _local(strategy: crossdevice.MirroredStrategy, value: Any) -> tuple[Any, ...]:
    return tuple(strategy.experimental_local_results(value))


def _assert_on_own_gpus(gpus: Gpus, components: tuple[Any, ...] | list[Any]) -> None:
    assert len(components) == NUM_GPUS
    for i, component in enumerate(components):
        assert isinstance(component, torch.Tensor), type(component)
        assert component.device == gpus.torch_device(i), (i, component.device)
    storages = {c.untyped_storage().data_ptr() for c in components}
    assert len(storages) == NUM_GPUS, "two replicas share one result buffer"


@pytest.mark.parametrize(
    "initial",
    [
        pytest.param(lambda: np.arange(3, dtype=np.float32), id="numpy"),
        pytest.param(lambda: torch.arange(3, dtype=torch.float32), id="torch-cpu"),
        pytest.param(lambda: 1.5, id="python-float"),
    ],
)
def test_variables_live_on_their_gpus(gpus: Gpus, initial: Callable[[], Any]) -> None:
    strategy = _strategy(gpus)
    if gpus.fake is not None:
        gpus.fake.counts.clear()
    with strategy.scope():
        variable = crossdevice.Variable(initial())
    components = [c.read_value() for c in variable.values]
    _assert_on_own_gpus(gpus, components)
    expected = np.asarray(initial(), dtype=np.float32)
    for component in components:
        np.testing.assert_array_equal(component.cpu().numpy(), expected)
    if gpus.fake is not None:
        # One upload per component, none of them waiting for the GPU.
        assert gpus.fake.counts["H2D"] == NUM_GPUS, dict(gpus.fake.counts)
        assert gpus.fake.counts["sync"] == NUM_GPUS  # only this test's `.cpu()` reads


def test_replica_threads_run_on_their_gpus(gpus: Gpus) -> None:
    strategy = _strategy(gpus)

    def step() -> Any:
        made = torch.zeros(1, device="cuda")  # no index: the replica's current device
        return torch.cuda.current_device(), made.device.index

    seen = _local(strategy, strategy.run(step))
    want = tuple((gpus.torch_device(i).index,) * 2 for i in range(NUM_GPUS))
    assert seen == want


def test_caller_grad_mode_and_autocast_reach_every_gpu_replica(gpus: Gpus) -> None:
    strategy = _strategy(gpus)
    with torch.no_grad():
        grads = _local(strategy, strategy.run(torch.is_grad_enabled))
    assert grads == (False,) * NUM_GPUS or grads == (False,)
    with torch.inference_mode():
        inference = _local(strategy, strategy.run(torch.is_inference_mode_enabled))
    assert set(inference) == {True}


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.ones(3), id="torch-cpu"),
        pytest.param(lambda: np.ones(3, np.float32), id="numpy"),
    ],
)
def test_values_from_function_are_placed_on_each_gpu(gpus: Gpus, make: Callable[[], Any]) -> None:
    strategy = _strategy(gpus)
    value = strategy.experimental_distribute_values_from_function(lambda ctx: make())
    _assert_on_own_gpus(gpus, _local(strategy, value))


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("ops", list(OPS))
def test_all_reduce_results_stay_on_each_gpu(gpus: Gpus, ops: str, op: str) -> None:
    strategy = _strategy(gpus, ops)
    value = _on_gpus(strategy, gpus, lambda i: torch.full((2, 3), float(i + 1)))

    def step(x: Any) -> Any:
        return crossdevice.get_replica_context().all_reduce(op, x)

    results = _local(strategy, strategy.run(step, args=(value,)))
    _assert_on_own_gpus(gpus, results)
    total = sum(range(1, NUM_GPUS + 1))
    want = total if op == "sum" else total / NUM_GPUS
    for result in results:
        np.testing.assert_allclose(result.cpu().numpy(), np.full((2, 3), want), rtol=1e-6)


@pytest.mark.parametrize("ops", list(OPS))
def test_batch_reduce_to_across_gpus(gpus: Gpus, ops: str) -> None:
    strategy = _strategy(gpus, ops)
    a = _on_gpus(strategy, gpus, lambda i: torch.full((4,), float(i)))
    b = _on_gpus(strategy, gpus, lambda i: torch.full((2, 2), 2.0 * i))
    reduced = strategy.extended.batch_reduce_to("sum", [(a, a), (b, b)])
    total = sum(range(NUM_GPUS))
    for result, want in zip(reduced, (total, 2 * total), strict=True):
        components = _local(strategy, result)
        _assert_on_own_gpus(gpus, components)
        for component in components:
            assert float(component.flatten()[0].item()) == want


@pytest.mark.parametrize("ops", list(OPS))
def test_mixed_nest_of_tensors_and_host_numbers(gpus: Gpus, ops: str) -> None:
    strategy = _strategy(gpus, ops)
    value = _on_gpus(strategy, gpus, lambda i: torch.full((3,), float(i)))

    def step(x: Any) -> Any:
        return crossdevice.get_replica_context().all_reduce("sum", [x, 1.0, np.float32(2.0)])

    tensors, ones, twos = strategy.run(step, args=(value,))
    _assert_on_own_gpus(gpus, _local(strategy, tensors))
    for component in _local(strategy, tensors):
        assert component.cpu().tolist() == [float(sum(range(NUM_GPUS)))] * 3
    for host, want in ((ones, NUM_GPUS), (twos, 2 * NUM_GPUS)):
        # Host values are reduced on the host and stay there: no upload, no sync to read.
        for component in _local(strategy, host):
            assert isinstance(component, np.ndarray), type(component)
            assert component.shape == ()
            assert float(component) == want


@pytest.mark.parametrize("ops", list(OPS))
def test_collectives_wait_for_the_replicas_side_streams(gpus: Gpus, ops: str) -> None:
    """A step on its own stream: the collective reads its input after the stream wrote it,
    and the step reads the result after the collective wrote it (fake CUDA checks both)."""
    strategy = _strategy(gpus, ops)
    side = [torch.cuda.Stream(gpus.torch_device(i)) for i in range(NUM_GPUS)]
    big = 1 << 16

    def step() -> Any:
        ctx = crossdevice.get_replica_context()
        i = ctx.replica_id_in_sync_group
        stream = side[i]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            x = torch.ones(big, device="cuda")
            for _ in range(4):  # work queued on the side stream before the collective
                x = x * 1.0
            y = ctx.all_reduce("sum", x * (i + 1))
            z = y + 0.0
        torch.cuda.current_stream().wait_stream(stream)
        return z

    results = _local(strategy, strategy.run(step))
    gpus.synchronize()
    total = float(sum(range(1, NUM_GPUS + 1)))
    for result in results:
        assert bool((result == total).all().item())


def test_logical_gpus_give_each_replica_its_own_stream(gpus: Gpus) -> None:
    strategy = _strategy(gpus)

    def step() -> Any:
        return torch.cuda.current_stream()

    streams = _local(strategy, strategy.run(step))
    if gpus.logical:
        assert len({id(s) for s in streams}) == NUM_GPUS
    else:
        assert all(
            s == torch.cuda.current_stream(gpus.torch_device(i)) for i, s in enumerate(streams)
        )


def test_dataset_batches_upload_through_pinned_memory_without_a_host_sync(gpus: Gpus) -> None:
    strategy = _strategy(gpus)
    batches = [np.arange(16 * 3, dtype=np.float32).reshape(16, 3)]
    dataset = strategy.experimental_distribute_dataset(batches)
    if gpus.fake is not None:
        gpus.fake.counts.clear()
    batch = next(iter(dataset))
    counts = dict(gpus.fake.counts) if gpus.fake is not None else {}
    components = _local(strategy, batch)
    _assert_on_own_gpus(gpus, components)
    for i, component in enumerate(components):
        np.testing.assert_array_equal(component.cpu().numpy(), batches[0][4 * i : 4 * i + 4])
    if gpus.fake is not None:
        assert counts.get("H2D") == NUM_GPUS, counts
        assert counts.get("pin_memory") == NUM_GPUS, counts
        assert counts.get("sync", 0) == 0, counts


@pytest.mark.parametrize("ops", list(OPS))
def test_host_values_all_reduce_on_the_host_without_touching_the_gpus(gpus: Gpus, ops: str) -> None:
    strategy = _strategy(gpus, ops)

    def step() -> Any:
        ctx = crossdevice.get_replica_context()
        flags = torch.zeros(3)  # a CPU tensor, as GradientSync's "used" flags
        flags[ctx.replica_id_in_sync_group % 3] = 1.0
        count, used = ctx.all_reduce("sum", [1.0, flags])
        assert bool(used[0] > 0)  # read on the host: must not wait for a GPU
        return count, used

    if gpus.fake is not None:
        gpus.fake.counts.clear()
    count, used = strategy.run(step)
    for c in _local(strategy, count):
        assert float(c) == NUM_GPUS
    for u in _local(strategy, used):
        assert u.device.type == "cpu"
        assert u.tolist() == [2.0, 1.0, 1.0]
    if gpus.fake is not None:
        counts = dict(gpus.fake.counts)
        for what in ("sync", "H2D", "D2H", "nccl_all_reduce"):
            assert counts.get(what, 0) == 0, counts


def test_strategy_reduce_of_gpu_values_lands_on_the_host(gpus: Gpus) -> None:
    strategy = _strategy(gpus)
    value = _on_gpus(strategy, gpus, lambda i: torch.full((2,), float(i)))
    reduced = strategy.reduce("sum", value, axis=None)
    assert reduced.device.type == "cpu"
    assert reduced.tolist() == [float(sum(range(NUM_GPUS)))] * 2


def test_default_mirrored_strategy_takes_every_gpu(gpus: Gpus) -> None:
    strategy = crossdevice.MirroredStrategy()
    assert strategy.num_replicas_in_sync == NUM_GPUS
    assert [d.rsplit("device:", 1)[-1] for d in strategy.extended.worker_devices] == gpus.names
    # NCCL between cards; logical GPUs sharing a card are summed there, packed, by it too.
    assert type(strategy.extended._cross_device_ops).__name__ == "NcclAllReduce"


def _gpu_per_replica(gpus: Gpus, make: Callable[[int], Any]) -> Any:
    from crossdevice._values.values import PerReplica

    return PerReplica([make(i).to(gpus.torch_device(i)) for i in range(NUM_GPUS)], gpus.names)


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("ops", list(OPS))
def test_cross_device_ops_reduce_to_one_gpu_and_to_the_host(gpus: Gpus, ops: str, op: str) -> None:
    cross_device_ops = OPS[ops]()
    value = _gpu_per_replica(gpus, lambda i: torch.full((3,), float(i + 1)))
    total = float(sum(range(1, NUM_GPUS + 1)))
    want = total if op == "sum" else total / NUM_GPUS
    on_gpu = cross_device_ops.reduce(op, value, "GPU:2")
    assert on_gpu.device == gpus.torch_device(2)
    assert on_gpu.cpu().tolist() == [want] * 3
    on_host = cross_device_ops.reduce(op, value, "CPU:0")
    assert on_host.device.type == "cpu"
    assert on_host.tolist() == [want] * 3
    for component in value.values:  # inputs untouched
        assert component.cpu().tolist()[0] in range(1, NUM_GPUS + 1)


@pytest.mark.parametrize("ops", list(OPS))
def test_cross_device_ops_broadcast_and_gather_on_gpus(gpus: Gpus, ops: str) -> None:
    from crossdevice._values.values import Mirrored

    cross_device_ops = OPS[ops]()
    source = torch.arange(4.0).to(gpus.torch_device(0))
    destination = Mirrored([torch.zeros(1).to(gpus.torch_device(i)) for i in range(4)], gpus.names)
    copies = cross_device_ops.broadcast(source, destination)
    _assert_on_own_gpus(gpus, list(copies.values))
    for copy in copies.values:
        assert copy.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
    value = _gpu_per_replica(gpus, lambda i: torch.full((1, 2), float(i)))
    gathered = cross_device_ops._gather(value, value, axis=0)
    _assert_on_own_gpus(gpus, list(gathered.values))
    for component in gathered.values:
        assert component.cpu().tolist() == [[float(i)] * 2 for i in range(NUM_GPUS)]


def test_results_used_on_another_logical_gpus_stream_are_recorded_there(gpus: Gpus) -> None:
    """A result allocated on the merging replica's stream and used on another's is
    `record_stream`ed there, or the caching allocator could hand its memory out early."""
    if gpus.fake is None or not gpus.logical:
        pytest.skip("only logical GPUs give replicas their own streams (and the fake counts)")
    strategy = _strategy(gpus, "nccl")
    value = _on_gpus(strategy, gpus, lambda i: torch.full((3,), float(i)))
    gpus.fake.counts.clear()
    strategy.run(lambda x: crossdevice.get_replica_context().all_reduce("sum", x), args=(value,))
    assert gpus.fake.counts["record_stream"] >= NUM_GPUS, dict(gpus.fake.counts)


def test_host_values_of_different_array_libraries_are_refused_as_on_cpus(gpus: Gpus) -> None:
    strategy = _strategy(gpus, "reduction_to_one_device")

    def step() -> Any:
        i = crossdevice.get_replica_context().replica_id_in_sync_group
        x = np.float32([1.0, 2.0]) if i == 0 else torch.tensor([1.0, 2.0])
        return crossdevice.get_replica_context().all_reduce("sum", x)

    with pytest.raises(ValueError, match="one array library"):
        strategy.run(step)
