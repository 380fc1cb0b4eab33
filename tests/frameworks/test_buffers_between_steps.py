"""A buffer written outside `strategy.run` on every worker alike, one replica per worker.

`model.load_state_dict(ckpt)` before training, `model.to(torch.float64)` after prepare,
`model.scale.mul_(1.5)` between steps: with one replica per worker each failed at the
next forward, on every worker, with "the forward pass changed buffer(s) ['scale'] ...
every replica changed them to the same value", telling the user to change them outside
the forward pass, which they had (the bug hunt of session 55). The mirror refreshed the
buffers' watch (`BufferSync.refresh`) only when it copied them to other local replicas;
now a write by cross-replica code counts as agreed with any number of local replicas
(`ReplicaMirror._buffers_written`, `settled`). With two replicas per worker it worked.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.frameworks.between_steps_workers import plain, train
from tests.multi_worker.harness import run_workers

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("how", ["loaded", "cast", "scaled"])
def test_a_buffer_written_alike_outside_run_trains_as_plain_torch(
    torch_module: Any, how: str, replicas: int
) -> None:
    torch = torch_module
    outs = [r.unwrap() for r in run_workers(train, 2, args=(how, replicas), timeout=90.0)]
    reference = plain(how)
    for out in outs:
        assert "params" in out, out
        got = out["params"] + out["buffers"]
        assert len(got) == len(reference)
        assert all(a.dtype == b.dtype for a, b in zip(got, reference, strict=True))
        worst = max(float((a - b).abs().max()) for a, b in zip(got, reference, strict=True))
        assert worst <= 1e-12, worst
    assert all(torch.equal(a, b) for a, b in zip(outs[0]["params"], outs[1]["params"], strict=True))
