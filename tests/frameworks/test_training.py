"""Training torch modules data-parallel: parity, the literal port, buffers, randomness.

Every multi-replica test runs on replica threads and on cooperative replicas: both must
give bitwise the same parameters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from tests.frameworks.helpers import bn_dropout_model, load_example, mirrored
from tests.strategies.conftest import replica_execution

MODES = ["threads", "cooperative"]


# --- the example: N replicas train the same model as one ----------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "argv"),
    [
        ("mirrored", ["--replicas", "4"]),
        ("central_storage", ["--replicas", "4"]),
        ("one_device", ["--batch-size-per-replica", "64"]),
    ],
)
def test_example_matches_a_single_replica_run(torch: Any, strategy: str, argv: list[str]) -> None:
    example = load_example("custom_training_loop")
    # float64: the check then compares like with like (see the example's doc).
    out = example.main(["--strategy", strategy, "--quiet", "--check", "--dtype", "float64", *argv])
    assert out["steps"] >= 100
    assert out["max_difference"] <= 1e-5
    assert out["test_accuracy"] >= 0.95
    first, *others = out["replica_params"]
    for other in others:  # the replicas' copies are bitwise identical
        for a, b in zip(first, other, strict=True):
            np.testing.assert_array_equal(a, b)


# --- the literal port fails at once, naming the fix ----------------------------------------
def _batches(torch: Any, steps: int, batch: int = 16) -> list[tuple[Any, Any]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(batch, 1, 8, 8, generator=generator),
            torch.randint(0, 10, (batch,), generator=generator),
        )
        for _ in range(steps)
    ]


@pytest.mark.parametrize("mode", MODES)
def test_literal_port_fails_at_step_one_naming_prepare(torch: Any, mode: str) -> None:
    example = load_example("custom_training_loop")
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():  # TF mirrors this model; torch modules need prepare()
            model = example.create_model()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        before = [p.detach().clone() for p in model.parameters()]

        def step(inputs: Any) -> Any:
            images, labels = inputs
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return loss

        (first,) = strategy.experimental_distribute_dataset(_batches(torch, 1, 16))
        with pytest.raises(RuntimeError, match=r"crossdevice\.torch\.prepare\(model, optimizer\)"):
            strategy.run(step, args=(first,))
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)  # nothing was trained silently


@pytest.mark.parametrize("mode", MODES)
def test_unprepared_optimizer_and_original_module_are_refused(
    torch: Any, cdt: Any, mode: str
) -> None:
    with replica_execution(mode):
        strategy = mirrored(2)
        original = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(original.parameters(), lr=0.1)
        with strategy.scope():
            model = cdt.MirroredModule(original)

        def step_with_raw_optimizer() -> None:
            model(torch.ones(2, 3)).sum().backward()
            optimizer.step()

        with pytest.raises(RuntimeError, match=r"optimizer SGD\.step\(\).*prepare"):
            strategy.run(step_with_raw_optimizer)

        def step_with_original_module() -> None:
            original(torch.ones(2, 3))

        with pytest.raises(RuntimeError, match=r"replica 0's copy"):
            strategy.run(step_with_original_module)


@pytest.mark.parametrize("mode", MODES)
def test_shared_variable_updates_are_refused(mode: str) -> None:
    with replica_execution(mode):
        strategy = mirrored(4)
        counter = cd.Variable(0.0)  # outside scope(): one object for every replica

        def step() -> None:
            counter.assign_add(1.0)

        with pytest.raises(RuntimeError, match=r"created outside strategy\.scope\(\).*race"):
            strategy.run(step)
        assert float(counter.numpy()) == 0.0
        with strategy.scope():
            mirrored_counter = cd.Variable(0.0, aggregation="sum")

        def good_step() -> None:
            mirrored_counter.assign_add(np.ones((), np.float32))  # a per-replica value

        for _ in range(200):
            strategy.run(good_step)
        assert float(mirrored_counter.numpy()) == 800.0  # 200 steps x 4 replicas


def test_frozen_shared_module_may_be_used(torch: Any) -> None:
    strategy = mirrored(2)
    frozen = torch.nn.Linear(3, 1).requires_grad_(False).eval()
    out = strategy.run(lambda: frozen(torch.ones(1, 3)))
    assert len(strategy.experimental_local_results(out)) == 2


# --- optimizers, buckets, accumulation ----------------------------------------------------
def _train(torch: Any, cdt: Any, strategy: Any, steps: int, **prepare: Any) -> list[list[Any]]:
    torch.manual_seed(0)
    with strategy.scope():
        model = bn_dropout_model(torch)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, optimizer = cdt.prepare(model, optimizer, **prepare)
    batch = 8 * strategy.num_replicas_in_sync

    def step(inputs: Any) -> Any:
        images, labels = inputs
        loss = cdt.compute_average_loss(
            torch.nn.functional.cross_entropy(model(images), labels, reduction="none"),
            global_batch_size=batch,
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # Buffers after every step: the same on every replica (TF's MEAN rule).
        return [b.clone() for b in model.buffers()]

    for x in strategy.experimental_distribute_dataset(_batches(torch, steps, batch)):
        buffers = strategy.experimental_local_results(strategy.run(step, args=(x,)))
        for other in buffers[1:]:
            for a, b in zip(buffers[0], other, strict=True):
                assert torch.equal(a, b)
    replicas = [[p.detach().clone() for p in r.parameters()] for r in model.replicas]
    for other in replicas[1:]:
        for a, b in zip(replicas[0], other, strict=True):
            assert torch.equal(a, b)
    return replicas


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_dropout_model_is_reproducible_and_identical_on_replicas(
    torch: Any, cdt: Any, mode: str
) -> None:
    with replica_execution(mode):
        first = _train(torch, cdt, mirrored(4), 6)
        second = _train(torch, cdt, mirrored(4), 6)
    for a, b in zip(first[0], second[0], strict=True):
        assert torch.equal(a, b)  # two seeded runs: bitwise the same parameters


def test_threads_and_cooperative_and_buckets_agree_bitwise(torch: Any, cdt: Any) -> None:
    with replica_execution("threads"):
        reference = _train(torch, cdt, mirrored(3), 4)[0]
        small_buckets = _train(torch, cdt, mirrored(3), 4, bucket_cap_bytes=512)[0]
    with replica_execution("cooperative"):
        cooperative = _train(torch, cdt, mirrored(3), 4, bucket_cap_bytes=512)[0]
    for a, b, c in zip(reference, small_buckets, cooperative, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


def test_small_buckets_split_the_gradients(torch: Any, cdt: Any) -> None:
    with mirrored(2).scope() as strategy:
        model = cdt.MirroredModule(bn_dropout_model(torch), bucket_cap_bytes=512)
    assert len(model.gradient_buckets) > 1
    assert sum(model.gradient_buckets) == len(list(model.parameters()))
    assert model.strategy is strategy


def test_bucket_boundaries_are_cut_under_the_cap_in_reverse_order(torch: Any, cdt: Any) -> None:
    """The buckets' layout, computed by hand: reverse registration order, frozen
    parameters left out, a bucket closed before a parameter would take it over the cap
    (TF's `bytes_per_pack` rule, closing once over, would give [2, 3] and [2, 2])."""

    def net(frozen: int | None) -> Any:
        module = torch.nn.Module()
        module.params = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(n), requires_grad=k != frozen)
            for k, n in enumerate([25, 100, 10, 150, 20])  # float32: 100, 400, 40, 600, 80 B
        )
        return module

    with mirrored(2).scope():
        every = cdt.MirroredModule(net(None), bucket_cap_bytes=512)
        one_frozen = cdt.MirroredModule(net(2), bucket_cap_bytes=512)
    # 80 | 600 (over the cap alone) | 40 + 400 | 100 (540 bytes would pass 512)
    assert every.gradient_buckets == [1, 1, 2, 1]
    # 80 | 600 | 400 + 100
    assert one_frozen.gradient_buckets == [1, 1, 2]


