"""The caller's torch thread state, carried into every replica (as torch's `parallel_apply`).

Grad mode, inference mode and autocast are thread-local in torch: a replica thread starts
with grad enabled and no autocast whatever its caller set. A `strategy.run` under
`torch.no_grad()`, `torch.inference_mode()` or `torch.autocast(...)` must mean the same in
every replica, on threads and cooperatively, so the runner captures the caller's state
once per run and enters it around each replica thread's function.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Final

__all__ = ["ThreadState", "capture"]

#: Device types whose autocast state is carried over.
_AUTOCAST_DEVICES: Final = ("cpu", "cuda")


class ThreadState:
    """A caller's torch thread state that differs from a fresh thread's.

    Attributes:
        grad_enabled: `torch.is_grad_enabled()`.
        inference: `torch.is_inference_mode_enabled()`.
        autocast: (device type, dtype) of every device type with autocast enabled.
    """

    __slots__ = ("autocast", "grad_enabled", "inference")

    def __init__(
        self, grad_enabled: bool, inference: bool, autocast: tuple[tuple[str, Any], ...]
    ) -> None:
        self.grad_enabled = grad_enabled
        self.inference = inference
        self.autocast = autocast

    def entered(self) -> contextlib.ExitStack:
        """A context that puts this state on the current thread (and takes it off after)."""
        import torch

        stack = contextlib.ExitStack()
        if self.inference:
            stack.enter_context(torch.inference_mode())
        elif not self.grad_enabled:
            stack.enter_context(torch.no_grad())
        for device_type, dtype in self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        return stack


def capture() -> ThreadState | None:
    """The calling thread's torch state, or None where it is a fresh thread's (or no torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    grad = bool(torch.is_grad_enabled())
    inference = bool(torch.is_inference_mode_enabled())
    autocast: tuple[tuple[str, Any], ...] = ()
    if torch._C._is_any_autocast_enabled():  # one cheap call in the common case
        autocast = tuple(
            (device, torch.get_autocast_dtype(device))
            for device in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)
        )
    if grad and not inference and not autocast:
        return None
    return ThreadState(grad, inference, autocast)
