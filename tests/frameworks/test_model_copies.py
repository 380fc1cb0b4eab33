"""Models whose replica copies need care: a tensor attribute a graph made.

The deprecated `torch.nn.utils.weight_norm` (common in audio and TTS models) keeps
`weight` as a plain attribute computed from `weight_g` and `weight_v`; `copy.deepcopy`
refuses it, so `prepare`, which copies the model once per replica, failed with torch's
deepcopy message where DDP runs (bug hunt, session 53). Each copy now takes it detached
(`mirroring.derived_tensors`), and its hook computes it again from the copy's own
parameters at every forward: training equals plain torch's.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest

from tests.frameworks.helpers import (
    assert_trains_like,
    global_batches,
    mirrored,
    run_on_replicas,
    standard_step,
    train_plain,
)


def _net(torch: Any) -> Any:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, and still in use
        first = torch.nn.utils.weight_norm(torch.nn.Linear(6, 8))
    return torch.nn.Sequential(first, torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
def test_a_deprecated_weight_norm_model_trains_like_plain_torch(
    torch: Any, cdt: Any, shared: bool
) -> None:
    torch.set_default_dtype(torch.float64)  # (restored by the suite's fixture)
    data = global_batches(torch, 4)
    step = standard_step(torch)
    plain = _net(torch)
    start = train_plain(torch, plain, torch.optim.SGD(plain.parameters(), lr=0.5), data, step)
    strategy = mirrored(4)
    with strategy.scope():
        net = _net(torch)
        sgd = torch.optim.SGD(net.parameters(), lr=0.5)
        model, optimizer = cdt.prepare(net, sgd, share_storage=shared)
    run_on_replicas(strategy, lambda x, y, i: step(model, optimizer, x, y, i), data)
    assert_trains_like(torch, plain, model, start)
    twin = copy.deepcopy(model)  # a mirrored module's own copy takes the same path
    x = data[0][0]
    assert torch.equal(twin.replicas[0](x), model.replicas[0](x))
