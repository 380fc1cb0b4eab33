"""Per-replica random streams for torch code inside `strategy.run`.

torch draws `torch.rand`, dropout masks and friends from one process-wide generator.
Replica threads drawing from it interleave by timing, so two runs seeded alike end with
different parameters, and cooperative replicas would all draw one stream in turn. Here,
inside a replica, a draw that names no generator uses the replica's own
`torch.Generator`. At the first draw of each `strategy.run`, one seed is taken from
torch's global generator (so `torch.manual_seed` governs everything), and replica `r`'s
generator is seeded from it and `r`'s global replica id. Replicas thus draw different
masks, and two runs seeded alike give bitwise the same draws whatever the thread timing.

torch has no thread-local generator, so the module-level functions and `Tensor`
methods that draw are wrapped once, process-wide, by the first `strategy.run` after
torch is imported (outside replicas, and with one replica, they call torch unchanged):
`torch.rand`, `randn`, `randint`, `randperm`, `rand_like`, `randn_like`,
`randint_like`, `bernoulli`, `multinomial`, `normal`, `poisson`; the in-place
`Tensor.uniform_`, `normal_`, `bernoulli_`, `random_`, `exponential_`, `geometric_`,
`log_normal_`, `cauchy_`; and `torch.nn.functional.dropout`, `dropout1d/2d/3d`, which
take no generator and are computed here from a replica-drawn mask. Other random
operators (`alpha_dropout`, `rrelu`, attention dropout) still use the global generator.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Final

import torch
from torch.nn import functional

from crossdevice._core import context

__all__ = ["install", "replica_generator"]

_FUNCTIONS: Final = (
    "rand",
    "randn",
    "randint",
    "randperm",
    "rand_like",
    "randn_like",
    "randint_like",
    "bernoulli",
    "multinomial",
    "normal",
    "poisson",
)
_METHODS: Final = (
    "uniform_",
    "normal_",
    "bernoulli_",
    "random_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
)
_MIX: Final = 0x9E3779B97F4A7C15


class _ReplicaStreams:
    """One strategy's per-replica generators and the run they were seeded for."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.run = -1
        self.seed = 0
        # (replica, device) -> (run, generator): a CUDA draw needs a CUDA generator.
        self.generators: dict[tuple[int, torch.device], tuple[int, torch.Generator]] = {}


_STREAMS: weakref.WeakKeyDictionary[Any, _ReplicaStreams] = weakref.WeakKeyDictionary()
_STREAMS_LOCK = threading.Lock()
_INSTALLED: dict[str, Any] = {}


def replica_generator(device: Any = None) -> torch.Generator | None:
    """The running replica's generator; None outside `strategy.run` or with one replica.

    Pass it explicitly (`generator=`) to draw from the replica's stream in code the
    wrappers do not cover.

    Args:
        device: the device the draw happens on (torch needs a CUDA generator for CUDA
            tensors); default the CPU. Each device has its own stream, seeded alike.
    """
    frame = context.current_frame()
    if frame is None or frame.replica_context is None:
        return None
    strategy = frame.strategy
    if strategy.num_replicas_in_sync == 1:
        return None  # one replica races with nobody: torch's own generator, as without run
    streams = _STREAMS.get(strategy)
    if streams is None:
        with _STREAMS_LOCK:
            streams = _STREAMS.setdefault(strategy, _ReplicaStreams())
    run = getattr(strategy, "_runs", 0)
    replica = frame.replica_context.replica_id_in_sync_group
    where = torch.device(device) if device is not None else _CPU
    if str(where) == "cuda":  # no index: the current CUDA device
        where = torch.device("cuda", torch.cuda.current_device())
    key = (replica, where)
    entry = streams.generators.get(key)
    if entry is not None and entry[0] == run:
        return entry[1]
    with streams.lock:
        if streams.run != run:
            # One draw from the global generator per run that draws at all.
            streams.seed = int(
                _ORIGINAL_RANDINT(0, 2**62, (1,), generator=torch.default_generator).item()
            )
            streams.run = run
        seed = (streams.seed + _MIX * (replica + 1)) % (2**63)
    generator = entry[1] if entry is not None else torch.Generator(device=where)
    generator.manual_seed(seed)
    streams.generators[key] = (run, generator)
    return generator


_ORIGINAL_RANDINT: Callable[..., Any] = torch.randint
_CPU: Final = torch.device("cpu")


def _draw_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Where a draw happens: its `device=`, else its first tensor's, else torch's default."""
    device = kwargs.get("device")
    if device is not None:
        return device
    for arg in args[:1]:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return torch.get_default_device()


def _with_generator(original: Callable[..., Any]) -> Callable[..., Any]:
    def draw(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("generator") is None:
            generator = replica_generator(_draw_device(args, kwargs))
            if generator is not None:
                kwargs["generator"] = generator
        return original(*args, **kwargs)

    draw.__doc__ = original.__doc__
    draw.__name__ = getattr(original, "__name__", "draw")
    draw.__wrapped__ = original  # type: ignore[attr-defined]
    return draw


def _dropout_like(original: Callable[..., Any], feature: bool) -> Callable[..., Any]:
    def dropout(
        input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        generator = replica_generator(input.device) if training else None
        if generator is None or p == 0.0:
            return original(input, p, training, inplace)
        if p < 0.0 or p > 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if feature and input.dim() >= 2:
            # One draw per channel: (N, C, 1, ...) (or (C, 1, ...) unbatched).
            batched = input.dim() >= 3
            lead = 2 if batched else 1
            shape = (*input.shape[:lead], *([1] * (input.dim() - lead)))
        else:
            shape = tuple(input.shape)
        if p == 1.0:
            mask = torch.zeros(shape, dtype=input.dtype, device=input.device)
        else:
            keep = torch.empty(shape, dtype=input.dtype, device=input.device)
            mask = keep.bernoulli_(1.0 - p, generator=generator).div_(1.0 - p)
        if inplace:
            return input.mul_(mask)
        return input * mask

    dropout.__doc__ = original.__doc__
    dropout.__name__ = original.__name__
    dropout.__wrapped__ = original  # type: ignore[attr-defined]
    return dropout


def install() -> None:
    """Wrap torch's drawing functions once per process (see the module doc)."""
    if _INSTALLED:
        return
    with _STREAMS_LOCK:
        if _INSTALLED:
            return
        for name in _FUNCTIONS:
            original = getattr(torch, name)
            _INSTALLED[f"torch.{name}"] = original
            setattr(torch, name, _with_generator(original))
        for name in _METHODS:
            original = getattr(torch.Tensor, name)
            _INSTALLED[f"Tensor.{name}"] = original
            setattr(torch.Tensor, name, _with_generator(original))
        for name, feature in (
            ("dropout", False),
            ("dropout1d", True),
            ("dropout2d", True),
            ("dropout3d", True),
        ):
            original = getattr(functional, name)
            _INSTALLED[f"F.{name}"] = original
            setattr(functional, name, _dropout_like(original, feature))
