"""`crossdevice.train.Checkpoint` with NumPy state: what it saves, restores and refuses."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice._train import storage
from tests.train.helpers import Holder

Checkpoint = cd.train.Checkpoint


def _mirrored(n: int = 2) -> Any:
    return cd.MirroredStrategy([f"CPU:{i}" for i in range(n)])


def test_variables_of_every_kind_round_trip(tmp_path: Path) -> None:
    strategy = _mirrored(2)
    with strategy.scope():
        mirrored = cd.Variable(np.arange(3, dtype=np.float32))
        total = cd.Variable(np.float32(0), synchronization="on_read", aggregation="sum")
        mean = cd.Variable(np.float32(0), synchronization="on_read", aggregation="mean")
        count = cd.Variable(np.int64(0), synchronization="on_read", aggregation="sum")
    plain = cd.Variable(np.ones((2, 2), np.float64))

    def step() -> None:
        replica = cd.get_replica_context().replica_id_in_sync_group
        total.assign_add(np.float32(1.5 + replica))
        mean.assign(np.float32(2.0 * replica))
        count.assign_add(np.int64(3 + replica))  # 3 + 4 = 7: not a multiple of 2

    strategy.run(step)
    ckpt = Checkpoint(mirrored=mirrored, total=total, mean=mean, count=count, plain=plain)
    path = ckpt.save(tmp_path / "ckpt")
    ckpt.sync()
    saved = (total.numpy(), mean.numpy(), count.numpy())
    assert saved == (np.float32(4.0), np.float32(1.0), np.int64(7))
    for var in (mirrored, plain):
        var.assign(np.zeros(var.shape, var.dtype))
    strategy.run(step)
    ckpt.restore(path).assert_consumed()
    np.testing.assert_array_equal(mirrored.numpy(), [0.0, 1.0, 2.0])
    for component in mirrored.values:
        np.testing.assert_array_equal(component.numpy(), [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(plain.numpy(), np.ones((2, 2)))
    assert (total.numpy(), mean.numpy(), count.numpy()) == saved
    # The SUM total is split so that the replicas add up to it (TF divides; integers
    # keep their remainder instead of losing it).
    assert [int(c.numpy()) for c in count.values] == [4, 3]
    assert [float(c.numpy()) for c in total.values] == [2.0, 2.0]


def test_a_sum_variable_restores_its_total_on_another_replica_count(tmp_path: Path) -> None:
    with _mirrored(4).scope():
        count = cd.Variable(np.int64(0), synchronization="on_read", aggregation="sum")
    for component, value in zip(count.values, [1, 2, 3, 5], strict=True):
        component.assign(np.int64(value))
    path = Checkpoint(count=count).write(tmp_path / "four")  # restore waits for the write
    with _mirrored(3).scope():
        fewer = cd.Variable(np.int64(0), synchronization="on_read", aggregation="sum")
    ckpt = Checkpoint(count=fewer)
    ckpt.read(path).assert_consumed()
    assert int(fewer.numpy()) == 11
    assert [int(c.numpy()) for c in fewer.values] == [4, 4, 3]


def test_save_numbers_and_records_checkpoints(tmp_path: Path) -> None:
    step = cd.Variable(np.int64(0))
    ckpt = Checkpoint(step=step)
    first = ckpt.save(str(tmp_path / "ckpt"))
    step.assign(5)
    second = ckpt.save(tmp_path / "ckpt")
    ckpt.sync()
    assert (Path(first).name, Path(second).name) == ("ckpt-1", "ckpt-2")
    assert int(ckpt.save_counter.numpy()) == 2
    assert cd.train.latest_checkpoint(tmp_path) == second
    text = (tmp_path / "checkpoint").read_text()
    assert 'model_checkpoint_path: "ckpt-2"' in text
    assert text.count("all_model_checkpoint_paths") == 2
    # NumPy-only state: the standard .npz fallback with a JSON index, no torch.
    assert sorted(p.name for p in Path(second).iterdir()) == ["arrays.npz", "crossdevice.json"]
    with np.load(Path(second) / "arrays.npz") as data:
        assert int(data["step"]) == 5
    index = json.loads((Path(second) / "crossdevice.json").read_text())
    assert index["storage"] == "npz"
    assert index["save_counter"] == 2
    fresh = Checkpoint(step=cd.Variable(np.int64(-1)))
    fresh.restore(first).assert_consumed()
    assert int(fresh.step.numpy()) == 0
    assert int(fresh.save_counter.numpy()) == 1


def test_write_and_read_use_the_exact_path_and_no_counter(tmp_path: Path) -> None:
    v = cd.Variable(np.float32(3.0))
    ckpt = Checkpoint(v=v)
    path = ckpt.write(tmp_path / "weights")
    ckpt.sync()
    assert path == str(tmp_path / "weights")
    assert int(ckpt.save_counter.numpy()) == 0
    assert not (tmp_path / "checkpoint").exists()
    v.assign(0.0)
    ckpt.read(path).assert_consumed()
    assert float(v.numpy()) == 3.0


def test_statuses_follow_tf(tmp_path: Path) -> None:
    a, b = cd.Variable(np.float32(1.0)), cd.Variable(np.float32(2.0))
    path = Checkpoint(a=a, b=b).write(tmp_path / "ab")
    only_a = Checkpoint(a=cd.Variable(np.float32(0.0)))
    status = only_a.read(path)
    status.assert_existing_objects_matched().assert_nontrivial_match().expect_partial()
    with pytest.raises(AssertionError, match=r"holds values nothing took: \['b'\]"):
        status.assert_consumed()
    # Restore-on-create: assigning the missing object later restores it then.
    late = cd.Variable(np.float32(0.0))
    only_a.b = late
    assert float(late.numpy()) == 2.0
    status.assert_consumed()
    extra = Checkpoint(a=cd.Variable(np.float32(0.0)), c=cd.Variable(np.float32(0.0)))
    with pytest.raises(AssertionError, match=r"has no value for \['c'\]"):
        extra.read(path).assert_existing_objects_matched()
    unrelated = Checkpoint(z=cd.Variable(np.float32(0.0)))
    with pytest.raises(AssertionError, match="nothing of the checkpoint"):
        unrelated.read(path).assert_nontrivial_match()
    nothing = Checkpoint(a=a).restore(None)
    with pytest.raises(AssertionError, match=r"save_path=None"):
        nothing.assert_consumed()
    with pytest.raises(AssertionError, match=r"save_path=None"):
        nothing.assert_existing_objects_matched()
    assert nothing.expect_partial() is nothing


def test_state_of_every_structure_round_trips(tmp_path: Path) -> None:
    state = {
        "ints": {0: np.arange(3), 7: [1, 2.5, None, True]},
        "tuple": (np.float32(1.5), "text", b"\x00\xff", float("inf"), float("nan")),
        "$tag": {"nested": [np.zeros((2, 0)), {"a": -3}]},
        "big": 2**100,
    }
    thing = Holder(state)
    generator = np.random.default_rng(5)  # PCG64
    legacy = np.random.RandomState(6)
    ckpt = Checkpoint(thing=thing, generator=generator, legacy=legacy, both=[cd.Variable(1.0)])
    path = ckpt.write(tmp_path / "t")
    ckpt.sync()
    expected = (generator.random(), legacy.rand())
    thing.state = None
    ckpt.read(path).assert_consumed()
    assert (generator.random(), legacy.rand()) == expected
    got = thing.state
    assert got["ints"][0].tolist() == [0, 1, 2]
    assert got["ints"][7] == [1, 2.5, None, True]
    one, text, raw, inf, nan = got["tuple"]
    assert type(one) is np.float32
    assert one == 1.5
    assert (text, raw, inf) == ("text", b"\x00\xff", float("inf"))
    assert np.isnan(nan)
    assert got["$tag"]["nested"][0].shape == (2, 0)
    assert got["$tag"]["nested"][1] == {"a": -3}
    assert got["big"] == 2**100
    other = np.random.Generator(np.random.MT19937(1))
    with pytest.raises(ValueError, match=r"'PCG64' bit generator, and the tracked Generator uses"):
        Checkpoint(generator=other).read(path)


def test_global_random_state_is_saved_and_restored(tmp_path: Path) -> None:
    ckpt = Checkpoint(v=cd.Variable(0.0))
    np.random.seed(1)
    random.seed(2)
    path = ckpt.write(tmp_path / "r")
    ckpt.sync()
    expected = (np.random.rand(), random.random(), np.random.randn())
    np.random.seed(99)
    random.seed(99)
    ckpt.read(path)
    assert (np.random.rand(), random.random(), np.random.randn()) == expected


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: cd.Variable(np.zeros(4, np.float32)), r"'v': the checkpoint holds shape \(3,\)"),
        (lambda: cd.Variable(np.zeros(3, np.float64)), r"dtype float32.*dtype float64"),
    ],
)
def test_restoring_into_another_shape_or_dtype_changes_nothing(
    tmp_path: Path, make: Any, message: str
) -> None:
    path = Checkpoint(v=cd.Variable(np.ones(3, np.float32)), w=cd.Variable(2.0)).write(
        tmp_path / "c"
    )
    w = cd.Variable(7.0)
    target = make()
    before = target.numpy().copy()
    with pytest.raises(ValueError, match=message):
        Checkpoint(w=w, v=target).read(path)
    np.testing.assert_array_equal(target.numpy(), before)
    assert float(w.numpy()) == 7.0  # validated before anything was loaded


def test_a_missing_checkpoint_names_the_path_and_what_is_there(tmp_path: Path) -> None:
    ckpt = Checkpoint(v=cd.Variable(1.0))
    ckpt.save(tmp_path / "ckpt")
    ckpt.sync()
    with pytest.raises(
        FileNotFoundError, match=r"no checkpoint at .*/ckpt'.*prefix-N.*\['ckpt-1'\]"
    ):
        ckpt.restore(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="does not exist either"):
        ckpt.restore(tmp_path / "nowhere" / "ckpt-1")


def test_truncated_or_incomplete_checkpoints_are_refused(tmp_path: Path) -> None:
    ckpt = Checkpoint(v=cd.Variable(np.arange(1000, dtype=np.float64)))
    path = Path(ckpt.write(tmp_path / "c"))
    ckpt.sync()
    data = path / "arrays.npz"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"truncated or damaged: 'arrays.npz' has \d+ bytes"):
        ckpt.read(path)
    (path / "crossdevice.json").unlink()
    with pytest.raises(ValueError, match="not a complete crossdevice checkpoint"):
        ckpt.read(path)


def test_an_unwritable_directory_fails_the_save_call(unwritable: Path) -> None:
    before = sorted(unwritable.parent.iterdir()) if unwritable.parent.is_dir() else None
    ckpt = Checkpoint(v=cd.Variable(1.0))
    with pytest.raises(
        PermissionError, match=r"cannot write checkpoints to '.*': it is not writable"
    ):
        ckpt.save(unwritable / "ckpt")
    assert not unwritable.exists() or list(unwritable.iterdir()) == []
    assert (sorted(unwritable.parent.iterdir()) if before is not None else None) == before


def test_a_checkpoint_is_never_overwritten(tmp_path: Path) -> None:
    v = cd.Variable(1.0)
    ckpt = Checkpoint(v=v)
    path = ckpt.write(tmp_path / "c")
    ckpt.sync()
    v.assign(2.0)
    with pytest.raises(FileExistsError, match="never overwritten"):
        ckpt.write(tmp_path / "c")
    ckpt.read(path)
    assert float(v.numpy()) == 1.0


def test_untrackable_objects_and_reserved_names_are_refused() -> None:
    with pytest.raises(
        TypeError, match=r"cannot track x=array.*Keep plain arrays in a crossdevice"
    ):
        Checkpoint(x=np.zeros(3))
    with pytest.raises(AttributeError, match="'save_counter' cannot name a tracked object"):
        Checkpoint(save_counter=cd.Variable(1.0))
    ckpt = Checkpoint()
    with pytest.raises(TypeError, match=r"cannot track items.1=3"):
        ckpt.items = [cd.Variable(1.0), 3]


def test_save_is_refused_inside_strategy_run(tmp_path: Path) -> None:
    strategy = _mirrored(2)
    ckpt = Checkpoint(v=cd.Variable(1.0))
    with pytest.raises(RuntimeError, match=r"outside strategy\.run"):
        strategy.run(lambda: ckpt.save(tmp_path / "c"))


def test_the_write_runs_off_the_calling_thread_and_saves_wait_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    writers: list[str] = []
    niceness: list[int] = []
    real_write = storage.write

    def slow_write(*args: Any) -> None:
        writers.append(threading.current_thread().name)
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert release.wait(30)
        real_write(*args)

    monkeypatch.setattr(storage, "write", slow_write)
    v = cd.Variable(np.float32(1.0))
    ckpt = Checkpoint(v=v)
    first = ckpt.save(tmp_path / "ckpt")
    assert not Path(first).exists()  # staged and returned; the write is still running
    v.assign(5.0)  # the staged copy is what gets written
    second: list[str] = []
    saver = threading.Thread(target=lambda: second.append(ckpt.save(tmp_path / "ckpt")))
    saver.start()
    saver.join(0.3)
    assert saver.is_alive()  # a second save waits for the first
    release.set()
    saver.join(30)
    ckpt.sync()
    assert writers == ["crossdevice-checkpoint-writer"] * 2
    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert niceness == [min(19, ours + 10)] * 2  # background work yields to training
    restored = Checkpoint(v=cd.Variable(np.float32(0)))
    restored.restore(first)
    assert float(restored.v.numpy()) == 1.0
    restored.restore(second[0])
    assert float(restored.v.numpy()) == 5.0


def test_a_failed_write_is_raised_at_the_next_call_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpoint(v=cd.Variable(1.0))
    good = ckpt.save(tmp_path / "ckpt")
    ckpt.sync()

    def full_disk(tmp: Path, *args: Any, **kwargs: Any) -> None:
        (tmp / "arrays.npz").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "_write_npz", full_disk)
    ckpt.save(tmp_path / "ckpt")
    with pytest.raises(OSError, match="No space left"):
        ckpt.sync()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "ckpt-1"]
    assert cd.train.latest_checkpoint(tmp_path) == good
    ckpt.sync()  # the error was reported once


def test_a_numpy_program_checkpoints_without_importing_torch(tmp_path: Path) -> None:
    code = f"""
