"""Every NumPy dtype a checkpoint holds round trips bitwise, in `.npz` and in DCP alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from tests.train.helpers import Holder

#: NumPy arrays whose dtype torch cannot hold (torch.from_numpy refuses each).
_TORCHLESS = {
    "str": np.array(["the", "cat", ""]),
    "bytes": np.array([b"ab", b"\x00c"]),
    "datetime64": np.array(["2020-01-01T10:00", "NaT"], dtype="datetime64[m]"),
    "timedelta64": np.array([3, -1], dtype="timedelta64[ns]"),
    "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
    "longdouble": np.array([1.0, np.pi], dtype=np.longdouble) / 3,
    "record": np.array([(1, "x"), (-2, "yz")], dtype=[("n", "<i4"), ("s", "<U2")]),
    "scalar_str": np.str_("éclair"),
    "non_contiguous": np.array([["a", "bb"], ["ccc", "d"]]).T,
    "empty": np.zeros((0, 2), dtype="U3"),
}


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(_TORCHLESS))
def test_a_dtype_torch_lacks_round_trips_bitwise_next_to_torch_tensors(
    torch_module: Any, tmp_path: Path, name: str
) -> None:
    torch = torch_module
    value = _TORCHLESS[name]
    ckpt = cd.train.Checkpoint(held=Holder({"v": value, "anchor": torch.ones(2)}))
    path = Path(ckpt.save(tmp_path / "ckpt"))
    ckpt.sync()  # raised torch's "can't convert np.ndarray of type numpy.str_" here
    index = json.loads((path / "crossdevice.json").read_text())
    assert index["storage"] == "dcp"
    assert index["arrays"]["held.v"]["dtype"] == str(np.asarray(value).dtype)
    restored = Holder(None)
    cd.train.Checkpoint(held=restored).restore(path).assert_consumed()
    got = restored.state["v"]
    assert type(got) is type(value)
    assert got.dtype == value.dtype
    assert got.shape == value.shape
    assert np.asarray(got).tobytes() == np.ascontiguousarray(value).tobytes()
    assert torch.equal(restored.state["anchor"], torch.ones(2))


@pytest.mark.torch
def test_torch_reads_a_torchless_array_as_its_raw_bytes(torch_module: Any, tmp_path: Path) -> None:
    torch = torch_module
    import torch.distributed.checkpoint as dcp

    words = np.array(["the", "cat"])
    ckpt = cd.train.Checkpoint(held=Holder({"v": words, "anchor": torch.ones(1)}))
    path = ckpt.save(tmp_path / "ckpt")
    ckpt.sync()
    state = {"held.v": torch.empty(words.nbytes, dtype=torch.uint8)}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert state["held.v"].numpy().view(words.dtype).tolist() == ["the", "cat"]


@pytest.mark.parametrize("with_torch", [False, True], ids=["npz", "dcp"])
@pytest.mark.parametrize("manager", [False, True], ids=["checkpoint", "manager"])
def test_an_object_array_is_refused_at_save_and_changes_nothing(
    tmp_path: Path, request: pytest.FixtureRequest, with_torch: bool, manager: bool
) -> None:
    state: dict[str, Any] = {"v": np.array([1, "a"], dtype=object)}
    if with_torch:
        state["anchor"] = request.getfixturevalue("torch_module").ones(1)
    ckpt = cd.train.Checkpoint(held=Holder(state))
    directory = tmp_path / "run"
    mgr = cd.train.CheckpointManager(ckpt, directory, max_to_keep=2) if manager else None
    save = mgr.save if mgr is not None else lambda: ckpt.save(directory / "ckpt")
    with pytest.raises(TypeError, match=r"held\.v: a NumPy array of dtype object.*astype\(str\)"):
        save()
    ckpt.sync()
    assert int(ckpt.save_counter.numpy()) == 0
    # Nothing written: no checkpoint, no hidden write directory (a manager's lock only).
    assert not directory.exists() or {p.name for p in directory.iterdir()} <= {".lock"}
    if mgr is not None:
        assert mgr.latest_checkpoint is None
    # The same checkpoint saves as ckpt-1 once the state is fixed.
    state["v"] = state["v"].astype(str)
    saved = save()
    ckpt.sync()
    assert Path(saved).name == "ckpt-1"
