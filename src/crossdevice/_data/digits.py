"""The UCI handwritten digits (1,797 images of 8x8 pixels, 10 classes), shipped in the package.

Source: E. Alpaydin and C. Kaynak, "Optical Recognition of Handwritten Digits", UCI
Machine Learning Repository (CC BY 4.0), as copied in scikit-learn's
`sklearn/datasets/data/digits.csv.gz`; see `README.md` next to this file. Nothing is
downloaded at run time.
"""

from __future__ import annotations

import importlib.resources
from typing import Final

import numpy as np

__all__ = ["NUM_CLASSES", "NUM_EXAMPLES", "NUM_FEATURES", "load_digits", "train_test_split"]

NUM_EXAMPLES: Final = 1797
NUM_FEATURES: Final = 64
NUM_CLASSES: Final = 10
_FILE: Final = "digits.npz"


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The images and labels of the digits data set.

    Returns:
        `(images, labels)`: `uint8[1797, 64]` pixel counts in 0..16 (row-major 8x8
        images) and `uint8[1797]` digits in 0..9.

    Raises:
        FileNotFoundError: the package was installed without its data file; reinstall it.

    Example:
        >>> images, labels = load_digits()
        >>> images.shape, labels.shape
        ((1797, 64), (1797,))
    """
    resource = importlib.resources.files("crossdevice._data").joinpath(_FILE)
    try:
        with resource.open("rb") as f, np.load(f, allow_pickle=False) as archive:
            images = np.asarray(archive["images"])
            labels = np.asarray(archive["labels"])
    except FileNotFoundError:
        raise FileNotFoundError(
            f"crossdevice's data file {_FILE!r} is missing from {resource!s}; the package was "
            "installed without its data: reinstall it (pip install --force-reinstall crossdevice)"
        ) from None
    if images.shape != (NUM_EXAMPLES, NUM_FEATURES) or labels.shape != (NUM_EXAMPLES,):
        raise ValueError(
            f"{_FILE!r} is damaged: expected images of shape {(NUM_EXAMPLES, NUM_FEATURES)} and "
            f"labels of shape {(NUM_EXAMPLES,)}, got {images.shape} and {labels.shape}; "
            "reinstall crossdevice"
        )
    return images, labels


def train_test_split(
    images: np.ndarray, labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A seeded random split into training and held-out examples.

    Args:
        images: `[n, features]` inputs.
        labels: `[n]` class ids.
        test_fraction: the share of examples held out, in (0, 1).
        seed: the seed of the shuffle.

    Returns:
        `(train_images, train_labels, test_images, test_labels)`.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    if len(images) != len(labels):
        raise ValueError(
            f"images and labels must have one row per example, got {len(images)} images and "
            f"{len(labels)} labels"
        )
    order = np.random.default_rng(seed).permutation(len(images))
    num_test = max(1, round(len(images) * test_fraction))
    test, train = order[:num_test], order[num_test:]
    return images[train], labels[train], images[test], labels[test]
