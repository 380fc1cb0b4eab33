"""The public face: `__all__`, docstrings, `__module__`, the command line."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import crossdevice

TF_NAMES = {
    "CrossDeviceOps",
    "ReductionToOneDevice",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReduceOp",
    "Strategy",
    "StrategyExtended",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "ReplicaContext",
    "get_replica_context",
    "get_cross_replica_context",
    "in_cross_replica_context",
    "get_strategy",
    "has_strategy",
    "experimental_set_strategy",
    "DistributedValues",
    "PerReplica",
    "Mirrored",
    "Variable",
    "MirroredVariable",
    "SyncOnReadVariable",
    "VariableAggregation",
    "VariableSynchronization",
    "InputContext",
    "InputOptions",
    "experimental",
    "config",
}


#: Submodules imported only on request (they need an optional dependency), so not in
#: `__all__`: `from crossdevice import *` must not import torch.
OPTIONAL_SUBMODULES = {"torch"}


def test_all_lists_every_public_name() -> None:
    public = {n for n in dir(crossdevice) if not n.startswith("_")} - OPTIONAL_SUBMODULES
    assert set(crossdevice.__all__) - {"__version__"} == public
    assert set(crossdevice.__all__) >= TF_NAMES


def test_experimental_names() -> None:
    for name in [
        "CentralStorageStrategy",
        "CommunicationOptions",
        "CommunicationImplementation",
        "ValueContext",
    ]:
        assert hasattr(crossdevice.experimental, name)


@pytest.mark.parametrize("name", sorted(set(crossdevice.__all__) - {"__version__"}))
def test_every_public_name_has_a_docstring(name: str) -> None:
    obj = getattr(crossdevice, name)
    assert inspect.getdoc(obj), f"crossdevice.{name} has no docstring"
    if inspect.isclass(obj):
        for attr, member in vars(obj).items():
            if attr.startswith("_") or (not callable(member) and not isinstance(member, property)):
                continue
            assert inspect.getdoc(member), f"crossdevice.{name}.{attr} has no docstring"


def test_torch_is_not_imported_by_the_library() -> None:
    code = "import crossdevice, sys; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"


def test_cli_devices() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "crossdevice", "devices", "--logical-cpus", "3"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "logical CPU devices: 3" in out.stdout
    assert "/job:localhost/replica:0/task:0/device:CPU:2" in out.stdout
    assert "numpy" in out.stdout


def test_public_classes_report_the_public_module() -> None:
    assert crossdevice.MirroredStrategy.__module__ == "crossdevice"
    assert crossdevice.ReductionToOneDevice.__module__ == "crossdevice"


def test_torch_submodule_public_face(torch_module: object) -> None:
    import crossdevice.torch as cdt

    assert set(cdt.__all__) == {n for n in dir(cdt) if not n.startswith("_")} - {"annotations"}
    for name in cdt.__all__:
        obj = getattr(cdt, name)
        if callable(obj):
            assert inspect.getdoc(obj), f"crossdevice.torch.{name} has no docstring"
            # The loss helpers are crossdevice.nn's (NumPy values too), re-exported.
            home = "crossdevice.nn" if name in crossdevice.nn.__all__ else "crossdevice.torch"
            assert obj.__module__ == home, name


def test_train_module_public_face() -> None:
    from crossdevice import train

    assert set(train.__all__) == {n for n in dir(train) if not n.startswith("_")}
    assert {"Checkpoint", "CheckpointManager", "latest_checkpoint"} <= set(train.__all__)
    for name in train.__all__:
        obj = getattr(train, name)
        assert inspect.getdoc(obj), f"crossdevice.train.{name} has no docstring"
        assert obj.__module__ == "crossdevice.train", name
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not (callable(member) or isinstance(member, property)):
                    continue
                assert inspect.getdoc(member), f"crossdevice.train.{name}.{attr} has no docstring"


def test_experimental_preemption_names() -> None:
    experimental = crossdevice.experimental
    assert experimental.RESTART_EXIT_CODE == 42
    for name in ("PreemptionCheckpointHandler", "TerminationConfig"):
        obj = getattr(experimental, name)
        assert obj.__module__ == "crossdevice.experimental"
        assert inspect.getdoc(obj)
        for attr, member in vars(obj).items():
            if not attr.startswith("_") and callable(member):
                assert inspect.getdoc(member), f"{name}.{attr} has no docstring"
