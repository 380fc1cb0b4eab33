"""Whether a pass goes on: a dataset's exact length, and the per-step agreement it spares."""

from __future__ import annotations

from typing import Any

import pytest

from crossdevice._input.agreement import PassAgreement, exact_length


class _Workers:
    """A StepSync for one worker whose peers always agree with it; counts what it sends."""

    def __init__(self, count: int | None) -> None:
        self.count = count  # what every worker answers for the length
        self.sent: list[Any] = []
        self.sizes: list[int | None] = []  # the global batch size given with each agreement
        self.collective_since = False  # a step's own collective ran since the last agreement

    def agree(self, has_data: bool, steps: int | None, size: int | None = None) -> tuple[bool, Any]:
        self.sent.append(("agree", has_data, steps))
        self.sizes.append(size)
        self.collective_since = False
        return has_data, None if steps is None else (lambda: self.count)

    def skip(self, size: int | None) -> bool:
        if not self.collective_since:
            return False
        self.sent.append(("skip",))
        self.sizes.append(size)
        self.collective_since = False
        return True

    def ended(self) -> None:
        self.sent.append(("ended",))


def _run(agreement: PassAgreement, workers: _Workers, flags: list[bool]) -> list[bool]:
    out = []
    for flag in flags:
        out.append(agreement.goes_on(flag))
        workers.collective_since = True  # each step all-reduces
    return out


def test_exact_length_of_sequences_and_map_style_loaders_only() -> None:
    torch = pytest.importorskip("torch")
    data = torch.utils.data

    class Stream(data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(range(3))

    class MyLoader(data.DataLoader):  # type: ignore[type-arg]
        pass

    tensors = data.TensorDataset(torch.arange(10.0))
    assert exact_length([1, 2, 3]) == 3
    assert exact_length((1, 2)) == 2
    assert exact_length(range(4)) == 4
    assert exact_length(data.DataLoader(tensors, batch_size=4)) == 3
    assert exact_length(data.DataLoader(Stream(), batch_size=2)) is None  # len may lie
    assert exact_length(MyLoader(tensors, batch_size=4)) is None  # its own __len__ may lie
    assert exact_length(x for x in range(3)) is None


def test_an_agreed_length_spares_the_later_agreements() -> None:
    workers = _Workers(count=3)
    agreement = PassAgreement(workers, 3)
    assert _run(agreement, workers, [True, True, True, False]) == [True, True, True, False]
    # The pass's end then compares what its last step left (`StepSync.ended`).
    assert workers.sent == [("agree", True, 3), ("skip",), ("skip",), ("skip",), ("ended",)]


def test_only_the_first_agreement_of_a_pass_carries_the_batch_size() -> None:
    workers = _Workers(count=None)
    agreement = PassAgreement(workers, None)
    for has_data, size in [(True, 8), (True, 8), (True, 3), (False, None)]:
        agreement.goes_on(has_data, size)
    assert workers.sizes == [8, None, None, None]


def test_lengths_that_differ_agree_every_step_and_warn() -> None:
    """Every worker passes the same global batches: lengths that differ are a mistake
    (each worker slices its own list), trained on silently until session 56's hunt."""
    workers = _Workers(count=None)  # some worker gave another length
    agreement = PassAgreement(workers, 3)
    with pytest.warns(UserWarning, match=r"different lengths \(this worker's: 3 global") as w:
        _run(agreement, workers, [True, True, True, False])
    assert w[0].filename == __file__  # the loop's own line, however deep the check
    agreed = [("agree", f, None) for f in (True, True, False)]
    assert workers.sent == [("agree", True, 3), *agreed, ("ended",)]


def test_a_pass_of_unknown_length_does_not_warn(recwarn: Any) -> None:
    workers = _Workers(count=None)
    _run(PassAgreement(workers, None), workers, [True, True, False])
    assert not [w for w in recwarn if "different lengths" in str(w.message)]


def test_a_step_without_a_collective_agrees_for_real() -> None:
    workers = _Workers(count=3)
    agreement = PassAgreement(workers, 3)
    assert agreement.goes_on(True)
    assert agreement.goes_on(True)  # no collective since the first agreement
    assert workers.sent == [("agree", True, 3), ("agree", True, None)]


@pytest.mark.parametrize(
    ("flags", "word"), [([True, True, True], "more"), ([True, False], "fewer")]
)
def test_a_length_that_lies_is_an_error(flags: list[bool], word: str) -> None:
    workers = _Workers(count=2)
    agreement = PassAgreement(workers, 2)
    with pytest.raises(RuntimeError, match=f"yielded {word} than its len\\(\\) of 2 batches"):
        _run(agreement, workers, flags)


def test_one_worker_decides_alone() -> None:
    agreement = PassAgreement(None, 2)
    assert [agreement.goes_on(f) for f in (True, False)] == [True, False]
