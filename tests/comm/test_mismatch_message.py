"""The mismatch message says what each differing field means, in the user's terms.

A collective called from two lines (`if rank == 0: reduce(...) else: reduce(...)`)
showed "fields that differ: structure" beside identical `float32[3]` buffers; a NumPy
array on one worker and a torch tensor on the other showed "shapes" beside identical
shapes (the second bug hunt of session 53). Each field that differs now adds its
sentence: the calling line, the array library, the optimizer state.
"""

from __future__ import annotations

import dataclasses

import pytest

from crossdevice._comm.workers import fingerprint as fp

BASE = fp.Fingerprint(3, "all_reduce", "sum", 1, 1, 12, 5, 7, 11)

SENTENCES = {
    "structure": "the calls came from different lines of the program",
    "shapes": "a NumPy array on one worker, a torch tensor on another",
    "state": "the writes to parameters, buffers and optimizer state outside the step",
}


@pytest.mark.parametrize("field", sorted(SENTENCES))
def test_each_differing_field_says_what_it_means(field: str) -> None:
    other = dataclasses.replace(BASE, **{field: getattr(BASE, field) + 1})
    prints = [BASE, other]
    fields = fp.mismatched_fields(prints)
    assert fields == [field]
    message = fp.mismatch_message(prints, ["", ""], fields)
    assert f"(fields that differ: {field})" in message
    for name, sentence in SENTENCES.items():
        assert (sentence in message) == (name == field), (name, message)
