"""`PreemptionCheckpointHandler` in one process (MirroredStrategy, OneDeviceStrategy).

The handler installs a SIGTERM handler; these tests send SIGTERM to the test process
itself, and the fixture puts pytest's handler back afterwards.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import crossdevice as cd
from crossdevice.experimental import (
    RESTART_EXIT_CODE,
    PreemptionCheckpointHandler,
    TerminationConfig,
)


@pytest.fixture(autouse=True)
def _keep_sigterm() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


class Job:
    """A small NumPy job: one mirrored weight vector nudged by each step's data."""

    def __init__(self, strategy: Any, directory: Path, **config: Any) -> None:
        self.strategy = strategy
        with strategy.scope():
            self.w = cd.Variable(np.zeros(4, np.float32))
        data = [np.full((2, 4), i, np.float32) for i in range(6)]
        self.dist = strategy.experimental_distribute_dataset(data)
        ckpt = cd.train.Checkpoint(w=self.w, data=self.dist)
        self.manager = cd.train.CheckpointManager(ckpt, directory, max_to_keep=3)
        self.handler = PreemptionCheckpointHandler(
            None, self.manager, termination_config=TerminationConfig(**config) if config else None
        )

    def step(self, x: Any) -> None:
        def replica(x: Any) -> None:
            ctx = cd.get_replica_context()
            total = ctx.all_reduce("sum", x.sum(axis=0) * 0.01)
            self.w.assign_add(total * np.float32(np.random.rand()))

        self.strategy.run(replica, args=(x,))

    def train(self, on_step: Callable[[int], None] = lambda step: None) -> np.ndarray:
        for _ in range(self.dist.epoch, 2):
            for x in self.dist:
                self.handler.run(self.step, x)
                on_step(self.handler.total_run_calls)
        return self.w.numpy()


def _strategies() -> list[Any]:
    return [
        pytest.param(lambda: cd.MirroredStrategy(["CPU:0", "CPU:1"]), id="mirrored"),
        pytest.param(lambda: cd.OneDeviceStrategy("CPU:0"), id="one_device"),
    ]


@pytest.mark.parametrize("make", _strategies())
def test_sigterm_saves_the_step_and_exits_and_the_next_job_resumes(
    tmp_path: Path, make: Callable[[], Any]
) -> None:
    np.random.seed(0)
    expected = Job(make(), tmp_path / "reference").train()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    np.random.seed(0)
    job = Job(make(), tmp_path / "run")

    def preempt(step: int) -> None:
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # handled between bytecodes: at once

    with pytest.raises(SystemExit) as exited:
        job.train(preempt)
    assert exited.value.code == RESTART_EXIT_CODE
    assert job.handler.total_run_calls == 5  # the signal came after step 4: saved after 5
    job.manager.close()

    np.random.seed(42)  # a new process: the restore brings back the random state
    again = Job(make(), tmp_path / "run")
    assert again.handler.total_run_calls == 5
    assert again.dist.epoch == 0
    np.testing.assert_array_equal(again.train(), expected)
    assert again.handler.total_run_calls == 12


def test_a_watcher_function_and_a_custom_exit(tmp_path: Path) -> None:
    told = []
    exits = []
    job = Job(
        cd.MirroredStrategy(["CPU:0", "CPU:1"]),
        tmp_path,
        termination_watcher_fn=lambda: bool(told),
        exit_fn=lambda: exits.append(job.handler.total_run_calls),
    )
    assert signal.getsignal(signal.SIGTERM) is not job.handler  # no signal handler then
    start = time.monotonic()

    def step(i: int) -> None:
        if i == 1:
            told.append(True)
        if not exits:
            time.sleep(0.3)  # the watcher polls every second

    job.train(step)
    assert exits  # the step after the watcher saw it
    assert time.monotonic() - start < 30
    saved = cd.train.latest_checkpoint(tmp_path)
    assert saved is not None


def test_a_grace_period_saves_at_once_and_again_before_its_end(tmp_path: Path) -> None:
    saves: list[int] = []
    exits: list[int] = []
    job = Job(
        cd.OneDeviceStrategy("CPU:0"),
        tmp_path,
        grace_period=0.25,
        save_fn=lambda: saves.append(job.handler.total_run_calls),
        exit_fn=lambda: exits.append(job.handler.total_run_calls),
    )

    def step(i: int) -> None:
        if i == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)

    job.train(step)
    assert saves[0] == 2  # at once
    assert len(saves) == 2  # and once more when the grace period nears its end
    assert exits == saves[1:]
    assert 2 < saves[1] < 12


