"""Configuration: logical CPU and GPU devices, device listing, replica execution.

The first three are `tf.config` counterparts; `set_replica_execution` chooses between replica
threads and cooperative replicas (crossdevice's own).
"""

from crossdevice._core.devices import DEFAULT_LOGICAL_CPUS as DEFAULT_LOGICAL_CPUS
from crossdevice._core.devices import LogicalDevice as LogicalDevice
from crossdevice._core.devices import get_logical_cpu_devices as get_logical_cpu_devices
from crossdevice._core.devices import get_logical_gpu_devices as get_logical_gpu_devices
from crossdevice._core.devices import list_logical_devices as list_logical_devices
from crossdevice._core.devices import set_logical_cpu_devices as set_logical_cpu_devices
from crossdevice._core.devices import set_logical_gpu_devices as set_logical_gpu_devices
from crossdevice._replica.execution import EXECUTION_MODES as EXECUTION_MODES
from crossdevice._replica.execution import get_replica_execution as get_replica_execution
from crossdevice._replica.execution import set_replica_execution as set_replica_execution

__all__ = [
    "DEFAULT_LOGICAL_CPUS",
    "EXECUTION_MODES",
    "LogicalDevice",
    "get_logical_cpu_devices",
    "get_logical_gpu_devices",
    "get_replica_execution",
    "list_logical_devices",
    "set_logical_cpu_devices",
    "set_logical_gpu_devices",
    "set_replica_execution",
]
