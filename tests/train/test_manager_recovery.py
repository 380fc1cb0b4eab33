"""A checkpoint directory as a crash, a user or another manager left it: never a dead end.

A crash between a checkpoint's rename (its commit) and the `checkpoint` file's update, a
lost `checkpoint` file, a listed checkpoint without its index, a second manager on the
directory in this process, a save or restore inside `strategy.run`, and retention
deleting a checkpoint another process reads: each is repaired with a log line or is an
error that says what to do, and saving can always go on.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._train import storage
from crossdevice.experimental import PreemptionCheckpointHandler, TerminationConfig
from tests.multi_worker.harness import run_workers
from tests.train import helpers
from tests.train.helpers import names as _names
from tests.train.manager_workers import save_four_keep_two

ROOT = Path(__file__).resolve().parents[2]


_manager = functools.partial(helpers.manager, max_to_keep=3)


def _save_values(directory: Path, count: int) -> None:
    value = cd.Variable(np.float32(0.0))
    manager = _manager(directory, value, max_to_keep=5)
    for i in range(1, count + 1):
        value.assign(float(i))
        manager.save()
    manager.close()


def test_a_crash_after_the_rename_before_the_record_resumes_from_that_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    child = subprocess.run(
        [sys.executable, "-m", "tests.train.crash_after_rename", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == -9, child.stdout + child.stderr
    on_disk = sorted(p.name for p in tmp_path.iterdir())
    stale = ".checkpoint.tmp-" + on_disk[0].rsplit("-", 1)[1]
    assert on_disk == [stale, ".lock", "checkpoint", "ckpt-1", "ckpt-2"]
    assert Path(cd.train.latest_checkpoint(tmp_path)).name == "ckpt-1"  # not recorded
    value = cd.Variable(np.zeros(10, np.float32))
    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        manager = _manager(tmp_path, value)
    assert _names(manager.checkpoints) == ["ckpt-1", "ckpt-2"]
    assert Path(manager.restore_or_initialize()).name == "ckpt-2"
    np.testing.assert_array_equal(value.numpy(), np.full(10, 2.0, np.float32))
    assert Path(manager.save()).name == "ckpt-3"  # saving goes on
    assert f"found checkpoints ['ckpt-2'] in {tmp_path} that" in caplog.text
    assert "were not recorded (a crash after the write" in caplog.text
    manager.sync()
    assert Path(cd.train.latest_checkpoint(tmp_path)).name == "ckpt-3"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock",
        "checkpoint",
        "ckpt-1",
        "ckpt-2",
        "ckpt-3",
    ]  # the state file's temp file, cleared


def test_older_unlisted_checkpoints_are_left_alone(tmp_path: Path) -> None:
    # keep_checkpoint_every_n_hours keeps some out of the list on purpose: listing them
    # again would let max_to_keep delete them.
    _save_values(tmp_path, 3)
    (tmp_path / "checkpoint").write_text(
        'model_checkpoint_path: "ckpt-3"\nall_model_checkpoint_paths: "ckpt-3"\n'
    )
    manager = _manager(tmp_path, max_to_keep=1)
    assert _names(manager.checkpoints) == ["ckpt-3"]
    manager.restore_or_initialize()
    manager.save()
    manager.sync()
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-1", "ckpt-2", "ckpt-4"]


def test_a_missing_state_file_lists_the_checkpoints_on_disk_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save_values(tmp_path, 4)
    (tmp_path / "checkpoint").unlink()
    value = cd.Variable(np.float32(0.0))
    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        manager = _manager(tmp_path, value, max_to_keep=2)
    assert _names(manager.checkpoints) == ["ckpt-3", "ckpt-4"]  # the newest max_to_keep
    assert Path(manager.restore_or_initialize()).name == "ckpt-4"
    assert float(value.numpy()) == 4.0
    assert Path(manager.save()).name == "ckpt-5"
    assert f"{tmp_path / 'checkpoint'} does not list: it is missing" in caplog.text
    manager.sync()
    assert _names(manager.checkpoints) == ["ckpt-4", "ckpt-5"]
    assert Path(cd.train.latest_checkpoint(tmp_path)).name == "ckpt-5"


def test_a_listed_checkpoint_without_its_index_is_skipped_and_moved_aside_at_its_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save_values(tmp_path, 2)
    (tmp_path / "ckpt-2" / storage.INDEX_FILE).unlink()
    value = cd.Variable(np.float32(0.0))
    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        manager = _manager(tmp_path, value)
    assert Path(manager.restore_or_initialize()).name == "ckpt-1"
    assert float(value.numpy()) == 1.0
    with caplog.at_level(logging.WARNING, logger="crossdevice"):
        assert Path(manager.save()).name == "ckpt-2"
    manager.sync()
    assert f"{tmp_path / 'ckpt-2'} is listed in {tmp_path / 'checkpoint'}" in caplog.text
    assert "crossdevice.json is missing or unreadable" in caplog.text
    assert "moved aside to" in caplog.text
    aside = [p.name for p in tmp_path.glob("ckpt-2.incomplete-*")]
    assert len(aside) == 1, sorted(p.name for p in tmp_path.iterdir())
    assert _names(manager.checkpoints) == ["ckpt-1", "ckpt-2"]
    assert manager.save() is not None  # and on


def test_a_complete_checkpoint_is_still_never_overwritten(tmp_path: Path) -> None:
    _save_values(tmp_path, 1)
    manager = _manager(tmp_path)
    with pytest.raises(FileExistsError, match=r"the latest is '.*ckpt-1'\): call restore_or_init"):
        manager.save()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_worker_lists_the_chiefs_checkpoints(tmp_path: Path) -> None:
    results = [r.unwrap() for r in run_workers(save_four_keep_two, 2, args=(str(tmp_path),))]
    assert [seen["checkpoints"] for seen in results] == [["ckpt-3", "ckpt-4"]] * 2
    for seen in results:
        assert Path(seen["latest"]).name == "ckpt-4"
        assert seen["restarted"] == ["ckpt-3", "ckpt-4"]
        assert seen["restored"] == "ckpt-4"
        assert seen["after_save"] == ["ckpt-4", "ckpt-5"]
        assert "CheckpointManager.save() was called inside strategy.run" in seen["inside_run"]
        assert seen["after_inside_run"] == (5, [4.0, 4.0])  # nothing changed


def test_save_and_restore_inside_strategy_run_fail_before_touching_anything(
    tmp_path: Path,
) -> None:
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        w = cd.Variable(np.zeros(2))
    ckpt = cd.train.Checkpoint(w=w)
    manager = cd.train.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    path = manager.save()
    manager.sync()
    w.assign(np.full(2, 7.0))
    calls = {
        "CheckpointManager.save()": manager.save,
        "restore_or_initialize()": manager.restore_or_initialize,
        "restore()": lambda: ckpt.restore(path),
        "read()": lambda: ckpt.read(path),
        "save()": lambda: ckpt.save(tmp_path / "other"),
        "write()": lambda: ckpt.write(tmp_path / "written"),
    }
    for call, fn in calls.items():
        with pytest.raises(RuntimeError, match=re.escape(f"{call} was called inside strategy.run")):
            strategy.run(fn)
        assert w.numpy().tolist() == [7.0, 7.0], call  # not restored
        assert int(ckpt.save_counter.numpy()) == 1, call  # not counted
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "checkpoint", "ckpt-1"]


def test_a_handler_given_the_checkpoint_saves_with_the_open_manager(tmp_path: Path) -> None:
    # TF's pattern: periodic saves with a manager, a handler built from the checkpoint.
    ckpt = cd.train.Checkpoint(v=cd.Variable(np.zeros(2)))
    manager = cd.train.CheckpointManager(ckpt, tmp_path, max_to_keep=3)
    manager.save()
    exits: list[int] = []
    config = TerminationConfig(
        termination_watcher_fn=lambda: False, exit_fn=lambda: exits.append(1)
    )
    handler = PreemptionCheckpointHandler(
        None, ckpt, checkpoint_dir=tmp_path, termination_config=config
    )
    assert handler._manager is manager
    handler._save()
    manager.save()
    assert _names(manager.checkpoints) == ["ckpt-1", "ckpt-2", "ckpt-3"]


def test_a_second_open_manager_of_this_process_is_named_and_a_closed_one_is_not(
    tmp_path: Path,
) -> None:
    first = _manager(tmp_path)
    with pytest.raises(
        RuntimeError, match=rf"another CheckpointManager of this process \(pid {os.getpid()}:"
    ) as raised:
        _manager(tmp_path)
    assert "call close() on it first" in str(raised.value)
    first.close()
    second = _manager(tmp_path)
    # Garbage that a reference cycle still holds (a notebook cell run again after `del`).
    second.cycle = second
    del second
    third = _manager(tmp_path)
    third.close()


def test_another_process_holding_the_directory_is_named(tmp_path: Path) -> None:
    fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"pid 4242 on elsewhere")
        with pytest.raises(RuntimeError, match=r"another CheckpointManager \(pid 4242 on else"):
            _manager(tmp_path)
    finally:
        os.close(fd)


def test_a_checkpoint_deleted_while_it_is_read_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save_values(tmp_path, 2)
    read_arrays = storage.read_arrays

    def deleted_by_retention(path: Path, *args: Any) -> Any:
        os.rename(path, path.parent / f".{path.name}.tmp-1")  # what retention does first
        return read_arrays(path, *args)

    monkeypatch.setattr(storage, "read_arrays", deleted_by_retention)
    ckpt = cd.train.Checkpoint(value=cd.Variable(np.float32(0.0)))
    with pytest.raises(FileNotFoundError, match=r"ckpt-2' was deleted while it was being read"):
        ckpt.restore(tmp_path / "ckpt-2")
