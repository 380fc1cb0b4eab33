"""Per-replica random streams for torch code inside `strategy.run`.

torch draws `torch.rand`, dropout masks and friends from one process-wide generator.
Replica threads drawing from it interleave by timing, so two runs seeded alike end with
different parameters, and cooperative replicas would all draw one stream in turn. Here,
inside a replica, a draw that names no generator uses the replica's own
`torch.Generator`. At the first draw of each `strategy.run`, one seed is taken from
torch's global generator (so `torch.manual_seed` governs everything), and replica `r`'s
generator is seeded from it and `r`'s global replica id. Replicas thus draw different
masks, and two runs seeded alike give bitwise the same draws whatever the thread timing.

Inside a replica, torch's random *state* is the replica's too: `torch.get_rng_state` /
`set_rng_state` (and `torch.cuda`'s, per device) read and set the running replica's
generator, and `torch.manual_seed` seeds it, so `torch.random.fork_rng` and activation
checkpointing (which saves the state at forward and restores it to recompute) replay the
replica's own draws, and no replica thread touches another's state or the global one.

torch has no thread-local generator, so the module-level functions and `Tensor`
methods that draw are replaced process-wide while a strategy with several replicas is
in use (`torch_patches`; outside replicas, and with one replica, they call torch
unchanged): `torch.rand`, `randn`, `randint`, `randperm`, `rand_like`, `randn_like`,
`randint_like`, `bernoulli`, `multinomial`, `normal`, `poisson`; the in-place
`Tensor.uniform_`, `normal_`, `bernoulli_`, `random_`, `exponential_`, `geometric_`,
`log_normal_`, `cauchy_`; `torch.nn.functional.dropout`, `dropout1d/2d/3d`, which
take no generator and are computed here from a replica-drawn mask; and the state
functions above. Other random operators (`alpha_dropout`, `rrelu`, attention dropout)
still use the global generator. Code that `torch.compile` compiled draws from torch's
own generator (the replacements step aside while dynamo traces): replicas still draw
different values, but on replica threads which replica gets which depends on timing.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final

import torch
from torch.nn import functional

from crossdevice._arrays import torch_patches
from crossdevice._core import context

__all__ = ["replica_generator"]

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
_DROPOUTS: Final = (
    ("dropout", False),
    ("dropout1d", True),
    ("dropout2d", True),
    ("dropout3d", True),
)
_MIX: Final = 0x9E3779B97F4A7C15
_is_compiling: Final = torch.compiler.is_compiling
_proxy_mode: Callable[[], Any]
try:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode as _proxy_mode
except ImportError:  # pragma: no cover - a torch without it traces only through dynamo
    _proxy_mode = type(None)


def _is_tracing() -> bool:
    """Whether torch is building a graph: a replica's generator cannot go into one.

    Dynamo (`torch.compiler.is_compiling`), and `make_fx`'s proxy mode, which dynamo's
    flag does not cover: inductor traces its replacement patterns with it the first time
    a replica's compiled module runs, and torch 2.11's `randperm` pattern then failed
    with "argument of type: <class 'torch._C.Generator'>".
    """
    return _is_compiling() or _proxy_mode() is not None


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
        if kwargs.get("generator") is None and not _is_tracing():
            generator = replica_generator(_draw_device(args, kwargs))
            if generator is not None:
                kwargs["generator"] = generator
        return original(*args, **kwargs)

    return _named(draw, original)


def _dropout_like(original: Callable[..., Any], feature: bool) -> Callable[..., Any]:
    def dropout(
        input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        generator = replica_generator(input.device) if training and not _is_tracing() else None
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

    return _named(dropout, original)


def _state_getter(original: Callable[..., Any], cuda: bool) -> Callable[..., Any]:
    def get_rng_state(*args: Any, **kwargs: Any) -> Any:
        generator = _state_generator(args, kwargs, cuda)
        if generator is not None:
            return generator.get_state()
        return original(*args, **kwargs)

    return _named(get_rng_state, original)


def _state_setter(original: Callable[..., Any], cuda: bool) -> Callable[..., Any]:
    def set_rng_state(new_state: Any, *args: Any, **kwargs: Any) -> Any:
        generator = _state_generator(args, kwargs, cuda)
        if generator is not None:
            generator.set_state(new_state)
            return None
        return original(new_state, *args, **kwargs)

    return _named(set_rng_state, original)


def _seeder(original: Callable[..., Any]) -> Callable[..., Any]:
    def manual_seed(seed: Any) -> Any:
        generator = _state_generator((), {}, False)
        if generator is not None:
            # The replica's streams (CPU and any device it drew on) restart from `seed`.
            return _reseed_replica(int(seed))
        return original(seed)

    return _named(manual_seed, original)


def _state_generator(args: tuple[Any, ...], kwargs: dict[str, Any], cuda: bool) -> Any:
    if _is_tracing():
        return None
    if not cuda:
        return replica_generator(None)
    device = kwargs.get("device", args[0] if args else "cuda")
    if isinstance(device, int):
        device = torch.device("cuda", device)
    return replica_generator(device)


def _reseed_replica(seed: int) -> torch.Generator:
    frame = context.current_frame()
    assert frame is not None
    assert frame.replica_context is not None
    streams = _STREAMS[frame.strategy]
    replica = frame.replica_context.replica_id_in_sync_group
    cpu = None
    for (owner, _), (_, generator) in list(streams.generators.items()):
        if owner == replica:
            generator.manual_seed(seed)
            if generator.device.type == "cpu":
                cpu = generator
    assert cpu is not None  # _state_generator made the CPU one
    return cpu


def _named(wrapper: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    wrapper.__doc__ = original.__doc__
    wrapper.__name__ = getattr(original, "__name__", wrapper.__name__)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _patches() -> list[torch_patches.Patch]:
    patches = [torch_patches.Patch(lambda: torch, name, _with_generator) for name in _FUNCTIONS]
    patches += [
        torch_patches.Patch(lambda: torch.Tensor, name, _with_generator) for name in _METHODS
    ]
    for name, feature in _DROPOUTS:
        patches.append(
            torch_patches.Patch(
                lambda: functional, name, functools.partial(_dropout_like, feature=feature)
            )
        )
    for owner in (lambda: torch, lambda: torch.random):
        patches.append(
            torch_patches.Patch(
                owner, "get_rng_state", functools.partial(_state_getter, cuda=False)
            )
        )
        patches.append(
            torch_patches.Patch(
                owner, "set_rng_state", functools.partial(_state_setter, cuda=False)
            )
        )
        patches.append(torch_patches.Patch(owner, "manual_seed", _seeder))
    patches.append(
        torch_patches.Patch(
            lambda: torch.cuda, "get_rng_state", functools.partial(_state_getter, cuda=True)
        )
    )
    patches.append(
        torch_patches.Patch(
            lambda: torch.cuda, "set_rng_state", functools.partial(_state_setter, cuda=True)
        )
    )
    return patches


torch_patches.register(*_patches())
