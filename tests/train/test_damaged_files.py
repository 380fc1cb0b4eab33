"""A checkpoint whose bytes changed is refused with the library's error, never restored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crossdevice as cd


def _flip(file: Path, offset: int) -> None:
    """Change one byte of `file` in place (its size stays)."""
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x40
    file.write_bytes(bytes(data))


def _written(ckpt: Any, tmp_path: Path) -> Path:
    path = Path(ckpt.write(tmp_path / "c"))
    ckpt.sync()
    return path


def test_a_changed_byte_in_numpy_arrays_is_refused(tmp_path: Path) -> None:
    v = cd.Variable(np.arange(1000, dtype=np.float64))
    ckpt = cd.train.Checkpoint(v=v)
    path = _written(ckpt, tmp_path)
    data = path / "arrays.npz"
    _flip(data, data.stat().st_size // 2)  # inside the values: np.load reads it happily
    v.assign(np.zeros(1000))
    with pytest.raises(ValueError, match=r"damaged: 'arrays.npz' has CRC-32 [0-9a-f]{8}"):
        ckpt.read(path)
    assert not v.numpy().any()  # nothing restored


def test_a_changed_byte_in_torch_tensors_is_refused(torch_module: Any, tmp_path: Path) -> None:
    torch = torch_module
    model = torch.nn.Linear(64, 64).double()
    ckpt = cd.train.Checkpoint(model=model)
    path = _written(ckpt, tmp_path)
    data = path / "__0_0.distcp"
    _flip(data, data.stat().st_size // 2)
    with pytest.raises(ValueError, match=r"damaged: '__0_0.distcp' has CRC-32"):
        ckpt.read(path)


def test_a_damaged_file_without_a_recorded_crc_is_still_the_librarys_error(
    torch_module: Any, tmp_path: Path
) -> None:
    # A checkpoint written before CRCs were recorded: torch's reader fails on the damage
    # with a CheckpointException, a BaseException that `except Exception` would miss.
    torch = torch_module
    ckpt = cd.train.Checkpoint(model=torch.nn.Linear(64, 64))
    path = _written(ckpt, tmp_path)
    index_file = path / "crossdevice.json"
    index = json.loads(index_file.read_bytes())
    del index["crc32"]
    index_file.write_text(json.dumps(index))
    data = path / "__0_0.distcp"
    for offset in range(8):  # the archive's header
        _flip(data, offset)
    # (A CheckpointException escapes pytest.raises(ValueError) and fails the test.)
    with pytest.raises(ValueError, match=r"(?s)is damaged .*Restore an earlier checkpoint"):
        ckpt.read(path)
