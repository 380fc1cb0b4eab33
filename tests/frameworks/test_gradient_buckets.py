"""Gradient buckets across workers: reduced where they lie, in flight during backward.

2 workers x 1 replica (DDP's layout): each bucket is one flat buffer all-reduced in
place, its parameters' gradients views into it (`buckets.py`).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import pytest

from tests.comm.peers import GLOO, TUNING_ENV, assert_failing_peer_named, tuned
from tests.frameworks.helpers import GLOBAL_BATCH, global_batches, identical_mlp, mlp
from tests.frameworks.workers import (
    bucket_reuse,
    bucket_training,
    bucket_views,
    chained_models,
    collectives_in_backward,
    compressed_gradients,
    compressed_gradients_of_mixed_rules,
    identical_layers,
    queued_failure,
    resized_bucket,
)
from tests.multi_worker.harness import run_workers

STEPS = 6


def _plain(
    torch: Any, make: Any = mlp, steps: int = STEPS, momentum: float = 0.9
) -> list[np.ndarray]:
    """Plain torch on the same global batches, in float64: the reference."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        net = make(torch)
        sgd = torch.optim.SGD(net.parameters(), lr=0.5, momentum=momentum)
        for x, y in global_batches(torch, steps):
            sgd.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y, reduction="sum") / GLOBAL_BATCH
            loss.backward()
            sgd.step()
        return [p.detach().numpy() for p in net.parameters()]
    finally:
        torch.set_default_dtype(dtype)


@pytest.mark.multiprocess
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_buckets_reduced_where_they_lie_train_like_plain_torch_and_as_before(
    torch: Any, op: str
) -> None:
    flat = [r.unwrap() for r in run_workers(bucket_training, 2, args=(op, True, STEPS), timeout=90)]
    before = [
        r.unwrap() for r in run_workers(bucket_training, 2, args=(op, False, STEPS), timeout=90)
    ]
    for a, b in zip(flat[0], flat[1], strict=True):
        np.testing.assert_array_equal(a, b)  # the workers agree bitwise
    for a, b in zip(flat[0], before[0], strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise what all_reduce's path gives
    reference = _plain(torch)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(flat[0], reference, strict=True))
    assert worst <= 1e-12
    start = [p.detach().numpy() for p in mlp(torch).double().parameters()]
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(reference, start, strict=True)) > 1e-3