def test_batchnorm_buffers_are_the_mean_of_the_replicas(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.MirroredModule(torch.nn.BatchNorm1d(3, momentum=1.0))
    data = [torch.tensor([[0.0, 1, 2], [2, 3, 4]]), torch.tensor([[10.0, 10, 10], [20, 20, 20]])]
    strategy.run(lambda: model(data[cd.get_replica_context().replica_id_in_sync_group]))
    expected = (data[0].mean(0) + data[1].mean(0)) / 2  # TF: moving mean aggregated with MEAN
    for replica in model.replicas:
        torch.testing.assert_close(replica.running_mean, expected)


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_mean_leaves_out_a_replica_with_an_empty_slice(
    torch: Any, cdt: Any, mode: str
) -> None:
    """A last batch of 6 over 4 replicas is 2/2/2/0: the empty replica's statistics did not
    move, and averaging them in diluted the update to 3/4 of plain torch's (bug hunt of
    session 52). Equal slices of the others: their mean is the global batch's mean."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    batches = [torch.randn(8, 3) * 3 + 1, torch.randn(6, 3) * 2 - 4]
    plain = torch.nn.BatchNorm1d(3, momentum=0.5)
    for batch in batches:
        plain(batch)
    with replica_execution(mode):
        strategy = mirrored(4)
        with strategy.scope():
            model = cdt.MirroredModule(torch.nn.BatchNorm1d(3, momentum=0.5))
        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(model, args=(batch,))
    for replica in model.replicas:
        torch.testing.assert_close(replica.running_mean, plain.running_mean, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_no_sync_accumulates_then_reduces_the_sum(torch: Any, cdt: Any, mode: str) -> None:
    with replica_execution(mode):
        strategy = mirrored(2)
        with strategy.scope():
            model = cdt.MirroredModule(torch.nn.Linear(3, 1, bias=False))
        x = torch.arange(12.0).reshape(4, 3)

        def step() -> Any:
            r = cd.get_replica_context().replica_id_in_sync_group
            model.zero_grad()
            with model.no_sync():
                model(x[2 * r : 2 * r + 1]).sum().backward()
            local = model.module.weight.grad.clone()
            model(x[2 * r + 1 : 2 * r + 2]).sum().backward()
            return local, model.module.weight.grad.clone()

        local, reduced = strategy.experimental_local_results(strategy.run(step))[0]
    torch.testing.assert_close(local, x[0:1])  # only this replica's micro-batch
    torch.testing.assert_close(reduced, x.sum(0, keepdim=True))  # everything, reduced once


def test_unused_parameter_keeps_no_gradient(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.MirroredModule(
            torch.nn.ModuleDict({"used": torch.nn.Linear(2, 1), "unused": torch.nn.Linear(2, 1)})
        )

    def step() -> Any:
        model.zero_grad()
        model.used(torch.ones(1, 2)).sum().backward()
        return model.unused.weight.grad, model.used.weight.grad.clone()

    unused, used = strategy.experimental_local_results(strategy.run(step))[0]
    assert unused is None
    torch.testing.assert_close(used, torch.full((1, 2), 2.0))  # two replicas, SUM


@pytest.mark.parametrize("share_storage", [True, False], ids=["shared", "copies"])
def test_a_bucket_is_reduced_during_backward_once_complete(
    torch: Any, cdt: Any, share_storage: bool
) -> None:
    # DDP's overlap: the last layer's bias is bucket 0 (one parameter per bucket); its
    # reduced gradient is in `.grad` before backward reaches the hidden activation.
    class Net(torch.nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Linear(3, 4)
            self.last = torch.nn.Linear(4, 2)

        def forward(self, x: Any) -> Any:
            hidden = torch.tanh(self.first(x))
            hidden.register_hook(_probe)
            return self.last(hidden)

    seen: dict[int, Any] = {}

    def _probe(grad: Any) -> None:
        r = cd.get_replica_context().replica_id_in_sync_group
        seen[r] = model.module.last.bias.grad.clone()

    torch.manual_seed(0)
    with replica_execution("threads"):
        strategy = mirrored(2)
        with strategy.scope():
            model = cdt.prepare(Net(), bucket_cap_bytes=1, share_storage=share_storage)
        assert model.gradient_buckets == [1, 1, 1, 1]

        def step() -> Any:
            r = cd.get_replica_context().replica_id_in_sync_group
            model(torch.full((2, 3), float(r + 1))).sum().backward()
            return model.module.last.bias.grad.clone()

        final = strategy.experimental_local_results(strategy.run(step))
    for r in range(2):
        assert torch.equal(final[r], torch.full((2,), 4.0))  # 2 examples x 2 replicas
        torch.testing.assert_close(seen[r], final[r], rtol=0, atol=0)


def test_mean_gradient_reduction_is_ddp_rule(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        model = cdt.MirroredModule(torch.nn.Linear(2, 1), gradient_reduction="mean")

    def step() -> Any:
        r = cd.get_replica_context().replica_id_in_sync_group
        model(torch.full((1, 2), float(r + 1))).sum().backward()
        return model.module.weight.grad.clone()

    grads = strategy.experimental_local_results(strategy.run(step))
    torch.testing.assert_close(grads[0], torch.full((1, 2), 1.5))


def test_optimizer_follows_schedulers_and_refuses_cross_replica_step(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    with strategy.scope():
        net = torch.nn.Linear(2, 1)
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def step() -> Any:
        optimizer.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        replica = cd.get_replica_context().replica_id_in_sync_group
        return np.float64(optimizer.replicas[replica].param_groups[0]["lr"] + 0 * replica)

    strategy.run(step)
    scheduler.step()
    lrs = strategy.experimental_local_results(strategy.run(step))
    assert [float(x) for x in lrs] == [0.5, 0.5]
    with pytest.raises(RuntimeError, match=r"inside the step function"):
        optimizer.step()


def test_threads_per_replica_policy(torch: Any, cdt: Any) -> None:
    torch.set_num_threads(2)
    strategy = mirrored(4)
    with strategy.scope():
        cdt.MirroredModule(torch.nn.Linear(2, 1))
    assert torch.get_num_threads() == cdt.default_threads_per_replica(4)
    strategy.close()  # (the count comes back with the last such strategy: a test below)
    torch.set_num_threads(2)
    strategy = mirrored(4)
    with strategy.scope():
        cdt.MirroredModule(torch.nn.Linear(2, 1), threads_per_replica=0)
    assert torch.get_num_threads() == 2
    strategy.close()
    strategy = mirrored(2)
    with strategy.scope():
        cdt.MirroredModule(torch.nn.Linear(2, 1), threads_per_replica=3)
    assert torch.get_num_threads() == 3
    strategy.close()
    with pytest.raises(ValueError, match="threads_per_replica"), mirrored(2).scope():
        cdt.MirroredModule(torch.nn.Linear(2, 1), threads_per_replica=-1)


def test_mirroring_inside_run_is_refused(torch: Any, cdt: Any) -> None:
    strategy = mirrored(2)
    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(lambda: cdt.MirroredModule(torch.nn.Linear(2, 1)))
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        cdt.prepare("model")


# --- randomness ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_replicas_draw_their_own_reproducible_streams(torch: Any, cdt: Any, mode: str) -> None:
    def draws() -> Any:
        torch.manual_seed(0)
        strategy = mirrored(4)

        def step() -> Any:
            return (
                torch.rand(5),
                torch.nn.functional.dropout(torch.ones(20), 0.5),
                torch.empty(3).normal_(),
            )

        return [strategy.experimental_local_results(strategy.run(step)) for _ in range(2)]

    with replica_execution(mode):
        first, second = draws(), draws()
    for run_a, run_b in zip(first, second, strict=True):
        for a, b in zip(run_a, run_b, strict=True):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y)  # seeded alike: the same draws
    rand = [draw[0] for draw in first[0]]
    assert len({tuple(x.tolist()) for x in rand}) == 4  # each replica its own stream
    assert not torch.equal(first[0][0][0], first[1][0][0])  # a new run, new draws


def test_a_replica_can_trace_a_graph_that_draws_random_numbers(torch: Any, cdt: Any) -> None:
    # torch.compile's inductor traces its replacement patterns (torch.randperm among them)
    # with make_fx the first time a replica's compiled module runs: a draw traced there
    # must stay torch's own, never take the replica's generator (a graph cannot hold one).
    import threading

    from torch.fx.experimental.proxy_tensor import make_fx

    # make_fx patches torch globally while it traces: one replica thread at a time (as
    # torch.compile's own lock has it), or the threads undo each other's patches.
    one_at_a_time = threading.Lock()

    def draws(x: Any) -> Any:
        return x + torch.rand(3) + torch.randperm(3) + torch.nn.functional.dropout(x)

    def step() -> Any:
        with one_at_a_time:
            graph = make_fx(draws)(torch.zeros(3))
        return sorted(str(n.target) for n in graph.graph.nodes if n.op == "call_function")

    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    traced = strategy.experimental_local_results(strategy.run(step))
    assert traced
    assert all(t == traced[0] for t in traced)
    assert any("randperm" in target for target in traced[0])


def test_random_draws_outside_replicas_are_torchs_own(torch: Any, cdt: Any) -> None:
    import contextlib

    # A run of several replicas installs the per-replica streams (process-wide, while the
    # strategy lives): run one here, so the check does not depend on other tests.
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    strategy.run(lambda: torch.rand(1))
    assert hasattr(torch.rand, "__wrapped__")  # the draws below go through the wrappers
    assert hasattr(torch.nn.functional.dropout, "__wrapped__")
    reference = torch.Generator().manual_seed(3)
    expected = [
        torch.rand(4, generator=reference),
        torch.empty(3).normal_(generator=reference),
        torch.bernoulli(torch.full((6,), 0.5), generator=reference),
    ]
    for where in (contextlib.nullcontext, strategy.scope):
        torch.manual_seed(3)
        with where():
            drawn = [
                torch.rand(4),
                torch.empty(3).normal_(),
                torch.bernoulli(torch.full((6,), 0.5)),
            ]
        for got, want in zip(drawn, expected, strict=True):
            torch.testing.assert_close(got, want)


def test_a_single_replica_draws_from_torchs_generator(torch: Any, cdt: Any) -> None:
    strategy = cd.OneDeviceStrategy("CPU:0")
    torch.manual_seed(5)
    inside = strategy.run(lambda: torch.rand(3))
    torch.manual_seed(5)
    torch.testing.assert_close(inside, torch.rand(3))
    assert strategy.run(cdt.replica_generator) is None


def test_replica_streams_need_no_prepare(torch: Any) -> None:
    # A fresh process: no crossdevice.torch, no mirrored module; torch imported, then run.
    import subprocess
    import sys

    code = """
import torch, crossdevice
crossdevice.config.set_logical_cpu_devices(3)
s = crossdevice.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
def draws():
    torch.manual_seed(0)
    return [t.tolist() for t in s.experimental_local_results(s.run(lambda: torch.rand(4)))]
a, b = draws(), draws()
assert a == b, (a, b)
assert len({tuple(x) for x in a}) == 3, a
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.strip() == "ok", done.stdout + done.stderr


def test_torch_is_untouched_while_no_strategy_uses_it(torch: Any) -> None:
    # A fresh process: torch's functions (and its thread count) are replaced from a
    # multi-replica strategy's first run or prepare until it is closed or collected, and
    # never by a one-replica strategy.
    import subprocess
    import sys

    code = """
import gc, torch, crossdevice, crossdevice.torch
before = (torch.rand, torch.nn.Module.__call__, torch.autograd.backward, torch.get_rng_state)
def same():
    now = (torch.rand, torch.nn.Module.__call__, torch.autograd.backward, torch.get_rng_state)
    return all(a is b for a, b in zip(before, now))
torch.set_num_threads(2)
crossdevice.config.set_logical_cpu_devices(2)
one = crossdevice.OneDeviceStrategy("CPU:0")
one.run(lambda: torch.rand(1))
assert same(), "a one-replica strategy patched torch"
two = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
assert same(), "patched before any use"
with two.scope():
    model = crossdevice.torch.prepare(torch.nn.Linear(2, 1), threads_per_replica=1)
assert not same(), "not patched by prepare"
assert torch.get_num_threads() == 1, "the thread policy did not apply"
two.run(lambda: model(torch.ones(1, 2)).sum().backward())
assert not same(), "not patched inside use"
del model
two.close()
assert same(), "still patched after close"
assert torch.get_num_threads() == 2, "torch's thread count not restored"
three = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
three.run(lambda: torch.rand(1))
assert not same()
del three
gc.collect()
assert same(), "still patched after the strategy was collected"
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.strip() == "ok", done.stdout + done.stderr
