"""A prepared model inside another module: the parent's `state_dict` loads back into it.

`torch.optim.swa_utils.AveragedModel(model)` of a prepared model, or any module holding
one, saved its entries under the child's prefix but could not load them: a
`MirroredModule` has no parameters of its own for torch's walk, so every entry was
"unexpected", and a checkpoint of an averaged model could be written, never restored
(the bug hunt of session 57). Compared with plain torch in float64.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

import crossdevice as cd
from tests.frameworks.helpers import mirrored

pytestmark = pytest.mark.usefixtures("float64")


def _net(torch: Any) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _prepared(torch: Any, cdt: Any) -> tuple[Any, Any, Any]:
    strategy = mirrored(2)
    with strategy.scope():
        net = _net(torch)
        model, optimizer = cdt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return strategy, model, optimizer


def _nudge(torch: Any, module: Any) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)


def test_an_averaged_models_state_dict_loads_back_into_every_replica(torch: Any, cdt: Any) -> None:
    _, model, _ = _prepared(torch, cdt)
    swa = torch.optim.swa_utils.AveragedModel(model)
    plain_swa = torch.optim.swa_utils.AveragedModel(_net(torch))
    saved = copy.deepcopy(swa.state_dict())
    assert list(saved) == list(plain_swa.state_dict())  # the same keys as plain torch
    _nudge(torch, swa)
    result = swa.load_state_dict(saved)
    assert not result.missing_keys
    assert not result.unexpected_keys
    for replica in swa.module.replicas:
        for name, value in replica.state_dict().items():
            assert torch.equal(value, saved["module." + name]), name


def test_a_wrapper_reports_keys_under_their_full_names(torch: Any, cdt: Any) -> None:
    _, model, _ = _prepared(torch, cdt)

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model
            self.head = torch.nn.Linear(1, 1)

    wrapper = Wrapper()
    state = wrapper.state_dict()
    del state["net.2.bias"]
    state["net.9.weight"] = torch.zeros(1)
    with pytest.raises(
        RuntimeError, match=r'Missing key\(s\).*"net\.2\.bias".*\n?.*"net\.9\.weight"'
    ):
        wrapper.load_state_dict(state)
    result = wrapper.load_state_dict(state, strict=False)
    assert result.missing_keys == ["net.2.bias"]
    assert result.unexpected_keys == ["net.9.weight"]


def test_a_checkpoint_of_an_averaged_model_restores(torch: Any, cdt: Any, tmp_path: Any) -> None:
    strategy, model, optimizer = _prepared(torch, cdt)
    swa = torch.optim.swa_utils.AveragedModel(model)
    swa.update_parameters(model)
    checkpoint = cd.train.Checkpoint(model=model, optimizer=optimizer, swa=swa)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    checkpoint.sync()
    before = copy.deepcopy(swa.state_dict())
    _nudge(torch, swa)
    _nudge(torch, model)
    checkpoint.restore(path)
    for key, value in swa.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(
        torch.equal(a, b)
        for r in swa.module.replicas
        for a, b in zip(r.parameters(), swa.module.replicas[0].parameters(), strict=True)
    )
    del strategy


def test_a_save_in_the_middle_of_gradient_accumulation_warns(
    torch: Any, cdt: Any, tmp_path: Any
) -> None:
    """A checkpoint holds no gradient: one saved after a micro-batch accumulated under
    `no_sync()` (a step not taken yet) resumed without it, silently (session 57's resume
    hunt); it warns. At a step boundary it does not."""
    strategy, model, optimizer = _prepared(torch, cdt)
    checkpoint = cd.train.Checkpoint(model=model, optimizer=optimizer)
    x = torch.randn(8, 3)

    def micro(last: bool) -> None:
        loss = (model(x) ** 2).sum() / 16
        if last:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            with model.no_sync():
                loss.backward()

    strategy.run(micro, args=(False,))
    with pytest.warns(UserWarning, match="holds gradients accumulated since") as w:
        checkpoint.save(str(tmp_path / "mid"))
    assert w[0].filename == __file__
    strategy.run(micro, args=(True,))
    checkpoint.save(str(tmp_path / "boundary"))  # (pytest turns any warning into an error)
    checkpoint.sync()