@pytest.mark.multiprocess
@pytest.mark.parametrize("shared_memory", ["0", "1"], ids=["gloo", "shm"])
def test_buckets_issued_on_the_queue_thread_train_bitwise_as_from_the_hook(
    torch: Any, shared_memory: str
) -> None:
    """`queue_min_bytes=0` (the default): every bucket that travels through Gloo packed,
    sent and completed on the communicator's queue thread while backward goes on
    (`_comm/workers/callqueue.py`); the same three buckets, micro-batches under no_sync
    and gradients cleared both ways. Through shared memory the hook issues them all the
    same (the worker checks which thread did)."""
    env = {"CROSSDEVICE_SHARED_MEMORY": shared_memory}
    args = ("sum", True, STEPS)
    queued = [
        r.unwrap() for r in run_workers(bucket_training, 2, args=(*args, True), timeout=90, env=env)
    ]
    hooked = [r.unwrap() for r in run_workers(bucket_training, 2, args=args, timeout=90, env=env)]
    for a, b, c in zip(queued[0], queued[1], hooked[0], strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    reference = _plain(torch)
    assert (
        max(float(np.max(np.abs(a - b))) for a, b in zip(queued[0], reference, strict=True))
        <= 1e-12
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["gloo", "gloo-large", "shm"])
def test_buckets_alike_in_a_row_are_predicted_every_step(torch: Any, transport: str) -> None:
    """Three hidden layers alike, one bucket each: the same collective three times in a
    row (through shared memory, or on Gloo a pass larger than `pass_max_bytes`; else the
    pass's buckets are one all-reduce, `pass_reduce.py`). From the third step on every
    layout is predicted right (a wrong guess sends a bucket of zeros first), and the model
    is plain torch's. (While the step count in a bucket's call site was history, the
    fifth step was the first.)"""
    steps = 9
    env = {"CROSSDEVICE_SHARED_MEMORY": "1"} if transport == "shm" else GLOO
    if transport == "gloo-large":
        env = tuned(pass_max_bytes=64)  # the pass holds 1.1 KiB: one by one
    outs = [
        r.unwrap() for r in run_workers(identical_layers, 2, args=(steps,), env=env, timeout=90)
    ]
    assert outs[0]["buckets"] == [[3, 2, 2, 2, 1]]  # [b5 W5 b4] [W4 b3] [W3 b2] [W2 b1] [W1]
    per_step = 1 if transport == "gloo" else 5
    for out in outs:
        assert out["misses"][-1] == out["misses"][1], out["misses"]
        assert out["guesses"][-1] - out["guesses"][2] == per_step * (steps - 3), out["guesses"]
    for a, b in zip(outs[0]["params"], outs[1]["params"], strict=True):
        np.testing.assert_array_equal(a, b)
    reference = _plain(torch, identical_mlp, steps, momentum=0.0)
    for a, b in zip(outs[0]["params"], reference, strict=True):
        assert float(np.max(np.abs(a - b))) <= 1e-12


@pytest.mark.multiprocess
@pytest.mark.parametrize("shared_memory", ["0", "1"], ids=["gloo", "shm"])
def test_every_bucket_of_every_epoch_is_predicted_once_an_epoch_ended(shared_memory: str) -> None:
    """Four passes over 5 global batches, 5 buckets a step. Each pass starts with its
    length's agreement, which follows the step's last bucket there and the first bucket
    of the next step everywhere else: once the first pass ended, every bucket of every
    step is predicted right and the agreement is not guessed a bucket (it was, every
    pass, a bucket of zeros sent before it, when the step count in the buckets' call
    site made a step's buckets four keys in turn). On Gloo a step's buckets are one
    all-reduce from the second step on (the first sends them one by one, watched:
    `pass_reduce.py`), so the first two passes' starts differ and the second pass's end
    is the one that settles it."""
    steps, epochs = 5, 4
    env = {"CROSSDEVICE_SHARED_MEMORY": shared_memory}
    runs = run_workers(identical_layers, 2, args=(steps, epochs), env=env, timeout=120)
    per_step, settled = (1, 2 * steps) if shared_memory == "0" else (5, steps)
    for out in [r.unwrap() for r in runs]:
        misses, guesses = out["misses"], out["guesses"]
        assert len(misses) == steps * epochs
        assert misses[-1] == misses[settled], misses  # none once it settled
        for before, after in itertools.pairwise(guesses[settled:]):
            assert after - before == per_step, guesses  # every bucket; never the agreement


@pytest.mark.multiprocess
def test_a_pass_waiting_for_a_module_ended_late_does_not_hold_up_another(torch: Any) -> None:
    """Two prepared models, chained, several buckets each; the outer one has a layer no
    step uses, so its pass's all-reduce (queued first: backward reaches it first) waits
    for a bucket completed only when the pass returns. The passes end as plain torch's,
    at once, not at the collective's 20 s timeout."""
    from tests.frameworks.workers import chained_nets

    steps = 3
    start = time.monotonic()
    runs = run_workers(chained_models, 2, args=(steps,), timeout=60, env=GLOO)
    outs = [r.unwrap() for r in runs]
    assert time.monotonic() - start < 40.0
    for a, b in zip(outs[0], outs[1], strict=True):
        np.testing.assert_array_equal(a, b)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        inner, outer = chained_nets(torch)
        sgd = torch.optim.SGD([*inner.parameters(), *outer.parameters()], lr=0.5)
        for x, y in global_batches(torch, steps):
            sgd.zero_grad()
            logits = outer[3](outer[2](outer[1](inner(x))))
            (
                torch.nn.functional.cross_entropy(logits, y, reduction="sum") / GLOBAL_BATCH
            ).backward()
            sgd.step()
        reference = [p.detach().numpy() for p in [*inner.parameters(), *outer.parameters()]]
    finally:
        torch.set_default_dtype(dtype)
    for a, b in zip(outs[0], reference, strict=True):
        assert float(np.max(np.abs(a - b))) <= 1e-12


@pytest.mark.multiprocess
def test_a_backward_that_starts_collectives_sends_its_buckets_one_by_one(torch: Any) -> None:
    """SyncBatchNorm's differentiable all-reduces start collectives inside backward, after
    the first bucket is ready: one all-reduce for the pass's buckets, which waits for
    backward, could never let them go first. The first pass, watched, shows it: the
    buckets keep going one by one, and the model trains as plain torch's BatchNorm on the
    global batch."""
    from tests.frameworks.workers import norm_net

    steps = 3
    runs = run_workers(collectives_in_backward, 2, args=(steps, False), timeout=60, env=GLOO)
    outs = [r.unwrap() for r in runs]
    assert [out["passes"] for out in outs] == [-1, -1]
    for a, b in zip(outs[0]["params"], outs[1]["params"], strict=True):
        np.testing.assert_array_equal(a, b)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        net = norm_net(torch, torch.nn.BatchNorm1d(8))
        sgd = torch.optim.SGD(net.parameters(), lr=0.5)
        for x, y in global_batches(torch, steps):
            sgd.zero_grad()
            (
                torch.nn.functional.cross_entropy(net(x), y, reduction="sum") / GLOBAL_BATCH
            ).backward()
            sgd.step()
        reference = [p.detach().numpy() for p in net.parameters()]
    finally:
        torch.set_default_dtype(dtype)
    for a, b in zip(outs[0]["params"], reference, strict=True):
        assert float(np.max(np.abs(a - b))) <= 1e-12


@pytest.mark.multiprocess
@pytest.mark.parametrize("one_by_one", [False, True], ids=["passes", "env-off"])
def test_a_collective_that_backward_starts_late_is_refused_at_once(one_by_one: bool) -> None:
    """Two passes without collectives of their own let a model's buckets travel as one
    all-reduce per pass; a third whose backward starts one (SyncBatchNorm's, from that
    step on) cannot let it go first: RuntimeError at once on every worker, saying what
    to do, not a wait for the collective's 20 s timeout. With the variable it names
    set to 0, every bucket goes on its own, and the step runs."""
    env = {**GLOO, "CROSSDEVICE_PASS_ALL_REDUCE": "0"} if one_by_one else GLOO
    runs = run_workers(collectives_in_backward, 2, args=(3, True), timeout=60, env=env)
    for out in [r.unwrap() for r in runs]:
        if one_by_one:
            assert out["outcome"] == ("returned", ""), out["outcome"]
            assert out["passes"] == -1
            continue
        kind, message = out["outcome"]
        assert kind == "RuntimeError", out["outcome"]
        assert "a collective was started inside backward" in message
        assert "CROSSDEVICE_PASS_ALL_REDUCE=0" in message
        assert out["elapsed"] < 10.0
        assert out["passes"] == 1


@pytest.mark.multiprocess
def test_a_backward_that_raises_with_buckets_queued_names_the_worker_on_its_peer() -> None:
    """Rank 1's backward raises after its later buckets were queued: rank 1 gets its own
    error, rank 0 (whose queue waits for rank 1's remaining buckets) a WorkerFailedError
    naming rank 1 within seconds, not a timeout or a hang; and neither queue keeps
    waiting (rank 1's pass all-reduce for the buckets its backward never completed)."""
    outs = [r.unwrap() for r in run_workers(queued_failure, 2, timeout=60, env=GLOO)]
    assert_failing_peer_named(outs)
    assert [out["queue_idle"] for out in outs] == [True, True]


@pytest.mark.multiprocess
@pytest.mark.parametrize("shared_memory", ["0", "1"], ids=["gloo", "shm"])
def test_a_gradient_kept_from_a_step_keeps_its_bucket(shared_memory: str) -> None:
    """Every .grad lies in one buffer per bucket (reduced there on Gloo), recycled only
    once nothing refers to it: a gradient a program kept from a step (`g = p.grad`)
    never changes under it, as DDP's persistent gradient_as_bucket_view would change it."""
    env = {"CROSSDEVICE_SHARED_MEMORY": shared_memory}
    for result in [r.unwrap() for r in run_workers(bucket_views, 2, timeout=60, env=env)]:
        first, second = result["storages"]
        assert len(first) == 1  # every .grad lies in the one bucket
        assert len(second) == 1
        assert first != second
        assert result["first_unchanged"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("piece_bytes", [4 << 20, 64], ids=["folded", "apart"])
def test_steps_that_keep_no_gradient_reuse_the_strategys_buffers(piece_bytes: int) -> None:
    """After `zero_grad()` nothing holds a step's reduced buffer: not the torch layer's
    record of what it produced, not the helper that waited for the data. So every later
    step takes its pack and its output from the pool (a fresh 476 KiB buffer every other
    step cost its page faults on the tutorial CNN's epoch). Across machines (Gloo), with
    the exchange's header folded behind the data or sent apart (64-byte pieces)."""
    env = {"CROSSDEVICE_SHARED_MEMORY": "0"}
    env[TUNING_ENV] = f"ring_piece_bytes={piece_bytes}"
    for result in [r.unwrap() for r in run_workers(bucket_reuse, 2, timeout=60, env=env)]:
        assert result["fresh"] == []


@pytest.mark.multiprocess
def test_bf16_gradients_are_rounded_once_and_summed_in_float32(torch: Any) -> None:
    results = [r.unwrap() for r in run_workers(compressed_gradients, 2, timeout=60)]
    for k, reduced in enumerate(results[0]["reduced"]):
        np.testing.assert_array_equal(reduced, results[1]["reduced"][k])  # every worker alike
        locals_ = [torch.from_numpy(r["local"][k]) for r in results]
        # Each worker's gradient rounded to bf16 once, added in rank order in float32.
        expected = locals_[0].bfloat16().float() + locals_[1].bfloat16().float()
        np.testing.assert_array_equal(reduced, expected.numpy())
        # The documented bound: |error| <= 2**-8 * sum |g_w| (bf16's rounding, once each)
        exact = locals_[0].double() + locals_[1].double()
        scale = locals_[0].double().abs() + locals_[1].double().abs()
        error = (torch.from_numpy(reduced).double() - exact).abs()
        assert bool((error <= 2.0**-8 * scale + 1e-30).all())
        assert bool((error > 0).any())  # it did travel in bf16


@pytest.mark.multiprocess
def test_workers_that_would_add_bf16_gradients_by_different_rules_get_an_error() -> None:
    # The compressed path gathers the workers' rows and adds them itself: the workers
    # must still compare the op (and leaves and call site) as an all-reduce does.
    results = run_workers(compressed_gradients_of_mixed_rules, 2, timeout=60)
    for result in results:
        assert result.error_type == "CollectiveMismatchError", result.describe()
        assert "(fields that differ: op)" in str(result.error_message)


@pytest.mark.multiprocess
def test_bf16_gradients_of_three_workers_are_summed_in_float32(torch: Any) -> None:
    # A bfloat16 model: its gradients are sent as they are and added in float32, rounded
    # once; Gloo's own bf16 all-reduce would round after each of the two additions.
    results = [
        r.unwrap() for r in run_workers(compressed_gradients, 3, args=("bfloat16",), timeout=90)
    ]
    assert {r["dtype"] for r in results} == {"torch.bfloat16"}
    rounded_each_time = False
    for k, reduced in enumerate(results[0]["reduced"]):
        for other in results[1:]:
            np.testing.assert_array_equal(reduced, other["reduced"][k])  # every worker alike
        locals_ = [torch.from_numpy(r["local"][k]) for r in results]
        once = (locals_[0] + locals_[1] + locals_[2]).bfloat16().float()  # float32, in order
        np.testing.assert_array_equal(reduced, once.numpy())
        chain = (locals_[0].bfloat16() + locals_[1].bfloat16()) + locals_[2].bfloat16()
        rounded_each_time |= not torch.equal(chain.float(), once)
    assert rounded_each_time  # the data tell the two apart


@pytest.mark.parametrize("bad", ["bf16", "torch.int32"])
def test_gradient_dtype_must_be_a_floating_torch_dtype(torch: Any, bad: str) -> None:
    import crossdevice as cd
    import crossdevice.torch as cdt

    dtype = torch.int32 if bad == "torch.int32" else bad
    strategy = cd.MirroredStrategy(["CPU:0"])
    with strategy.scope(), pytest.raises(ValueError, match="floating torch dtype") as info:
        cdt.prepare(torch.nn.Linear(2, 1), gradient_dtype=dtype)
    assert repr(dtype) in str(info.value)


@pytest.mark.multiprocess
def test_a_bucket_whose_parameters_were_resized_between_steps_is_reduced_in_their_new_shapes() -> (
    None
):
    # A bucket's flat layout is kept from step to step (`buckets.FlatPlan`): it must
    # follow parameters whose shapes changed (model surgery between steps).
    for result in [r.unwrap() for r in run_workers(resized_bucket, 2, timeout=60)]:
        before, after = result["steps"]
        assert before["shapes"] == before["expected_shapes"]
        assert after["shapes"] == after["expected_shapes"]
        assert after["shapes"][0] == (10, 6)  # widened
        assert before["worst"] <= 1e-5
        assert after["worst"] <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_flat_plan_cuts_the_reduced_buffer_into_views_of_each_shape(
    torch: Any, dtype: str
) -> None:
    """`FlatPlan.views` (one torch call per bucket, issue #26) undoes `FlatPlan.parts`:
    each gradient a view of its own range of the reduced buffer, in its parameter's shape,
    and the `used` flags the buffer's last elements."""
    from crossdevice._frameworks.torch.buckets import FlatPlan

    shapes = [(2, 3), (4,), (0, 3), (1, 2, 2), (), (3, 1)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=getattr(torch, dtype))) for s in shapes]
    plan = FlatPlan(params)
    sizes = [p.numel() for p in params]
    total = torch.arange(sum(sizes) + len(params), dtype=params[0].dtype)
    grads, used, one_buffer = plan.views(total)
    assert not one_buffer
    start = 0
    for grad, param, size in zip(grads, params, sizes, strict=True):
        assert grad.shape == param.shape
        assert grad.dtype == param.dtype
        if size:  # (an empty one holds nothing to share)
            assert grad.data_ptr() == total[start:].data_ptr()  # a view, not a copy
        assert torch.equal(grad.reshape(-1), total[start : start + size])
        start += size
    assert torch.equal(used, total[start:])
    # parts -> flat buffer -> views is the identity.
    again, _, _ = plan.views(torch.cat(plan.parts(grads, params)))
    assert all(torch.equal(a, b) for a, b in zip(again, grads, strict=True))


