"""One share-or-copy rule for every result handed to several holders (`_arrays/handout.py`)."""

from __future__ import annotations

import numpy as np
import pytest

from crossdevice._arrays.handout import hand_out, hand_out_all, hand_out_each


def test_numpy_results_are_one_read_only_buffer_for_every_holder() -> None:
    result = np.arange(3.0)
    held = hand_out_all(result, 3)
    assert all(h is result for h in held)
    assert not result.flags.writeable
    assert hand_out(np.float32(2), copy=True) == np.float32(2)


def test_tensors_are_one_per_holder_the_first_may_take_the_result() -> None:
    torch = pytest.importorskip("torch")
    result = torch.arange(3.0)
    first, second, third = hand_out_all(result, 3)
    assert first is result
    assert second is not result
    assert third is not result
    assert second is not third
    second.add_(1)  # an in-place edit by one holder reaches no other
    assert result.tolist() == [0.0, 1.0, 2.0] == third.tolist()
    assert hand_out(result, copy=True) is not result


def test_each_result_is_copied_from_its_second_holder_on() -> None:
    torch = pytest.importorskip("torch")
    a, b = torch.zeros(2), torch.ones(2)
    out = hand_out_each([a, b, a])
    assert out[0] is a
    assert out[1] is b
    assert out[2] is not a
    assert out[2].tolist() == [0.0, 0.0]


def test_a_result_that_aliases_an_input_is_copied_first() -> None:
    # `results.owned`: what is handed out (and frozen) is never a caller's input.
    from crossdevice._cross_device.results import owned

    class Sub(np.ndarray):
        pass

    x = np.arange(6.0)
    for result, inputs in [
        (x, [x]),  # the input itself
        (x[2:], [np.zeros(2), x]),  # a view of one of them
        (x[:3], [x[2:].view(Sub)]),  # overlapping memory, through a subclass
    ]:
        copy = owned(result, inputs)
        assert copy is not result
        assert not np.may_share_memory(copy, x)
        assert copy.tolist() == result.tolist()
    other = np.ones(3)
    assert owned(other, [x, x[1:]]) is other
    assert np.may_share_memory(owned(x[:3], [x[3:]]), x)  # adjacent, disjoint: kept
    torch = pytest.importorskip("torch")
    t = torch.arange(4.0)
    assert owned(t[1:], [t]).data_ptr() != t[1:].data_ptr()
    assert owned(t, [torch.ones(1)]) is t