def test_a_checkpoint_needs_a_directory(tmp_path: Path) -> None:
    ckpt = cd.train.Checkpoint(w=cd.Variable(1.0))
    with pytest.raises(ValueError, match="a checkpoint_dir must be passed as well"):
        PreemptionCheckpointHandler(None, ckpt)
    handler = PreemptionCheckpointHandler(None, ckpt, tmp_path)
    assert handler.total_run_calls == 0
    assert ckpt.checkpointed_runs is not None
    with pytest.raises(TypeError, match=r"must be a crossdevice\.train\.Checkpoint or"):
        PreemptionCheckpointHandler(None, object())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"grace_period": -1}, ValueError, r"grace_period must be a number of seconds >= 0"),
        ({"exit_fn": 42}, TypeError, r"exit_fn must be a function or None, got 42"),
        ({"save_fn": "save"}, TypeError, r"save_fn must be a function or None"),
    ],
)
def test_termination_config_checks_its_arguments(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        TerminationConfig(**kwargs)


def test_several_workers_agree_about_every_agree_seconds_not_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crossdevice._core import tuning
    from crossdevice._train import job

    calls: list[np.ndarray] = []

    def one_worker_sum(strategy: Any, array: np.ndarray) -> np.ndarray:
        calls.append(np.array(array))
        return array  # the chief alone: the sum is its own contribution

    exits: list[int] = []
    manager = cd.train.CheckpointManager(cd.train.Checkpoint(v=cd.Variable(1.0)), tmp_path, 1)
    handler = PreemptionCheckpointHandler(
        None, manager, termination_config=TerminationConfig(exit_fn=lambda: exits.append(1))
    )
    handler._workers = 2  # the chief of two workers, whose peer always says "no notice"
    monkeypatch.setattr(job, "sum_over_workers", one_worker_sum)
    start = time.monotonic()
    steps = 0
    while time.monotonic() - start < 1.0:  # short steps: ~0.1 ms each
        handler.run(lambda: time.sleep(0.0001))
        steps += 1
    agreements = len(calls)
    assert 3 <= agreements <= 1.0 / tuning.TUNING.preemption_agree_seconds + 3  # one per ~0.2 s
    assert steps > 20 * agreements
    assert calls[0].tolist() == [0, 1]  # the first proposal: agree again at the next step
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 2.0
    while not exits and time.monotonic() < deadline:
        handler.run(lambda: time.sleep(0.0001))
    assert exits  # agreed within about AGREE_SECONDS
    assert cd.train.latest_checkpoint(tmp_path) is not None


def test_a_notice_after_the_last_agreement_is_saved_when_the_loop_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crossdevice._train import job

    exits: list[int] = []
    manager = cd.train.CheckpointManager(cd.train.Checkpoint(v=cd.Variable(1.0)), tmp_path, 1)
    handler = PreemptionCheckpointHandler(
        None, manager, termination_config=TerminationConfig(exit_fn=lambda: exits.append(1))
    )
    handler._workers = 2  # the chief of two workers, whose peer always says "no notice"
    monkeypatch.setattr(job, "sum_over_workers", lambda strategy, array: array)
    with handler.watch_preemption_scope():
        for _ in range(30):
            handler.run(lambda: time.sleep(0.001))  # the next agreement is ~200 steps away
        os.kill(os.getpid(), signal.SIGTERM)
        handler.run(lambda: None)
        assert not exits  # no agreement before the loop ends
    assert exits  # the scope's end agreed, saved and exited
    assert cd.train.latest_checkpoint(tmp_path) is not None


@pytest.mark.parametrize("inside", [False, True])
def test_a_scheduler_stepped_between_runs_is_a_warning_once(tmp_path: Path, inside: bool) -> None:
    """A preemption saves inside `run`, right after the step: a scheduler stepped after
    `run` in the loop body (torch's per-iteration idiom) had not stepped for that step, and
    the resumed job ran one schedule step behind, silently (the bug hunt of session 57)."""
    torch = pytest.importorskip("torch")
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"])
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    ckpt = cd.train.Checkpoint(optimizer=optimizer, scheduler=scheduler)
    manager = cd.train.CheckpointManager(ckpt, tmp_path, max_to_keep=1)
    handler = PreemptionCheckpointHandler(None, manager)

    def step() -> None:
        strategy.run(lambda: None)
        weight.grad = torch.ones(2)
        optimizer.step()
        if inside:
            scheduler.step()

    if inside:
        for _ in range(3):
            handler.run(step)  # (pytest turns any warning into an error)
        return

    def loop() -> None:
        for _ in range(3):
            handler.run(step)
            scheduler.step()  # torch's per-iteration idiom, after the step

    with pytest.warns(UserWarning, match=r"scheduler\(s\) \['scheduler'\] stepped between") as w:
        loop()
    assert len(w) == 1
    assert w[0].filename == __file__