import sys, numpy as np, crossdevice as cd
strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
with strategy.scope():
    w = cd.Variable(np.arange(3, dtype=np.float32))
data = strategy.experimental_distribute_dataset([np.arange(4)] * 3)
it = iter(data)
next(it)
manager = cd.train.CheckpointManager(cd.train.Checkpoint(w=w, data=data), {str(tmp_path)!r}, 2)
manager.save()
w.assign(np.zeros(3, np.float32))
manager.checkpoint.restore(manager.latest_checkpoint).assert_consumed()
print(w.numpy().tolist(), data.state_dict()["steps"], "torch" in sys.modules)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[0.0,", "1.0,", "2.0]", "1", "False"]


def test_a_sync_on_read_variable_restores_its_aggregate_not_its_parts(tmp_path: Path) -> None:
    # What docs/guides/checkpoints.md promises: the aggregate reads back exactly and the
    # replicas take equal parts of it (TF's values_util), so integer sums go on exactly.
    with _mirrored(4).scope():
        total = cd.Variable(np.float64(0), synchronization="on_read", aggregation="sum")
        count = cd.Variable(np.int64(0), synchronization="on_read", aggregation="sum")
    for i, (t, c) in enumerate(zip(total.values, count.values, strict=True)):
        t.assign(np.float64(np.sin(i) * 1e3))
        c.assign(np.int64(3 * i + 1))
    saved_total = total.numpy()
    path = Checkpoint(total=total, count=count).write(tmp_path / "c")
    with _mirrored(4).scope():
        total2 = cd.Variable(np.float64(0), synchronization="on_read", aggregation="sum")
        count2 = cd.Variable(np.int64(0), synchronization="on_read", aggregation="sum")
    Checkpoint(total=total2, count=count2).read(path).assert_consumed()
    assert total2.numpy() == saved_total
    assert [float(t.numpy()) for t in total2.values] == [float(saved_total) / 4] * 4
    for c, c2 in zip(count.values, count2.values, strict=True):
        c.assign_add(np.int64(7))
        c2.assign_add(np.int64(7))
    assert int(count2.numpy()) == int(count.numpy())
