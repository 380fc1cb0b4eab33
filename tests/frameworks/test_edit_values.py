"""Changes to the reduced gradients alike in count but not in value: an error, not drift.

Noise that each replica drew from its own random stream
(`p.grad.add_(torch.randn_like(p.grad) * 0.01)`: gradient noise, SGLD) or a scale that
depends on the replica or worker made one in-place write per gradient on every replica,
so the counts of changes compared at the step agreed, and the "mirrored" copies went
apart silently (session 58: local copies 0.04 apart after 5 steps, two workers 0.07
after 3). Now where any replica changed a gradient the changed gradients are compared
bitwise (`crossdevice/_frameworks/torch/gradient_edits.py`): between local copies at
the step, across workers through the next pass's state. Changes that leave the same
bits everywhere (clipping, a constant scale, noise from a generator seeded alike) train
as plain torch on the same global batches.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.frameworks.edit_value_workers import APART, plain, train, train_on
from tests.frameworks.helpers import assert_replicas_like, mirrored
from tests.multi_worker.harness import run_workers
from tests.strategies.conftest import replica_execution

STORAGES = ["copies", "shared"]
MODES = ["threads", "cooperative"]
#: Local replicas per worker and their storage, for the 2-worker tests.
LAYOUTS = [(1, "copies"), (2, "copies"), (2, "shared")]
#: What a local replica's in-place change to the one reduced gradient is (shared storage).
_LANDS_TWICE = "was changed in place on replica 1 inside strategy.run"


def _local(torch: Any, case: str, storage: str, mode: str, replicas: int = 2) -> dict[str, Any]:
    del torch  # (its fixture: float64 and torch's settings restored)
    with replica_execution(mode):
        return train_on(mirrored(replicas), case, storage)


def _assert_like_plain(torch: Any, params: list[list[Any]], case: str) -> None:
    """Every replica's parameters bitwise alike and within 1e-12 of plain torch's."""
    assert_replicas_like(torch, params, plain(case))


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("case", APART)
def test_local_edits_that_differ_in_value_are_an_error(
    torch: Any, cdt: Any, case: str, storage: str, mode: str
) -> None:
    del cdt
    out = _local(torch, case, storage, mode, replicas=3)
    error = out.get("error", "")
    assert out["steps"] == 0, out  # the first step, before any replica updated
    if storage == "shared":  # one reduced gradient: each replica's write would land on it
        assert _LANDS_TWICE in error, error
        return
    assert "changed their all-reduced gradients differently" in error, error
    assert "replica 0: 4, replica 1: 4, replica 2: 4" in error, error  # counts alike
    assert re.search(r"'0\.weight' \(replica 0: sum \S+ \(bits #[0-9a-f]{8}\), replica 1", error)
    assert "torch.Generator seeded alike on every replica" in error, error


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("case", ["clip", "mul", "seeded"])
def test_local_edits_alike_in_value_train_as_plain_torch(
    torch: Any, cdt: Any, case: str, storage: str, mode: str
) -> None:
    del cdt
    out = _local(torch, case, storage, mode)
    assert "params" in out, out
    _assert_like_plain(torch, out["params"], case)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("replicas", "storage"), LAYOUTS)
@pytest.mark.parametrize("case", APART)
def test_workers_whose_edits_differ_in_value_fail_on_every_worker(
    torch_module: Any, case: str, replicas: int, storage: str
) -> None:
    """One replica per worker, or shared storage (the step reads replica 0's gradients):
    the next pass's state differs, a `CollectiveMismatchError` on every worker showing
    each worker's bits, one update later. Local replicas that differ fail at the step
    (shared storage too: each holds its own gradient after the cross-worker reduction)."""
    del torch_module
    outs = [r.unwrap() for r in run_workers(train, 2, args=(case, replicas, storage))]
    for out in outs:
        error = out.get("error", "")
        if replicas > 1:
            assert "changed their all-reduced gradients differently" in error, error
            assert out["steps"] == 0, out
            continue
        assert error.startswith("CollectiveMismatchError"), error
        assert re.search(r"fields that differ: [a-z, ]*\bstate\b", error), error
        shown = re.findall(r"before the last step\(\), bits '0\.weight' #([0-9a-f]{8})", error)
        assert len(shown) == 2, error  # each worker's bits of '0.weight'
        assert shown[0] != shown[1], error
        assert "edit alike on every worker" in error, error
        assert out["steps"] == 1, out


@pytest.mark.multiprocess
@pytest.mark.parametrize(("replicas", "storage"), LAYOUTS)
@pytest.mark.parametrize("case", ["clip", "mul", "seeded"])
def test_workers_whose_edits_are_alike_train_as_plain_torch(
    torch_module: Any, case: str, replicas: int, storage: str
) -> None:
    torch = torch_module
    outs = [r.unwrap() for r in run_workers(train, 2, args=(case, replicas, storage))]
    for out in outs:
        assert "params" in out, out
        _assert_like_plain(torch, out["params"], case)
    first, second = (out["params"][0] for out in outs)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_gradient_prints_follow_the_bits_alone(torch: Any) -> None:
    """Equal bits print alike wherever they lie (words aligned or not, a strided view, a
    sparse gradient coalesced or not); a changed element, its sign, -0.0 for 0.0 print
    otherwise; NaNs with the same bits agree."""
    from crossdevice._frameworks.torch.step_check import gradient_prints

    x = torch.randn(7, dtype=torch.float32)
    at_1, at_4 = torch.zeros(20), torch.zeros(20)
    at_1[1:8], at_4[4:11] = x, x
    even = torch.randn(8, dtype=torch.float32)  # whole words: read in place where aligned
    at_2, at_3 = torch.zeros(20), torch.zeros(20)
    at_2[2:10], at_3[3:11] = even, even
    grid = torch.randn(4, 6)
    nan = torch.tensor([float("nan"), 1.0])
    with torch.sparse.check_sparse_tensor_invariants(True):
        sparse = torch.sparse_coo_tensor([[2, 0, 2]], [1.0, 2.0, 0.5], (4,))
    same = [
        [x, at_1[1:8], at_4[4:11]],
        [even, at_2[2:10], at_3[3:11]],
        [grid.t(), grid.t().contiguous()],
        [torch.randn(3, dtype=torch.float64)] * 2,
        [nan, nan.clone()],
        [sparse, sparse.coalesce()],
    ]
    for group in same:
        prints = gradient_prints(group)
        assert len(set(prints)) == 1, prints
    y = x.clone()
    y[3] = -y[3]
    zero = torch.tensor([0.0, 1.0])
    apart = [(x, y), (x, x * 1.0000001), (zero, torch.tensor([-0.0, 1.0]))]
    for a, b in apart:
        first, second = gradient_prints([a, b])
        assert first != second
    assert gradient_prints([None, x]) == [None, gradient_prints([x])[0]]
