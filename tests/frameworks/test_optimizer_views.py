"""A mirrored optimizer's groups and state read and written inside `strategy.run`.

Every local replica runs the step function: a hyperparameter written there was written
once per replica (shared storage: the rate halved N times a step; copies: replicas with
different rates and parameters), silently; the shared optimizer's state read with a
replica's own parameter was empty and broke `state_dict()`. Now reads give the running
replica's view, writes are an error naming where to make them, and the change made once
(`call_once`) trains like plain torch.
"""

from __future__ import annotations

from typing import Any

import pytest

import crossdevice as cd
from tests.frameworks.helpers import (
    assert_trains_like,
    global_batches,
    global_loss,
    mlp,
    prepared_mlp,
    run_on_replicas,
    standard_step,
    train_plain,
)
from tests.strategies.conftest import replica_execution

pytestmark = pytest.mark.usefixtures("float64")
CASES = [("threads", True), ("threads", False), ("cooperative", True), ("cooperative", False)]
IDS = ["threads-shared", "threads-copies", "cooperative-shared", "cooperative-copies"]


def _halve(optimizer: Any) -> None:
    for group in optimizer.param_groups:
        group["lr"] *= 0.5


@pytest.mark.parametrize(("mode", "shared"), CASES, ids=IDS)
def test_a_hyperparameter_written_inside_run_is_an_error(
    torch: Any, cdt: Any, mode: str, shared: bool
) -> None:
    with replica_execution(mode):
        strategy, model, optimizer = prepared_mlp(
            torch, cdt, lambda p: torch.optim.SGD(p, lr=0.2), shared=shared
        )

        def step(x: Any, y: Any, i: int) -> None:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()
            optimizer.step()
            _halve(optimizer)  # plain torch's idiom, made by every replica

        with pytest.raises(RuntimeError, match=r"read-only inside strategy\.run.*4 times a step"):
            run_on_replicas(strategy, step, global_batches(torch, 1))
    assert [o.param_groups[0]["lr"] for o in optimizer.replicas] == [0.2] * 4


@pytest.mark.parametrize(("mode", "shared"), CASES, ids=IDS)
def test_a_hyperparameter_changed_once_a_step_trains_like_plain_torch(
    torch: Any, cdt: Any, mode: str, shared: bool
) -> None:
    data = global_batches(torch, 4)
    plain = mlp(torch)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.2, momentum=0.5)
    start = train_plain(torch, plain, plain_optimizer, data, standard_step(torch, _halve))
    with replica_execution(mode):
        strategy, model, optimizer = prepared_mlp(
            torch, cdt, lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.5), shared=shared
        )
        seen: list[Any] = []

        def step(x: Any, y: Any, i: int) -> None:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()
            optimizer.step()
            cdt.call_once(_halve, optimizer)  # once a step, in cross-replica context
            group = optimizer.param_groups[0]
            own = list(model.parameters())  # the running replica's own parameters
            same = all(a is b for a, b in zip(group["params"], own, strict=True))
            seen.append((group["lr"], same))

        run_on_replicas(strategy, step, data)
    assert_trains_like(torch, plain, model, start)
    assert optimizer.param_groups[0]["lr"] == 0.2 / 16  # (copies take it at their next step)
    assert sorted(seen) == sorted((0.2 / 2 ** (1 + i), True) for i in range(4) for _ in range(4))


@pytest.mark.parametrize(("mode", "shared"), CASES, ids=IDS)
def test_optimizer_state_read_inside_run_is_the_running_replicas(
    torch: Any, cdt: Any, mode: str, shared: bool
) -> None:
    data = global_batches(torch, 3)
    plain = mlp(torch)
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.05)
    train_plain(torch, plain, plain_optimizer, data, standard_step(torch))
    expected = [plain_optimizer.state[p]["exp_avg"] for p in plain.parameters()]
    with replica_execution(mode):
        strategy, model, optimizer = prepared_mlp(
            torch, cdt, lambda p: torch.optim.Adam(p, lr=0.05), shared=shared
        )
        seen: dict[int, list[Any]] = {}

        def step(x: Any, y: Any, i: int) -> None:
            optimizer.zero_grad()
            global_loss(torch, model, x, y).backward()
            optimizer.step()
            replica = cd.get_replica_context().replica_id_in_sync_group
            params = list(model.parameters())
            assert all(p in optimizer.state for p in params)
            seen[replica] = [optimizer.state[p]["exp_avg"].clone() for p in params]

        run_on_replicas(strategy, step, data)
    assert sorted(seen) == [0, 1, 2, 3]
    for moments in seen.values():
        for got, want in zip(moments, expected, strict=True):
            assert float((got - want).abs().max()) <= 1e-12
    assert len(optimizer.state) == len(expected)  # no key added by a replica's read
    assert sorted(optimizer.state_dict()["state"]) == list(range(len(expected)))


