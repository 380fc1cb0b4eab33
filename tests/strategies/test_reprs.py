"""Issue 17 leftovers: concise reprs, and mixed nests in the packed all-reduce."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import crossdevice as cd


@pytest.fixture
def mirrored() -> Any:
    return cd.MirroredStrategy(["CPU:0", "CPU:1"])


# --- reprs (issue 17) ----------------------------------------------------------------------------
def test_torch_variable_repr_names_the_backend(mirrored: Any, torch_module: Any) -> None:
    with mirrored.scope():
        v = cd.Variable(torch_module.ones(2))
    text = repr(v)
    assert "numpy=" not in text
    assert "torch=" in text
    assert "numpy=" in repr(cd.Variable(np.ones(2)))


def test_large_variable_repr_is_summarised() -> None:
    strategy = cd.MirroredStrategy([f"CPU:{i}" for i in range(4)])
    with strategy.scope():
        v = cd.Variable(np.zeros((64, 64), np.float32))
        small = cd.Variable(np.zeros((20, 20), np.float32))
    text = repr(v)
    assert "..." in text
    assert len(text) < 2500, text
    assert "..." in repr(small)  # 400 elements: still summarised
    assert "..." not in repr(cd.Variable(np.zeros(5)))


def test_large_torch_variable_repr_is_summarised(torch_module: Any) -> None:
    v = cd.Variable(torch_module.zeros(64, 64))
    assert "..." in repr(v)
    assert len(repr(v)) < 800


def test_extended_and_ops_reprs(mirrored: Any) -> None:
    for obj in (mirrored.extended, cd.HostAllReduce(), cd.get_strategy().extended):
        assert " at 0x" not in repr(obj), repr(obj)
    assert "MirroredStrategy" in repr(mirrored.extended)
    assert "CPU:1" in repr(mirrored.extended)
    assert repr(cd.HostAllReduce()) == "HostAllReduce()"


def test_distributed_dataset_repr_is_summarised(mirrored: Any) -> None:
    dataset = [np.arange(4.0)] * 300
    text = repr(mirrored.experimental_distribute_dataset(dataset))
    assert len(text) < 400, text
    assert "CPU:1" in text
    assert re.search(r"list of 300", text), text


# --- mixed nests (GPU review) ----------------------------------------------------------------
@pytest.mark.parametrize(
    "ops",
    [cd.HierarchicalCopyAllReduce, cd.ReductionToOneDevice, cd.HostAllReduce],
    ids=["hierarchical", "reduction_to_one", "host"],
)
def test_all_reduce_of_a_mixed_nest(ops: Any, torch_module: Any) -> None:
    """A Python float beside a torch tensor reduces (it was `AttributeError: detach`)."""
    strategy = cd.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=ops())

    def fn() -> Any:
        ctx = cd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("sum", [torch_module.ones(3), 1.0, {"n": 32}])

    tensor, number, counts = strategy.experimental_local_results(strategy.run(fn))[0]
    assert torch_module.equal(tensor, torch_module.full((3,), 2.0))
    assert float(number) == 2.0
    assert int(counts["n"]) == 64
