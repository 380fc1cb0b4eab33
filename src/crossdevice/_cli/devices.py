"""`crossdevice devices`: the logical devices of this host and the array libraries present."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import platform
from typing import Any

from crossdevice._core.devices import (
    DEFAULT_LOGICAL_CPUS,
    get_logical_cpu_devices,
    list_logical_devices,
)

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the `devices` subcommand."""
    parser = subparsers.add_parser(
        "devices",
        help="list logical devices and available array libraries",
        description=(
            "List this host's logical devices (set the CPU count with "
            "CROSSDEVICE_LOGICAL_CPUS or crossdevice.config.set_logical_cpu_devices) and "
            "which array libraries crossdevice can use."
        ),
    )
    parser.add_argument(
        "--logical-cpus", type=int, default=None, help="offer this many logical CPU devices"
    )
    parser.set_defaults(func=run)


def _version(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def run(args: argparse.Namespace) -> int:
    """Print the devices and libraries; returns 0."""
    if args.logical_cpus is not None:
        from crossdevice._core.devices import set_logical_cpu_devices

        set_logical_cpu_devices(args.logical_cpus)
    import crossdevice

    print(f"crossdevice {crossdevice.__version__} on Python {platform.python_version()}")
    print(
        f"logical CPU devices: {get_logical_cpu_devices()} "
        f"(default {DEFAULT_LOGICAL_CPUS}; CROSSDEVICE_LOGICAL_CPUS=n to change)"
    )
    for device in list_logical_devices():
        print(f"  {device.device_type}  {device.name}")
    print("array libraries:")
    for package, role in [("numpy", "built in"), ("torch", "optional extra [torch]")]:
        version = _version(package)
        state = f"{version}" if version else "not installed (pip install torch==2.13.0)"
        print(f"  {package:<6} {state}  ({role})")
    torch_version = _version("torch")
    if torch_version:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"  CUDA: {f'{gpus} GPU(s)' if gpus else 'not available'}")
        if torch.distributed.is_available():
            backends = [b for b in ("gloo", "nccl") if _backend_available(torch, b)]
            print(f"  torch.distributed backends: {', '.join(backends) or 'none'}")
    return 0


def _backend_available(torch: Any, backend: str) -> bool:
    checks = {
        "gloo": torch.distributed.is_gloo_available,
        "nccl": torch.distributed.is_nccl_available,
    }
    return bool(checks[backend]())
