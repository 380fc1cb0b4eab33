"""Replica worker threads run under SCHED_BATCH on Linux; the caller's thread keeps its policy."""

from __future__ import annotations

import os

import pytest

import crossdevice as cd

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's scheduling policy"
)


def test_worker_threads_run_batch_and_the_caller_keeps_its_policy() -> None:
    caller = os.sched_getscheduler(0)
    with cd.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"]) as strategy:
        out = strategy.run(lambda: os.sched_getscheduler(0))
        policies = list(strategy.experimental_local_results(out))
    assert policies[0] == caller  # replica 0 runs on the caller's thread
    if caller == os.SCHED_OTHER:
        assert policies[1:] == [os.SCHED_BATCH] * 2
    assert os.sched_getscheduler(0) == caller
