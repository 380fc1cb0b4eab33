"""How a module becomes mirrored: the checks, the storage choice, the chief's values.

* `check_mirrorable`: refuse what a mirrored module cannot train (a module mirrored
  already or a replica's copy of one, an uninitialised lazy module).
* `sharing`: whether the replicas store their parameters once (`share_storage`).
* `unwrap_compiled`: the module inside a `torch.compile`d one, and how it was compiled.
* `broadcast_from_chief`: every replica of every worker starts from the chief's values.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from crossdevice._arrays import torch_guard
from crossdevice._arrays.packing import plan
from crossdevice._frameworks.torch.agreement import check_workers_agree, describe_module
from crossdevice._strategies.base import Strategy

__all__ = ["broadcast_from_chief", "check_mirrorable", "sharing", "unwrap_compiled"]


def sharing(share_storage: bool | None, devices: list[torch.device]) -> bool:
    """Whether the replicas store their parameters once (`share_storage`; None: on the host).

    Raises:
        TypeError: `share_storage` is not None or a bool.
        ValueError: `share_storage=True` with a replica off the CPU.
    """
    if share_storage is not None and not isinstance(share_storage, bool):
        raise TypeError(f"share_storage must be None, True or False, got {share_storage!r}")
    on_host = all(d.type == "cpu" for d in devices)
    if share_storage and not on_host:
        raise ValueError(
            "share_storage=True needs every local replica on the CPU (one address space); "
            f"the replicas are on {[str(d) for d in devices]}"
        )
    return on_host and len(devices) > 1 if share_storage is None else share_storage


def unwrap_compiled(module: Any) -> tuple[Any, Any]:
    """`(module, its torch.compile context)` for a compiled module, else `(module, None)`."""
    if "torch._dynamo" in sys.modules:
        from torch._dynamo.eval_frame import OptimizedModule

        if isinstance(module, OptimizedModule):
            return module._orig_mod, module.dynamo_ctx
    return module, None


def check_mirrorable(module: Any) -> None:
    """Refuse a module that is not a torch module or is a replica's copy.

    (`MirroredModule` refuses a mirrored module itself before this.)

    Raises:
        TypeError: not a torch module.
        ValueError: an uninitialised lazy parameter, or a replica's copy of a mirrored
            module.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"MirroredModule expects a torch.nn.Module, got {type(module).__name__}: {module!r}"
        )
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if torch.nn.parameter.is_lazy(tensor):
            raise ValueError(
                f"{name!r} of {type(module).__name__} is not initialised yet (a lazy module, "
                f"such as LazyLinear, sets its shape at its first forward): mirroring needs "
                "every shape. Run one forward on a sample batch before "
                "crossdevice.torch.prepare (as DDP needs too)"
            )
    for name, submodule in module.named_modules():
        marked = torch_guard.mark_of(submodule)
        if marked is not None:
            strategy, index = marked
            what = "the module" if not name else f"its submodule {name!r}"
            raise ValueError(
                f"{what} is replica {index}'s copy of a model mirrored by {strategy!r} "
                f"already ({type(submodule).__name__}); prepare a model once and use the "
                "MirroredModule that prepare returned (its .module is the running "
                "replica's copy)"
            )


def broadcast_from_chief(strategy: Strategy, replicas: list[torch.nn.Module]) -> None:
    """Give every replica of every worker the chief's parameters and buffers.

    Local replicas are deep copies already; across workers, one broadcast per dtype, after
    the workers checked that their models have the same parameters and buffers.
    """
    communicator = getattr(strategy.extended, "_worker_communicator", None)
    tensors = [*replicas[0].parameters(), *replicas[0].buffers()]
    if communicator is not None:  # the same names, shapes and dtypes, or a clear error
        check_workers_agree(strategy, "models", describe_module(replicas[0]))
    if communicator is not None and tensors:
        packs = plan(
            [t.dtype for t in tensors],
            [tuple(t.shape) for t in tensors],
            [t.element_size() for t in tensors],
        )
        with torch.no_grad():
            for pack in packs:  # one per dtype
                flat = torch.cat([tensors[k].detach().reshape(-1).cpu() for k in pack.members])
                chief = torch.as_tensor(communicator.broadcast(flat, root=0))
                for k, value in zip(pack.members, pack.unpack(chief), strict=True):
                    tensors[k].copy_(value)
    if len(replicas) > 1:
        with torch.no_grad():
            for replica in replicas[1:]:
                others = [*replica.parameters(), *replica.buffers()]
                for target, source in zip(others, tensors, strict=True):
                    if target.data_ptr() != source.data_ptr():  # shared storage: itself
                        target.copy_(source)
