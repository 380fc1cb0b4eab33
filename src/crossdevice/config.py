"""Device configuration: logical CPU devices and device listing (`tf.config` counterparts)."""

from crossdevice._core.devices import DEFAULT_LOGICAL_CPUS as DEFAULT_LOGICAL_CPUS
from crossdevice._core.devices import LogicalDevice as LogicalDevice
from crossdevice._core.devices import get_logical_cpu_devices as get_logical_cpu_devices
from crossdevice._core.devices import list_logical_devices as list_logical_devices
from crossdevice._core.devices import set_logical_cpu_devices as set_logical_cpu_devices

__all__ = [
    "DEFAULT_LOGICAL_CPUS",
    "LogicalDevice",
    "get_logical_cpu_devices",
    "list_logical_devices",
    "set_logical_cpu_devices",
]
