"""Parameters written inside `run` alike in count but not in value: an error, not drift.

SGLD or weight noise after the step (`p.add_(torch.randn_like(p), alpha=...)` on every
replica) made one in-place write per parameter on every replica, so the counts of
writes compared at the end of the replica code agreed, and the local copies went apart
silently (session 58: 0.064 apart after 5 steps); across workers each worker's own
noise did the same. Now the optimizer's own writes are told apart (version counters
read around its step) and every other write makes its parameter compared bitwise
(`crossdevice/_frameworks/torch/param_edits.py`): between local copies at the end of
the replica code, across workers through the next pass's state. Writes that leave the
same bits everywhere (`clamp_`, a constant decay, noise from a generator seeded alike)
train as plain torch on the same global batches.

With shared storage, after gradient accumulation each replica holds its own gradient
and the one step reads replica 0's: another replica's change to its gradients
(`if replica_id == 1: p.grad.mul_(0)`, its own noise) was dropped, silently. Now it is
compared at the step as with copies (`gradient_edits.py`).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.frameworks.helpers import assert_replicas_like, mirrored
from tests.frameworks.param_edit_workers import ALIKE, STEPS, plain, train, train_on
from tests.multi_worker.harness import run_workers
from tests.strategies.conftest import replica_execution

STORAGES = ["copies", "shared"]
MODES = ["threads", "cooperative"]
#: Local replicas per worker and their storage, for the 2-worker tests.
LAYOUTS = [(1, "copies"), (2, "copies"), (2, "shared")]
#: A write inside run where the replicas store parameters once (refused before this).
_SHARED_WRITE = "was changed in place inside strategy.run"
_APART = "other than by the optimizer's step, alike in number on every replica"
_COPIES = r"'0\.weight' \(replica 0: sum \S+ \(bits #[0-9a-f]{8}\), replica 1: sum \S+ \(bits"
#: What the error says of the collective at the end of the data (`_StepSync.ended`).
_END = "the end of a pass over a distributed dataset"


def _local(case: str, storage: str, mode: str, replicas: int = 2) -> dict[str, Any]:
    with replica_execution(mode):
        return train_on(mirrored(replicas), case, storage)


def _assert_like_plain(torch: Any, params: list[list[Any]], case: str) -> None:
    """Every replica's parameters bitwise alike and within 1e-12 of plain torch's."""
    assert_replicas_like(torch, params, plain(case))


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("storage", STORAGES)
def test_local_parameter_noise_of_each_replica_is_an_error(
    torch: Any, cdt: Any, storage: str, mode: str
) -> None:
    del torch, cdt
    out = _local("noise", storage, mode, replicas=3)
    error = out.get("error", "")
    assert out["steps"] == 0, out  # at the end of the first run
    if storage == "shared":  # one tensor: refused already, whatever the values
        assert _SHARED_WRITE in error, error
        return
    assert _APART in error, error
    assert "replica 0: 2, replica 1: 2, replica 2: 2" in error, error  # counts alike
    assert re.search(_COPIES, error), error
    assert "torch.Generator seeded alike on every replica" in error, error
    assert "call_once" in error, error


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("case", ALIKE)
def test_local_parameter_writes_alike_train_as_plain_torch(
    torch: Any, cdt: Any, case: str, storage: str, mode: str
) -> None:
    del cdt
    out = _local(case, storage, mode)
    assert "params" in out, out
    _assert_like_plain(torch, out["params"], case)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["none", "clamp"])
def test_only_writes_other_than_the_steps_are_compared_by_value(
    torch: Any, cdt: Any, monkeypatch: Any, case: str, mode: str
) -> None:
    """The optimizer's own writes are told apart (its version counters read around its
    step): a step alone prints nothing; a `clamp_` after it prints every parameter."""
    del cdt
    from crossdevice._frameworks.torch import mirroring

    compared: list[list[int]] = []
    real = mirroring.check_values

    def spy(params: Any, names: Any, indices: Any, writes: Any) -> None:
        compared.append(list(indices))
        real(params, names, indices, writes)

    monkeypatch.setattr(mirroring, "check_values", spy)
    out = _local(case, "copies", mode)
    assert "params" in out, out
    _assert_like_plain(torch, out["params"], case)
    assert compared == ([] if case == "none" else [[0, 1, 2, 3]] * STEPS), compared


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("case", ["grad_zero_on_1", "grad_noise"])
def test_local_accumulated_gradients_changed_apart_are_an_error(
    torch: Any, cdt: Any, case: str, storage: str, mode: str
) -> None:
    """Shared storage too: each replica's own accumulated gradient, one step reading
    replica 0's; the change on replica 1 was dropped silently before."""
    del torch, cdt
    out = _local(case, storage, mode)
    error = out.get("error", "")
    assert out["steps"] == 0, out
    assert "changed their all-reduced gradients differently" in error, error
    assert re.search(r"'0\.weight' \(replica 0: sum \S+ \(bits #[0-9a-f]{8}\), replica 1", error)
    if storage == "shared":
        assert "the other replicas' changes would be dropped" in error, error


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("storage", STORAGES)
def test_local_accumulated_gradients_changed_alike_train_as_plain_torch(
    torch: Any, cdt: Any, storage: str, mode: str
) -> None:
    del cdt
    out = _local("grad_mul", storage, mode)
    assert "params" in out, out
    _assert_like_plain(torch, out["params"], "grad_mul")


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("mode", MODES)
def test_a_failed_run_leaves_copies_written_otherwise_alike(
    torch: Any, cdt: Any, mode: str
) -> None:
    """A run that raised after each replica wrote its own noise: the copies are brought
    to replica 0's values, as those written on some replicas only (the next runs check
    only their own writes)."""
    import crossdevice as cd
    from tests.frameworks.helpers import global_batches, global_loss, mlp

    strategy = mirrored(2)
    with strategy.scope():
        net = mlp(torch)
        sgd = torch.optim.SGD(net.parameters(), lr=0.5)
        model, optimizer = cdt.prepare(net, sgd, share_storage=False)

    def step(x: Any, y: Any) -> None:
        optimizer.zero_grad()
        global_loss(torch, model, x, y).backward()
        optimizer.step()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        ctx = cd.get_replica_context()
        ctx.all_reduce("sum", torch.ones(1))  # every replica has written its noise
        raise ValueError("the step failed")

    (x, y), *_ = strategy.experimental_distribute_dataset(global_batches(torch, 1))
    with replica_execution(mode), pytest.raises(ValueError, match="the step failed"):
        strategy.run(step, args=(x, y))
    first, second = model.replicas
    assert all(
        torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True)
    )


