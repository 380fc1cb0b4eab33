"""One tuning object holds every threshold, says why, and reaches every module that reads it."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from crossdevice._comm.local import thread as thread_module
from crossdevice._comm.local.thread import ThreadCommunicator
from crossdevice._core import tuning
from tests.collectives.replicas import raise_first, run_replicas


def test_every_threshold_says_why_and_which_benchmark_chose_it() -> None:
    fields = dataclasses.fields(tuning.Tuning)
    assert len(fields) >= 30
    for field in fields:
        assert len(tuning.reason(field.name)) > 40, field.name
        assert tuning.benchmark(field.name).strip(), field.name
        assert field.name.endswith(("_bytes", "_seconds", "_workers")), field.name


def test_overridden_replaces_fields_for_a_block_only() -> None:
    before = tuning.TUNING
    with tuning.overridden(pack_below_bytes=1, poll_seconds=0.5) as now:
        assert tuning.TUNING is now
        assert (now.pack_below_bytes, now.poll_seconds) == (1, 0.5)
        assert now.shared_work_min_bytes == before.shared_work_min_bytes
    assert tuning.TUNING is before
    with pytest.raises(TypeError, match=r"no such tuning threshold: \['pack_bytes'\]"):
        tuning.set_tuning(pack_bytes=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuning.TUNING.poll_seconds = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("kind", ["all_gather", "broadcast"])
def test_one_override_reaches_the_shared_copies_too(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared-work threshold of gathers and broadcasts is the all-reduce's (review T1).

    A module-level copy of the threshold (as `copies.py` had) would not see the override,
    and small gathers would never hand out work.
    """
    shared: list[bool] = []
    name = "setup_gather" if kind == "all_gather" else "setup_broadcast"
    setup = getattr(thread_module, name)

    def spy(rnd: Any, *args: Any) -> None:
        setup(rnd, *args)
        shared.append(rnd.work is not None)

    monkeypatch.setattr(thread_module, name, spy)
    n = 3
    comm = ThreadCommunicator(n)

    def replica(r: int) -> Any:
        x = np.arange(6.0) + r
        if kind == "all_gather":
            return comm.all_gather(r, x, 0, timeout=30)
        return comm.broadcast(r, x, root=1, timeout=30)

    for override in (False, True):
        shared.clear()
        if override:
            with tuning.overridden(shared_work_min_bytes=0):
                results, errors = run_replicas(n, replica)
        else:
            results, errors = run_replicas(n, replica)
        raise_first(errors)
        assert shared == [override]
        expected = (
            np.concatenate([np.arange(6.0) + r for r in range(n)])
            if kind == "all_gather"
            else np.arange(6.0) + 1
        )
        for r in range(n):
            assert np.array_equal(results[r], expected)