def test_a_flat_plan_checks_its_bucket_while_it_reads_the_gradients(torch: Any) -> None:
    """`FlatPlan.checked_parts`, the per-step case, is `parts` while the plan fits the
    parameters and no gradient needs the graph, and None (take the slow path) otherwise."""
    from crossdevice._frameworks.torch.buckets import FlatPlan

    params = [torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))]
    plan = FlatPlan(params)
    grads = [torch.full((2, 3), 2.0), torch.full((4,), 3.0)]
    for gs in (grads, [None, grads[1]]):  # a missing gradient adds zeros, flag 0
        checked = plan.checked_parts(gs, params)
        assert checked is not None
        expected = plan.parts(gs, params)
        assert all(torch.equal(a, b) for a, b in zip(checked, expected, strict=True))
    assert checked[-1].tolist() == [0.0, 1.0]
    wider = [params[0], torch.nn.Parameter(torch.ones(5))]
    assert plan.checked_parts([grads[0], torch.ones(5)], wider) is None  # shape
    doubles = [params[0], torch.nn.Parameter(torch.ones(4, dtype=torch.float64))]
    assert plan.checked_parts(grads, doubles) is None  # dtype
    assert plan.checked_parts(grads, params[:1]) is None  # count
    graph = [grads[0], torch.ones(4, requires_grad=True) * 3.0]
    assert plan.checked_parts(graph, params) is None  # create_graph: autograd routes it


