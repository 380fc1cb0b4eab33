"""crossdevice: TensorFlow's `tf.distribute` data-parallel API for NumPy and PyTorch.

A `tf.distribute` program ports by replacing `tf.distribute` with `crossdevice`,
`tf.constant(x)` with a NumPy array or torch tensor and `tf.Variable` with
`crossdevice.Variable`:

    >>> import crossdevice, numpy as np
    >>> strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
    >>> def step():
    ...     ctx = crossdevice.get_replica_context()
    ...     return ctx.all_reduce("sum", np.float32(ctx.replica_id_in_sync_group + 1))
    >>> float(strategy.experimental_local_results(strategy.run(step))[0])
    3.0

Layers (docs/design.md §2), each importing only those below it: `_core` (devices, config,
reduce ops, options, context stack) → `_arrays` (NumPy, lazy torch) → `_values`
(distributed values and variables) → `_collectives` (algorithms, the rendezvous,
communicators) → `_cross_device` (TF's CrossDeviceOps classes) → `_replica` (replica
threads and modes) → `_input` → `_strategies` (with `ReplicaContext`) → `_cli`, checked by
`tests/test_layers.py`. This file only re-exports (and fixes `__module__`).
"""

from crossdevice import cluster_resolver as cluster_resolver
from crossdevice import config as config
from crossdevice import datasets as datasets
from crossdevice import experimental as experimental
from crossdevice import nn as nn
from crossdevice import train as train
from crossdevice._core.devices import device as device
from crossdevice._core.errors import CollectiveMismatchError as CollectiveMismatchError
from crossdevice._core.errors import CollectiveTimeoutError as CollectiveTimeoutError
from crossdevice._core.errors import WorkerFailedError as WorkerFailedError
from crossdevice._core.exports import fix_module_metadata as _fix_module_metadata
from crossdevice._core.reduce_op import ReduceOp as ReduceOp
from crossdevice._core.reduce_op import VariableAggregation as VariableAggregation
from crossdevice._core.reduce_op import VariableSynchronization as VariableSynchronization
from crossdevice._cross_device import CrossDeviceOps as CrossDeviceOps
from crossdevice._cross_device import HierarchicalCopyAllReduce as HierarchicalCopyAllReduce
from crossdevice._cross_device import HostAllReduce as HostAllReduce
from crossdevice._cross_device import NcclAllReduce as NcclAllReduce
from crossdevice._cross_device import ReductionToOneDevice as ReductionToOneDevice
from crossdevice._input.input_context import InputContext as InputContext
from crossdevice._input.input_context import InputOptions as InputOptions
from crossdevice._input.input_context import InputReplicationMode as InputReplicationMode
from crossdevice._strategies.base import Strategy as Strategy
from crossdevice._strategies.base import StrategyExtended as StrategyExtended
from crossdevice._strategies.context import experimental_set_strategy as experimental_set_strategy
from crossdevice._strategies.context import get_cross_replica_context as get_cross_replica_context
from crossdevice._strategies.context import get_replica_context as get_replica_context
from crossdevice._strategies.context import get_strategy as get_strategy
from crossdevice._strategies.context import has_strategy as has_strategy
from crossdevice._strategies.context import in_cross_replica_context as in_cross_replica_context
from crossdevice._strategies.context import replica_context as replica_context
from crossdevice._strategies.mirrored import MirroredStrategy as MirroredStrategy
from crossdevice._strategies.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from crossdevice._strategies.one_device import OneDeviceStrategy as OneDeviceStrategy
from crossdevice._strategies.replica import ReplicaContext as ReplicaContext
from crossdevice._trace.session import start_from_environment as _start_trace_from_environment
from crossdevice._values.distributed_variables import MirroredVariable as MirroredVariable
from crossdevice._values.distributed_variables import SyncOnReadVariable as SyncOnReadVariable
from crossdevice._values.values import DistributedValues as DistributedValues
from crossdevice._values.values import Mirrored as Mirrored
from crossdevice._values.values import PerReplica as PerReplica
from crossdevice._values.variables import Variable as Variable

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CrossDeviceOps",
    "DistributedValues",
    "HierarchicalCopyAllReduce",
    "HostAllReduce",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "SyncOnReadVariable",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "WorkerFailedError",
    "__version__",
    "cluster_resolver",
    "config",
    "datasets",
    "device",
    "experimental",
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "nn",
    "replica_context",
    "train",
]


_fix_module_metadata(globals(), __all__, "crossdevice")

# CROSSDEVICE_TRACE=path traces the whole process (crossdevice.experimental.trace).
_start_trace_from_environment()
