"""`ReducePlans`: which all-reduce calls get a plan, and what a kept plan holds (no workers)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from crossdevice._comm.protocol import ReduceOptions  # noqa: E402
from crossdevice._comm.workers.fingerprint import ReductionPrints  # noqa: E402
from crossdevice._comm.workers.plans import ReducePlans, make_plan  # noqa: E402
from crossdevice._comm.workers.wire import to_wire  # noqa: E402

SUM = ReduceOptions("sum")


def _plan(values: list, options: object = SUM) -> tuple:
    return make_plan(
        values, options, False, False, 1, 2, ReductionPrints(), lambda v: to_wire(v, cuda=False)
    )


def _key(values: list, options: object = SUM) -> object:
    return ReducePlans.key(values, options, False, False, 1)


def test_only_values_that_travel_as_they_are_get_a_key() -> None:
    a = np.ones((2, 3), np.float32)
    assert _key([a]) is not None
    assert _key([torch.ones(2, 3)]) is not None
    readonly = a.copy()
    readonly.flags.writeable = False
    for odd in (readonly, a.T, np.ones(0, np.float32), [1.0], np.float32(1)):
        assert _key([odd]) is None, odd
    assert _key([torch.ones(3, 2).T]) is None  # not contiguous


def test_keys_tell_apart_what_changes_the_call() -> None:
    a = np.ones((2, 3), np.float32)
    keys = {
        _key([a]),
        _key([a.reshape(3, 2)]),
        _key([a.astype(np.float64)]),
        _key([torch.ones(2, 3)]),
        _key([a], "mean"),
        _key([a], ReduceOptions("sum")),  # another options object
        ReducePlans.key([a], SUM, True, False, 1),
        ReducePlans.key([a], SUM, False, False, 2),
    }
    assert len(keys) == 8


def test_a_plan_serves_only_the_options_object_it_was_made_for() -> None:
    a = np.ones(4, np.float32)
    plans = ReducePlans()
    key = _key([a])
    plan, _ = _plan([a])
    plans.keep(key, plan)
    assert plans.get(key, SUM) is not None
    # An equal object under the same key (its id reused after the first one died).
    assert plans.get(key, ReduceOptions("sum")) is None


def test_a_kept_plan_holds_no_memory_of_the_call_that_made_it() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    plans = ReducePlans()
    plan, tensors = _plan([a])
    assert tensors[0].data_ptr() == a.ctypes.data  # sent as it is
    plans.keep(_key([a]), plan)
    kept = plans.get(_key([a]), SUM)
    assert kept is not None
    assert all(w.tensor.numel() == 0 for w in kept.wires)
    b = np.arange(6, dtype=np.float32).reshape(2, 3) + 10
    sent = kept.tensors([b])
    assert sent[0].data_ptr() == b.ctypes.data
    (back,) = kept.results(sent)
    assert isinstance(back, np.ndarray)
    assert back.shape == (2, 3)
    np.testing.assert_array_equal(back, b)


def test_calls_that_need_a_copy_are_never_kept() -> None:
    plans = ReducePlans()
    for dtype in (np.int16, np.uint64):  # widened (a copy), viewed as int64
        plan, _ = _plan([np.ones(3, dtype)])
        plans.keep((dtype,), plan)
        assert plans.get((dtype,), SUM) is None


def test_mean_plans_divide_their_results() -> None:
    a = np.full(3, 4.0, np.float32)
    plan, tensors = _plan([a], "mean")
    (back,) = plan.results([t.clone() for t in tensors])
    np.testing.assert_array_equal(back, np.full(3, 2.0, np.float32))


def test_torch_results_come_back_in_their_values_shapes() -> None:
    # A transport's outputs are flat: a 1-D value's is its result as it is (no reshape),
    # any other is reshaped to its value's shape.
    values = [torch.arange(6.0).reshape(2, 3), torch.arange(4.0), torch.ones(1, 1, 2)]
    plan, tensors = _plan(values)
    outputs = [t.clone() for t in tensors]
    back = plan.results(outputs)
    assert [tuple(b.shape) for b in back] == [(2, 3), (4,), (1, 1, 2)]
    assert back[1] is outputs[1]
    for b, v in zip(back, values, strict=True):
        assert torch.equal(b, v)


def test_a_plan_knows_what_the_predictor_learns_of_its_calls() -> None:
    # Whatever its sequence number, the header of a planned call is learnt as the plan says.
    from crossdevice._comm.workers.speculation import Predictor

    plan, _ = _plan([np.ones(3, np.float32)])
    header = plan.template.copy()
    header[1] = 12345
    assert plan.history == Predictor.history([header, header])
