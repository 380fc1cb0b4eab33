"""`HealthBoard.wait_works`: a work that completed is not watched, and its failure still raises."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("torch")

from crossdevice._comm.workers.calls import Call, WaitFailedError
from crossdevice._comm.workers.health import HealthBoard, _work_done


class _Work:
    def __init__(self, completed: bool, error: str | None = None) -> None:
        self.completed = completed
        self.error = error
        self.waits = 0

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout: Any = None) -> bool:
        self.waits += 1
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


class _Board:
    """Stands for the board: records the watched waits (the loop with the health checks)."""

    def __init__(self) -> None:
        self.watched: list[Any] = []

    def wait(self, call: Call, step: Any) -> None:
        self.watched.append(step)
        assert step(0.01)


def _call() -> Call:
    return Call("all_reduce", 1, 5.0, time.monotonic())


def test_a_completed_work_is_waited_on_once_without_the_watch() -> None:
    board, work = _Board(), _Work(completed=True)
    HealthBoard.wait_works(board, _call(), [work])  # type: ignore[arg-type]
    assert board.watched == []
    assert work.waits == 1  # waited on all the same: that is where its failure shows


def test_a_completed_work_that_failed_raises() -> None:
    board, work = _Board(), _Work(completed=True, error="Connection closed by peer")
    with pytest.raises(WaitFailedError) as caught:
        HealthBoard.wait_works(board, _call(), [work])  # type: ignore[arg-type]
    assert "Connection closed by peer" in str(caught.value.cause)
    assert board.watched == []


def test_a_work_in_flight_is_watched() -> None:
    board, done, running = _Board(), _Work(completed=True), _Work(completed=False)
    HealthBoard.wait_works(board, _call(), [done, running])  # type: ignore[arg-type]
    assert len(board.watched) == 1
    assert (done.waits, running.waits) == (1, 1)


class _LateWork(_Work):
    """A collective's work whose wait times out just before it completes (torch's base
    `Work.wait(timeout)` raises "Operation timed out!" and leaves the work running)."""

    def __init__(self, error: str | None = None) -> None:
        super().__init__(completed=False, error=error)

    def wait(self, timeout: Any = None) -> bool:
        if not self.completed:
            self.waits += 1
            self.completed = True  # it ends right after this wait gave up
            raise RuntimeError("Operation timed out!")
        return super().wait(timeout)


def test_a_work_that_completes_as_its_wait_times_out_is_done() -> None:
    # Seen: a healthy broadcast failed "Operation timed out!" in 1 launch of 20.
    work = _LateWork()
    assert _work_done(work, 0.001) is True
    assert work.waits == 2


def test_a_work_that_fails_as_its_wait_times_out_raises_its_own_error() -> None:
    work = _LateWork(error="Connection closed by peer")
    with pytest.raises(WaitFailedError) as caught:
        _work_done(work, 0.001)
    assert "Connection closed by peer" in str(caught.value.cause)


def test_a_work_still_running_is_not_done() -> None:
    class Running(_Work):
        def wait(self, timeout: Any = None) -> bool:
            self.waits += 1
            raise RuntimeError("Operation timed out!")

    assert _work_done(Running(completed=False), 0.001) is False
