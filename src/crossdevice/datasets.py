"""Small data sets shipped inside the package, for examples, demos and tests.

Nothing is downloaded: the files are installed with crossdevice.

`load_digits()` gives the UCI handwritten digits (E. Alpaydin and C. Kaynak, "Optical
Recognition of Handwritten Digits", UCI Machine Learning Repository, CC BY 4.0; the copy
scikit-learn ships): 1,797 images of 8x8 pixels, 10 classes. `train_test_split` makes the
seeded split the demo uses.

Example:
    >>> from crossdevice.datasets import load_digits, train_test_split
    >>> images, labels = load_digits()
    >>> images.shape, images.dtype, labels.shape, int(labels.max())
    ((1797, 64), dtype('uint8'), (1797,), 9)
    >>> x_train, y_train, x_test, y_test = train_test_split(images, labels, 0.2, seed=0)
    >>> len(x_train), len(x_test)
    (1438, 359)
"""

from __future__ import annotations

from typing import Final

from crossdevice._data import digits as _digits
from crossdevice._data.digits import load_digits as load_digits
from crossdevice._data.digits import train_test_split as train_test_split

__all__ = [
    "DIGITS_NUM_CLASSES",
    "DIGITS_NUM_EXAMPLES",
    "DIGITS_NUM_FEATURES",
    "load_digits",
    "train_test_split",
]

DIGITS_NUM_EXAMPLES: Final[int] = _digits.NUM_EXAMPLES
"""Examples in the digits data set (rows of `load_digits()`'s arrays): 1797."""
DIGITS_NUM_FEATURES: Final[int] = _digits.NUM_FEATURES
"""Features per digits example: 8x8 pixels, row-major, each a count in 0..16: 64."""
DIGITS_NUM_CLASSES: Final[int] = _digits.NUM_CLASSES
"""Classes of the digits data set, the digits 0..9: 10."""

for _function in (load_digits, train_test_split):
    _function.__module__ = __name__
del _function
