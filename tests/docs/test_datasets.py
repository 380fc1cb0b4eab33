"""`crossdevice.datasets`: the public face of the shipped digits data set."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

import crossdevice
import crossdevice.datasets
from crossdevice.datasets import (
    DIGITS_NUM_CLASSES,
    DIGITS_NUM_EXAMPLES,
    DIGITS_NUM_FEATURES,
    load_digits,
    train_test_split,
)


def test_load_digits_shapes_dtypes_and_ranges() -> None:
    images, labels = load_digits()
    assert images.shape == (DIGITS_NUM_EXAMPLES, DIGITS_NUM_FEATURES) == (1797, 64)
    assert labels.shape == (DIGITS_NUM_EXAMPLES,)
    assert images.dtype == labels.dtype == np.uint8
    assert images.min() >= 0
    assert images.max() == 16
    assert sorted(np.unique(labels)) == list(range(DIGITS_NUM_CLASSES))


def test_train_test_split_is_seeded_and_disjoint() -> None:
    images, labels = load_digits()
    first = train_test_split(images, labels, 0.25, seed=3)
    again = train_test_split(images, labels, 0.25, seed=3)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    x_train, y_train, x_test, y_test = first
    assert len(x_train) + len(x_test) == DIGITS_NUM_EXAMPLES
    assert len(x_test) == round(0.25 * DIGITS_NUM_EXAMPLES)
    assert len(y_train) == len(x_train)
    assert len(y_test) == len(x_test)
    with pytest.raises(ValueError, match="test_fraction"):
        train_test_split(images, labels, 1.5, seed=0)


def test_the_module_is_public_and_its_examples_run() -> None:
    assert "datasets" in crossdevice.__all__
    assert load_digits.__module__ == "crossdevice.datasets"
    result = doctest.testmod(crossdevice.datasets, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