def _worker_bits(error: str) -> list[str]:
    return re.findall(
        r"outside step\(\) \(write alike, seeded noise\): '0\.weight' #(\w{8})", error
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize(("replicas", "storage"), LAYOUTS)
def test_workers_parameter_noise_fails_on_every_worker(
    torch_module: Any, replicas: int, storage: str
) -> None:
    """One replica per worker: the next pass's state differs, a `CollectiveMismatchError`
    on every worker showing each worker's bits, one update later. Local copies that
    differ fail at the end of the first run; shared storage refuses the write there."""
    del torch_module
    outs = [r.unwrap() for r in run_workers(train, 2, args=("noise", replicas, storage))]
    for out in outs:
        error = out.get("error", "")
        if replicas > 1:
            assert (_APART if storage == "copies" else _SHARED_WRITE) in error, error
            assert out["steps"] == 0, out
            continue
        assert error.startswith("CollectiveMismatchError"), error
        assert re.search(r"fields that differ: [a-z, ]*\bstate\b", error), error
        shown = _worker_bits(error)
        assert len(shown) == 2, error  # each worker's bits of '0.weight'
        assert shown[0] != shown[1], error
        assert out["steps"] == 1, out


@pytest.mark.multiprocess
@pytest.mark.parametrize(("case", "steps"), [("noise_last", STEPS), ("noise_no_sync", 1)])
def test_workers_parameter_noise_is_seen_at_the_end_and_past_no_sync(
    torch_module: Any, case: str, steps: int
) -> None:
    """Noise in the last step only: the end of the data compares it. Noise before a
    step whose first pass accumulates in `no_sync()` (carrying nothing to the other
    workers): the pass that reduces still shows it."""
    del torch_module
    outs = [r.unwrap() for r in run_workers(train, 2, args=(case, 1, "copies"))]
    for out in outs:
        error = out.get("error", "")
        assert error.startswith("CollectiveMismatchError"), error
        shown = _worker_bits(error)
        assert len(shown) == 2, error
        assert shown[0] != shown[1], error
        assert out["steps"] == steps, out
        if case == "noise_last":
            assert _END in error, error


@pytest.mark.multiprocess
@pytest.mark.parametrize(("replicas", "storage"), LAYOUTS)
@pytest.mark.parametrize("case", ["clamp", "seeded"])
def test_workers_parameter_writes_alike_train_as_plain_torch(
    torch_module: Any, case: str, replicas: int, storage: str
) -> None:
    torch = torch_module
    outs = [r.unwrap() for r in run_workers(train, 2, args=(case, replicas, storage))]
    for out in outs:
        assert "params" in out, out
        _assert_like_plain(torch, out["params"], case)
    first, second = (out["params"][0] for out in outs)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.multiprocess
def test_workers_shared_storage_accumulated_gradient_change_on_one_replica_is_an_error(
    torch_module: Any,
) -> None:
    """Global replica 1 is worker 0's second: worker 0 fails at its first step, and
    worker 1, waiting in its next collective, hears of it."""
    del torch_module
    outs = [r.unwrap() for r in run_workers(train, 2, args=("grad_zero_on_1", 2, "shared"))]
    assert "the other replicas' changes would be dropped" in outs[0]["error"], outs[0]
    assert outs[0]["steps"] == 0, outs[0]
    assert "rank 0 (global replicas [0, 1]) raised" in outs[1]["error"], outs[1]
    assert "changed their all-reduced gradients differently" in outs[1]["error"], outs[1]
