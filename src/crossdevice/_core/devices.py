"""Device strings: parsing, canonicalisation and the logical devices of this host.

TF device strings (`"CPU:1"`, `"/cpu:1"`, `"/device:GPU:0"`,
`"/job:worker/replica:0/task:1/device:CPU:0"`) are parsed into a `DeviceSpec` and
canonicalised to the full form `/job:localhost/replica:0/task:0/device:CPU:1`.

Unlike TF (`"/device:cpu:0"` is an AssertionError there), the device type is accepted
in any case: it is the same device.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import threading
from typing import Final

from crossdevice._core import environment

__all__ = [
    "DEFAULT_LOGICAL_CPUS",
    "DeviceSpec",
    "LogicalDevice",
    "canonicalize",
    "check_device_exists",
    "current_device",
    "device_scope",
    "device_type",
    "get_logical_cpu_devices",
    "get_logical_gpu_devices",
    "list_logical_devices",
    "local_host_device",
    "num_gpus",
    "num_physical_gpus",
    "physical_gpu_index",
    "set_logical_cpu_devices",
    "set_logical_gpu_devices",
    "swap_device_stack",
]

#: Logical CPU devices offered when neither `config.set_logical_cpu_devices` nor the
#: environment variable `CROSSDEVICE_LOGICAL_CPUS` says otherwise. TF offers one CPU and
#: needs `set_logical_device_configuration` for more; we offer as many as the host has
#: cores (at least 2), so `MirroredStrategy(["CPU:0", "CPU:1"])` works out of the box.
DEFAULT_LOGICAL_CPUS: Final = max(2, os.cpu_count() or 1)
_ENV_LOGICAL_CPUS: Final = "CROSSDEVICE_LOGICAL_CPUS"
_ENV_LOGICAL_GPUS: Final = "CROSSDEVICE_LOGICAL_GPUS"

_SPEC_RE = re.compile(
    r"^(?:/job:(?P<job>[A-Za-z0-9_.-]+))?"
    r"(?:/replica:(?P<replica>\d+))?"
    r"(?:/task:(?P<task>\d+))?"
    r"(?:/(?:device:)?(?P<type>[A-Za-z_]+):(?P<index>\d+|\*))?$"
)
_SHORT_RE = re.compile(r"^(?P<type>[A-Za-z_]+):(?P<index>\d+)$")


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """A parsed device string; fields left `None` were not given."""

    job: str | None = None
    replica: int | None = None
    task: int | None = None
    device_type: str | None = None
    device_index: int | None = None

    @classmethod
    def from_string(cls, spec: str) -> DeviceSpec:
        """Parse a TF device string such as `"/job:worker/task:1/device:GPU:0"` or `"CPU:1"`.

        Raises:
            ValueError: the string is not a device string.
        """
        if not isinstance(spec, str):
            raise TypeError(f"expected a device string such as 'CPU:0', got {spec!r}")
        text = spec.strip()
        match = _SHORT_RE.match(text) or _SPEC_RE.match(text)
        if match is None or not text:
            raise ValueError(
                f"could not parse device string {spec!r}; expected a form such as 'CPU:0', "
                "'/gpu:1', '/device:GPU:0' or '/job:worker/replica:0/task:1/device:CPU:0'"
            )
        groups = match.groupdict()
        index = groups.get("index")
        dtype = groups.get("type")
        return cls(
            job=groups.get("job"),
            replica=int(groups["replica"]) if groups.get("replica") else None,
            task=int(groups["task"]) if groups.get("task") else None,
            device_type=dtype.upper() if dtype else None,
            device_index=int(index) if index not in (None, "*") else None,
        )

    def merged_onto(self, base: DeviceSpec) -> DeviceSpec:
        """Fields of `self` where given, else those of `base` (TF's `make_merged_spec`)."""
        return DeviceSpec(
            job=self.job if self.job is not None else base.job,
            replica=self.replica if self.replica is not None else base.replica,
            task=self.task if self.task is not None else base.task,
            device_type=self.device_type if self.device_type is not None else base.device_type,
            device_index=(
                self.device_index if self.device_index is not None else base.device_index
            ),
        )

    def to_string(self) -> str:
        """The string form, with only the fields that are set."""
        parts = []
        if self.job is not None:
            parts.append(f"/job:{self.job}")
        if self.replica is not None:
            parts.append(f"/replica:{self.replica}")
        if self.task is not None:
            parts.append(f"/task:{self.task}")
        if self.device_type is not None:
            index = "*" if self.device_index is None else str(self.device_index)
            parts.append(f"/device:{self.device_type}:{index}")
        return "".join(parts)


_LOCAL_BASE: Final = DeviceSpec("localhost", 0, 0, "CPU", 0)


@functools.lru_cache(maxsize=4096)
def _canonicalize_cached(spec: str, default: str | None) -> str:
    base = _LOCAL_BASE
    if default is not None:
        base = DeviceSpec.from_string(default).merged_onto(base)
    return DeviceSpec.from_string(spec).merged_onto(base).to_string()


def canonicalize(spec: str, default: str | None = None) -> str:
    """Canonicalise a device string: `"/gpu:0"` → `/job:localhost/replica:0/task:0/device:GPU:0`.

    Args:
        spec: a device string.
        default: fields not given in `spec` come from here, then from the local host.

    Returns:
        The full device string.

    Example:
        >>> canonicalize("CPU:1")
        '/job:localhost/replica:0/task:0/device:CPU:1'
    """
    return _canonicalize_cached(spec, default)


def device_type(spec: str) -> str:
    """`"CPU"` or `"GPU"` (or another type) of a device string."""
    parsed = DeviceSpec.from_string(spec)
    return parsed.device_type or "CPU"


@dataclasses.dataclass(frozen=True)
class LogicalDevice:
    """A device this host offers, as `tf.config.LogicalDevice` (`name`, `device_type`)."""

    name: str
    device_type: str


class _Config:
    """Process-wide device configuration (guarded by a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.logical_cpus: int | None = None
        self.logical_gpus: int | None = None


_CONFIG = _Config()


def _env_count(name: str) -> int | None:
    return environment.env_int(name, minimum=1)


def _env_logical_cpus() -> int | None:
    return _env_count(_ENV_LOGICAL_CPUS)


def set_logical_cpu_devices(n: int) -> None:
    """Offer `n` logical host devices `CPU:0` … `CPU:n-1` (TF: `set_logical_device_configuration`).

    Logical CPU devices share host memory; each replica on one runs in its own thread.
    Unlike TF this may be called at any time; strategies already built keep their devices.

    Args:
        n: the number of logical CPU devices, at least 1.

    Example:
        >>> import crossdevice
        >>> crossdevice.config.set_logical_cpu_devices(4)
        >>> len(crossdevice.config.list_logical_devices("CPU"))
        4
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of logical CPU devices must be an int >= 1, got {n!r}")
    with _CONFIG.lock:
        _CONFIG.logical_cpus = n


def get_logical_cpu_devices() -> int:
    """The number of logical CPU devices: the configured one, else the env var, else the default."""
    with _CONFIG.lock:
        configured = _CONFIG.logical_cpus
    if configured is not None:
        return configured
    from_env = _env_logical_cpus()
    return from_env if from_env is not None else DEFAULT_LOGICAL_CPUS


def num_physical_gpus() -> int:
    """CUDA devices visible through torch; 0 when torch is not installed or has no CUDA."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def set_logical_gpu_devices(n: int | None) -> None:
    """Offer `n` logical GPUs `GPU:0` … `GPU:n-1` on the CUDA devices of this host.

    TF's `tf.config.set_logical_device_configuration(gpu, [LogicalDeviceConfiguration()] * n)`
    splits one physical GPU into several; this is its counterpart, and how multi-GPU code
    (`MirroredStrategy(["GPU:0", "GPU:1", ...])`) runs on a one-GPU machine. Logical GPU
    `k` lives on CUDA device `k % P` (P physical GPUs). Each logical GPU gets its own CUDA
    stream, so its replica's work is ordered as on a GPU of its own. Logical GPUs on one
    card share its memory; NCCL, which refuses two ranks on one device, is replaced by an
    in-order sum on the card (see `NcclAllReduce`).

    Strategies already built keep their devices. The environment variable
    `CROSSDEVICE_LOGICAL_GPUS=n` does the same for a whole process.

    Args:
        n: the number of logical GPUs, at least 1; `None` offers the physical GPUs again.

    Raises:
        ValueError: `n` is not a positive int.
        RuntimeError: no CUDA device is visible (there is nothing to split).
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(
            f"the number of logical GPUs must be an int >= 1 or None, got {n!r}; "
            "write e.g. set_logical_gpu_devices(4)"
        )
    if n is not None and num_physical_gpus() == 0:
        raise RuntimeError(
            f"set_logical_gpu_devices({n}) needs at least one CUDA device, but torch sees "
            "none (torch is not installed, is a CPU build, or CUDA_VISIBLE_DEVICES hides "
            "every GPU); use logical CPU devices instead: set_logical_cpu_devices(n)"
        )
    with _CONFIG.lock:
        _CONFIG.logical_gpus = n


def get_logical_gpu_devices() -> int | None:
    """The configured number of logical GPUs (`set_logical_gpu_devices` or the env var), or None."""
    with _CONFIG.lock:
        configured = _CONFIG.logical_gpus
    if configured is not None:
        return configured
    return _env_count(_ENV_LOGICAL_GPUS)


def num_gpus() -> int:
    """The GPUs offered as `GPU:i`: the logical GPUs when configured, else the CUDA devices.

    Logical GPUs need a CUDA device: with none visible there are none.
    """
    physical = num_physical_gpus()
    logical = get_logical_gpu_devices()
    if logical is None or physical == 0:
        return physical
    return logical


def physical_gpu_index(index: int) -> int:
    """The CUDA device index behind `GPU:index` (itself without logical GPUs)."""
    if get_logical_gpu_devices() is None:
        return index
    physical = num_physical_gpus()
    return index % physical if physical else index


def list_logical_devices(device_type: str | None = None) -> list[LogicalDevice]:
    """The logical devices of this host (`tf.config.list_logical_devices`).

    Args:
        device_type: `"CPU"` or `"GPU"` (any case) to filter; `None` for all.

    Returns:
        `LogicalDevice`s with canonical names.
    """
    wanted = device_type.upper() if device_type else None
    devices: list[LogicalDevice] = []
    if wanted in (None, "CPU"):
        devices += [
            LogicalDevice(canonicalize(f"CPU:{i}"), "CPU") for i in range(get_logical_cpu_devices())
        ]
    if wanted in (None, "GPU"):
        devices += [LogicalDevice(canonicalize(f"GPU:{i}"), "GPU") for i in range(num_gpus())]
    return devices


def check_device_exists(canonical: str) -> None:
    """Raise ValueError naming the devices that exist when a local `canonical` device does not.

    Devices of other jobs or tasks (multi-worker) are not checked here.
    """
    spec = DeviceSpec.from_string(canonical)
    if spec.job not in (None, "localhost"):
        return
    kind = spec.device_type or "CPU"
    index = spec.device_index or 0
    if kind == "CPU":
        count = get_logical_cpu_devices()
    elif kind == "GPU":
        count = num_gpus()
    else:
        count = 0
    if index >= count:
        existing = [d.name for d in list_logical_devices()]
        hint = (
            " Call crossdevice.config.set_logical_cpu_devices(n) or set "
            f"{_ENV_LOGICAL_CPUS}=n for more logical CPU devices."
            if kind == "CPU"
            else _gpu_hint(kind, index)
        )
        raise ValueError(
            f"device {canonical!r} does not exist; the devices of this host are {existing}.{hint}"
        )


def _gpu_hint(kind: str, index: int) -> str:
    if kind == "CUDA":
        return f" CUDA devices are named as in TensorFlow: write 'GPU:{index}', not 'cuda:{index}'."
    if kind == "GPU" and num_gpus() == 0:
        return (
            " No CUDA GPU is visible to this process (torch is not installed, or "
            "torch.cuda.is_available() is False): use CPU devices such as 'CPU:0'."
        )
    return ""


def local_host_device() -> str:
    """The canonical host device `CPU:0` of this worker."""
    return canonicalize("CPU:0")


_DEVICE_STACK = threading.local()


def current_device() -> str | None:
    """The canonical device of the innermost `device_scope` on this thread, or None."""
    stack: list[str] | None = getattr(_DEVICE_STACK, "stack", None)
    return stack[-1] if stack else None


def swap_device_stack(stack: list[str]) -> list[str]:
    """Replace this thread's device-scope stack, returning the old one (for merge_fn)."""
    old: list[str] = getattr(_DEVICE_STACK, "stack", None) or []
    _DEVICE_STACK.stack = stack
    return old


class device_scope:  # noqa: N801 (a context manager named like `tf.device`)
    """Context manager that sets the current device (`tf.device`).

    Plain host arrays created or passed inside it are taken to live on that device.

    Args:
        spec: a device string; it is canonicalised.
    """

    def __init__(self, spec: str) -> None:
        self._device = canonicalize(spec)

    def __enter__(self) -> str:
        stack = getattr(_DEVICE_STACK, "stack", None)
        if stack is None:
            stack = []
            _DEVICE_STACK.stack = stack
        stack.append(self._device)
        return self._device

    def __exit__(self, *exc: object) -> None:
        _DEVICE_STACK.stack.pop()


class device(device_scope):  # noqa: N801 (named like `tf.device`)
    """Context manager that sets the current device (`tf.device`).

    Plain host arrays created or passed inside it are taken to live on that device.
    Unlike TF, whose soft placement silently runs on another device, a local device
    that does not exist is an error, with a hint (`"cuda:0"` is written `"GPU:0"`).

    Args:
        spec: a device string such as `"CPU:1"` or `"/device:GPU:0"`; it is canonicalised.

    Raises:
        ValueError: a device of this worker that does not exist.

    Example:
        >>> with device("CPU:0") as name:
        ...     name
        '/job:localhost/replica:0/task:0/device:CPU:0'
    """

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        check_device_exists(self._device)