def test_a_pass_of_more_buckets_than_the_ring_can_number_goes_bucket_by_bucket(
    torch: Any,
) -> None:
    """The ring numbers a buffer's messages from `buffer * 2**17` in a C int: a pass of
    more than `MAX_BUCKETS` buckets is not sent as one all-reduce (nothing is issued)."""
    from types import SimpleNamespace

    from crossdevice._core.reduce_op import ReduceOp
    from crossdevice._frameworks.torch import pass_reduce
    from crossdevice._frameworks.torch.buckets import FlatPlan

    issued: list[int] = []

    def reduce_flats(replica: int, op: Any, like: Any, numels: list[int], *rest: Any) -> Any:
        issued.append(len(numels))
        return SimpleNamespace(done=lambda: False)

    extended = SimpleNamespace(
        _replica_reduce_flats_async=reduce_flats,
        _communication_options=lambda: None,
        _worker_communicator=None,
    )
    ctx = SimpleNamespace(strategy=SimpleNamespace(extended=extended), replica_id_in_sync_group=0)
    plan = FlatPlan([torch.nn.Parameter(torch.zeros(2))])
    parts = plan.parts([torch.ones(2)], [torch.nn.Parameter(torch.zeros(2))])
    for count in (pass_reduce.MAX_BUCKETS, pass_reduce.MAX_BUCKETS + 1):
        plans = [plan] * count
        leaves = tuple(x for p in plans for x in p.leaves)
        got = pass_reduce.issue(ctx, ReduceOp.SUM, plans, leaves, parts, 0)
        assert (got is None) == (count > pass_reduce.MAX_BUCKETS)
    assert issued == [pass_reduce.MAX_BUCKETS]
