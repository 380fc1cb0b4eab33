"""What the `crossdevice bench` modules share: sizes, data types, reduce ops, measurements.

Kept apart from the entry module (`main.py`) so that the CUDA and multi-worker parts
import it without importing the entry module back (no import cycle).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Final

from crossdevice._core.reduce_op import ReduceOp

__all__ = [
    "DTYPES",
    "RAW_IN_PLACE",
    "RAW_OUT_OF_PLACE",
    "REDOPS",
    "TORCH_DIST",
    "Measurement",
    "parse_size",
    "sizes_between",
]

#: nccl-tests' data type names (and NumPy's) -> NumPy dtype name; bfloat16 needs torch.
DTYPES: Final = {
    "int8": "int8",
    "char": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int": "int32",
    "uint32": "uint32",
    "int64": "int64",
    "uint64": "uint64",
    "half": "float16",
    "float16": "float16",
    "float": "float32",
    "float32": "float32",
    "double": "float64",
    "float64": "float64",
    "bfloat16": "bfloat16",
}

#: nccl-tests' reduce op names -> ReduceOp (prod, min and max are not tf.distribute ops).
REDOPS: Final = {"sum": ReduceOp.SUM, "avg": ReduceOp.MEAN, "mean": ReduceOp.MEAN}

_SIZE_RE: Final = re.compile(r"^\s*(\d+)\s*([KMG]?)i?B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A byte count with an optional K, M or G suffix (powers of 1024, as nccl-tests).

    Example:
        >>> parse_size("64M")
        67108864
    """
    match = _SIZE_RE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"expected a byte count such as 8, 1K, 64M or 1G, received {text!r}"
        )
    scale = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[match.group(2).upper()]
    return int(match.group(1)) * scale


def sizes_between(min_bytes: int, max_bytes: int, factor: int, step: int) -> list[int]:
    """The sizes nccl-tests visits: times `factor` from `min_bytes`, or plus `step`."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(
            f"expected 1 <= minbytes <= maxbytes, received -b {min_bytes} -e {max_bytes}"
        )
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size = size * factor if factor > 1 else size + step
    return sizes


#: The baseline of the ratio column.
RAW_IN_PLACE: Final = "torch.cuda.nccl.all_reduce (in place)"
RAW_OUT_OF_PLACE: Final = "torch.cuda.nccl.all_reduce (out of place)"
TORCH_DIST: Final = "torch.distributed nccl (world 1)"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One timed implementation at one size and op.

    Attributes:
        impl: the implementation's name.
        op: `"sum"` or `"mean"`.
        nbytes: bytes per GPU.
        seconds: the median time of one call, or None when it could not run.
        note: why it could not run (or a remark).
    """

    impl: str
    op: str
    nbytes: int
    seconds: float | None
    note: str = ""