def test_the_shared_optimizers_state_is_read_only_inside_run(torch: Any, cdt: Any) -> None:
    strategy, model, optimizer = prepared_mlp(torch, cdt, lambda p: torch.optim.Adam(p, lr=0.05))

    def clear() -> None:
        optimizer.state.clear()

    with pytest.raises(RuntimeError, match=r"state are read-only inside strategy\.run"):
        strategy.run(clear)
    first = next(iter(model.parameters()))

    def drop() -> None:
        del optimizer.state[first]

    with pytest.raises(RuntimeError, match=r"got del state\[param\]"):
        strategy.run(drop)


def _halve_moments(optimizer: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p]["exp_avg"].mul_(0.5)


@pytest.mark.parametrize("mode", ["threads", "cooperative"])
@pytest.mark.parametrize("when", ["after_step", "before_step"])
def test_the_shared_optimizers_state_written_in_place_inside_run_is_an_error(
    torch: Any, cdt: Any, mode: str, when: str
) -> None:
    """Where the replicas share one optimizer, an in-place write to a state tensor read
    inside run landed once per replica (the bug hunt of session 57: the moments halved 4
    times a step, silently); it is an error where the replicas next meet or the run ends."""
    with replica_execution(mode):
        adam = prepared_mlp(torch, cdt, lambda p: torch.optim.Adam(p, lr=0.05), shared=True)
        strategy, model, optimizer = adam
        with pytest.raises(RuntimeError, match=r"state \['exp_avg'\] was written in place.*4 t"):
            run_on_replicas(
                strategy, _writing_step(torch, model, optimizer, when), global_batches(torch, 3)
            )
        # The error leaves the strategy usable: a step that only reads the state runs.
        run_on_replicas(strategy, _reading_step(torch, model, optimizer), global_batches(torch, 1))


def _writing_step(torch: Any, model: Any, optimizer: Any, when: str) -> Any:
    def step(x: Any, y: Any, i: int) -> None:
        optimizer.zero_grad()
        global_loss(torch, model, x, y).backward()
        if when == "before_step" and i == 1:
            _halve_moments(optimizer)
        optimizer.step()
        if when == "after_step":
            _halve_moments(optimizer)

    return step


def _reading_step(torch: Any, model: Any, optimizer: Any) -> Any:
    def step(x: Any, y: Any, i: int) -> None:
        params = list(model.parameters())
        _ = [optimizer.state[p].get("exp_avg") for p in params]  # read before the step
        optimizer.zero_grad()
        global_loss(torch, model, x, y).backward()
        optimizer.step()
        _ = [float(optimizer.state[p]["exp_avg"].abs().max()) for p in params]

    return step


@pytest.mark.parametrize(("mode", "shared"), CASES, ids=IDS)
def test_the_optimizers_state_written_once_a_step_trains_like_plain_torch(
    torch: Any, cdt: Any, mode: str, shared: bool
) -> None:
    """Each replica writing its own copy's state, or one write a step (`call_once`), is
    plain torch's write; the state read around the step is no write at all."""
    data = global_batches(torch, 4)
    plain = mlp(torch)
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.05)
    start = train_plain(torch, plain, plain_optimizer, data, standard_step(torch, _halve_moments))
    with replica_execution(mode):
        strategy, model, optimizer = prepared_mlp(
            torch, cdt, lambda p: torch.optim.Adam(p, lr=0.05), shared=shared
        )
        reading = _reading_step(torch, model, optimizer)

        def step(x: Any, y: Any, i: int) -> None:
            reading(x, y, i)
            if shared:
                cdt.call_once(_halve_moments, optimizer)
            else:
                _halve_moments(optimizer)  # the running replica's own state

        run_on_replicas(strategy, step, data)
    assert_trains_like(torch, plain, model, start)
