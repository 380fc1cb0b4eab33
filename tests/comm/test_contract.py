"""One contract, bound to every communicator (mpi4py binds its tests to every comm type).

The same cases (`contract.py`) run on each place peers live, through the one
`Communicator` protocol:

* `threads`: a `ThreadCommunicator`'s participants on three replica threads;
* `cooperative`: the same, as greenlets taking turns on one thread;
* `fake-nccl`: a `DeviceCommunicator` of two GPUs of the fake CUDA (NCCL reduce and
  broadcast between devices, one replica thread each);
* `gloo`: `ProcessGroupCommunicator`s in two worker processes with shared memory off,
  as across machines: every summed all-reduce exchanged whole, the smallest and those
  of several buffers too (below 1 MiB with the header folded behind the data), Gloo's
  in-place all-reduce for the other dtypes;
* `gloo-ring`: the same with the whole exchange off (Gloo's in-place all-reduce for
  small sums, the ring's two phases for large ones);
* `shm`: the same on one host with shared memory on.

Every peer's outcome must be what NumPy alone computes (`contract.expected`), bit for
bit; the values are integers, so any order of addition gives the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from crossdevice._comm.local.thread import ThreadCommunicator
from crossdevice._comm.protocol import Communicator
from crossdevice._replica.cooperative import CooperativeScheduler, ReplicaState
from tests.collectives.replicas import raise_first, run_replicas
from tests.comm import contract
from tests.comm.peers import GLOO, tuned

torch = pytest.importorskip("torch")

IN_PROCESS = ("threads", "cooperative", "fake-nccl")
WORKERS = {
    "gloo": GLOO,
    "gloo-ring": tuned(direct_max_workers=1),
    "shm": {},
}
#: What carries a small float32 sum and the large all-reduce on each worker binding.
CARRIERS = {
    "gloo": {"sum": "folded", "large": "direct"},
    "gloo-ring": {"sum": "process group", "large": "ring"},
    "shm": {"sum": "shared memory", "large": "shared memory"},
}
BINDINGS = (*IN_PROCESS, *WORKERS)
#: Peers per binding: three replica threads (an odd count: no pairwise shortcut), two
#: fake GPUs, two worker processes.
SIZES = {"threads": 3, "cooperative": 3, "fake-nccl": 2, "gloo": 2, "shm": 2}
SIZES.update({"gloo-ring": 2})

_OUTCOMES: dict[str, list[dict[str, Any]]] = {}


def _run_in_process(
    size: int, participants: list[Communicator], cooperative: bool, make: Any, back: Any
) -> list[dict[str, Any]]:
    def replica(r: int) -> dict[str, Any]:
        return contract.run_all(participants[r], make, back)

    if not cooperative:
        results, errors = run_replicas(size, replica, join_timeout=120)
        raise_first(errors)
        return results
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def run_replica(i: int, f: Callable[..., Any], args: Any, kwargs: Any) -> None:
        try:
            results[i] = f(*args, **kwargs)
        except BaseException as exc:
            errors[i] = exc

    scheduler = CooperativeScheduler(size, run_replica, lambda exc: None)
    scheduler.run(
        [(i, replica, (i,), {}) for i in range(size)],
        [ReplicaState([], [], None) for _ in range(size)],
    )
    raise_first(errors)
    return results


def _outcomes(binding: str) -> list[dict[str, Any]]:
    """Every peer's outcome of every case on `binding` (each binding runs once per session)."""
    if binding in _OUTCOMES:
        return _OUTCOMES[binding]
    size = SIZES[binding]
    if binding in ("threads", "cooperative"):
        comm = ThreadCommunicator(size, name=binding)
        peers: list[Communicator] = [comm.participant(r) for r in range(size)]
        outcome = _run_in_process(size, peers, binding == "cooperative", lambda a, r: a, np.asarray)
    elif binding == "fake-nccl":
        from crossdevice._comm.devices.communicator import DeviceCommunicator
        from tests.fake_cuda import fake_cuda

        with fake_cuda(size) as fake:
            comm_gpus = DeviceCommunicator([f"GPU:{r}" for r in range(size)], name=binding)
            peers = [comm_gpus.participant(r) for r in range(size)]
            outcome = _run_in_process(
                size,
                peers,
                False,
                lambda a, r: torch.from_numpy(np.array(a)).to(f"cuda:{r}"),
                lambda t: t.cpu().numpy(),
            )
            outcome[0]["nccl_calls"] = fake.counts["nccl_reduce"] + fake.counts["nccl_broadcast"]
    else:
        from tests.multi_worker.harness import run_workers

        results = run_workers(contract.worker, size, timeout=180, env=WORKERS[binding])
        outcome = [r.unwrap() for r in results]
        for out in outcome:
            assert out.pop("shared_memory") == (binding == "shm")
            assert out.pop("carriers") == CARRIERS[binding], binding
    _OUTCOMES[binding] = outcome
    return outcome


def _binding(name: str) -> Any:
    marks = [pytest.mark.multiprocess] if name in WORKERS else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("case", contract.CASES)
@pytest.mark.parametrize("binding", [_binding(b) for b in BINDINGS])
def test_every_communicator_keeps_the_contract(binding: str, case: str) -> None:
    outcomes = _outcomes(binding)
    want = contract.expected(case, SIZES[binding])
    for rank, outcome in enumerate(outcomes):
        kind, got = outcome[case]
        assert kind == "ok", (binding, case, rank, got)
        assert contract.same(got, want(rank)), (binding, case, rank, got, want(rank))


def test_the_fake_nccl_binding_goes_through_nccl() -> None:
    assert _outcomes("fake-nccl")[0]["nccl_calls"] > 0


def test_every_binding_is_a_communicator() -> None:
    comm = ThreadCommunicator(2)
    assert isinstance(comm.participant(1), Communicator)
    assert comm.participant(1).rank == 1
    assert comm.participant(1).size == 2
