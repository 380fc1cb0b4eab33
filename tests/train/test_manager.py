"""`crossdevice.train.CheckpointManager`: TF's numbering, keeping, interval and restore."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._train import manager as manager_module
from tests.train.helpers import manager as _manager
from tests.train.helpers import names as _names

ROOT = Path(__file__).resolve().parents[2]


def test_keeps_the_newest_and_records_them(tmp_path: Path) -> None:
    value = cd.Variable(np.float32(0.0))
    manager = _manager(tmp_path, value)
    assert manager.latest_checkpoint is None
    for i in range(4):
        value.assign(float(i))
        manager.save()
    assert _names(manager.checkpoints) == ["ckpt-3", "ckpt-4"]
    assert Path(manager.latest_checkpoint).name == "ckpt-4"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "checkpoint", "ckpt-3", "ckpt-4"]
    manager.close()
    again = _manager(tmp_path)
    assert _names(again.checkpoints) == ["ckpt-3", "ckpt-4"]
    assert Path(again.restore_or_initialize()).name == "ckpt-4"
    assert float(again.checkpoint.value.numpy()) == 3.0
    assert int(again.checkpoint.save_counter.numpy()) == 4
    assert Path(again.save()).name == "ckpt-5"  # numbering goes on


def test_checkpoint_number_and_the_save_counter(tmp_path: Path) -> None:
    manager = _manager(tmp_path, max_to_keep=None)
    assert Path(manager.save(checkpoint_number=100)).name == "ckpt-100"
    assert int(manager.checkpoint.save_counter.numpy()) == 1  # incremented anyway (TF)
    assert Path(manager.save()).name == "ckpt-2"
    assert _names(manager.checkpoints) == ["ckpt-100", "ckpt-2"]


def test_checkpoint_interval_needs_a_step_counter_and_skips_early_saves(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step_counter should be passed"):
        _manager(tmp_path, checkpoint_interval=3)
    step = cd.Variable(np.int64(0))
    manager = _manager(tmp_path, step_counter=step, checkpoint_interval=3)
    assert manager.checkpoint_interval == 3
    saved = []
    for i in range(8):
        step.assign(i)
        saved.append(manager.save() is not None)
    assert saved == [True, False, False, True, False, False, True, False]
    assert manager.save() is None  # step 7: one step after the last save
    assert manager.save(check_interval=False) is not None  # skips the interval test only
    assert manager.save(check_interval=False) is None  # this step was saved already


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_to_keep": 0}, "max_to_keep must be a positive int or None, got 0"),
        ({"max_to_keep": 2.5}, "max_to_keep must be a positive int or None, got 2.5"),
        ({"keep_checkpoint_every_n_hours": -1}, "keep_checkpoint_every_n_hours must be"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _manager(tmp_path, **kwargs)


def test_restore_or_initialize_calls_init_fn_when_there_is_nothing(tmp_path: Path) -> None:
    calls = []
    manager = _manager(tmp_path, init_fn=lambda: calls.append(1))
    assert manager.restore_or_initialize() is None
    assert calls == [1]


def test_keep_checkpoint_every_n_hours_preserves_old_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1_000_000.0]
    monkeypatch.setattr(manager_module.time, "time", lambda: clock[0])
    manager = _manager(tmp_path, max_to_keep=1, keep_checkpoint_every_n_hours=1)
    for _ in range(4):
        clock[0] += 1800  # half an hour per save
        manager.save()
    assert _names(manager.checkpoints) == ["ckpt-4"]
    survivors = sorted(p.name for p in tmp_path.glob("ckpt-*"))
    assert survivors == ["ckpt-2", "ckpt-4"]  # one per hour kept, out of the list (TF)


def test_two_managers_on_one_directory_are_refused(tmp_path: Path) -> None:
    first = _manager(tmp_path)
    first.save()
    with pytest.raises(RuntimeError, match=r"in use by another CheckpointManager of this proc"):
        _manager(tmp_path)
    assert _names(first.checkpoints) == ["ckpt-1"]  # nothing touched
    first.close()
    second = _manager(tmp_path)
    with pytest.raises(FileExistsError, match=r"call restore_or_initialize\(\) first"):
        second.save()  # a fresh counter would overwrite ckpt-1
    second.restore_or_initialize()
    assert Path(second.save()).name == "ckpt-2"


def test_an_unwritable_directory_is_refused_at_construction(unwritable: Path) -> None:
    with pytest.raises(PermissionError, match=r"cannot write checkpoints to '.*': it is not"):
        _manager(unwritable / "run")


def test_incomplete_checkpoints_are_never_the_latest(tmp_path: Path) -> None:
    manager = _manager(tmp_path, max_to_keep=5)
    manager.save()
    manager.save()
    manager.close()
    (tmp_path / "ckpt-2" / "crossdevice.json").unlink()  # as if its write never finished
    (tmp_path / ".ckpt-3.tmp-abc123").mkdir()
    assert Path(cd.train.latest_checkpoint(tmp_path)).name == "ckpt-1"
    again = _manager(tmp_path, max_to_keep=5)
    assert Path(again.latest_checkpoint).name == "ckpt-1"
    assert not (tmp_path / ".ckpt-3.tmp-abc123").exists()  # an interrupted write, cleared


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_restorable(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "tests.train.crash_during_save", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "writing"  # bounded: the kill below
        finally:
            child.kill()  # SIGKILL in the middle of the write
            child.wait(30)
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers[:3] == [".ckpt-2.tmp-" + leftovers[0].rsplit("-", 1)[1], ".lock", "checkpoint"]
    assert "ckpt-2" not in leftovers
    value = cd.Variable(np.zeros(1000, np.float32))
    manager = _manager(tmp_path, value, max_to_keep=3)
    assert Path(manager.restore_or_initialize()).name == "ckpt-1"
    np.testing.assert_array_equal(value.numpy(), np.ones(1000, np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "checkpoint", "ckpt-1"]
    assert Path(manager.save()).name == "ckpt-2"


def test_latest_checkpoint_waits_for_the_write_in_flight(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    start = time.monotonic()
    path = manager.save()
    assert manager.latest_checkpoint == path
    assert (Path(path) / "crossdevice.json").is_file()
    assert time.monotonic() - start < 60
