"""A fake CUDA for CPU-only machines: tensors that say they live on `cuda:i`.

`fake_cuda(n)` makes a CPU build of torch report `n` CUDA devices. A tensor created on
`cuda:i` (a factory with `device=`, `.to("cuda:i")`, `.cuda()`) is a CPU tensor of the
subclass `FakeCudaTensor` whose `.device` is `cuda:i`. What real CUDA enforces, it enforces:

* an operation mixing two devices, or a device and a non-scalar CPU tensor, raises
  `RuntimeError: Expected all tensors to be on the same device`;
* `.numpy()` and `np.asarray` of a device tensor raise (`.cpu()` first, as on CUDA);
* NCCL (`torch.cuda.nccl.all_reduce/reduce/broadcast`) refuses two tensors on one device,
  and sums bool and float8 tensors as uint8 bit patterns, as `nccl.cpp` does;
* streams are ordered: every operation runs on its thread's current stream of the
  device; reading a tensor last written on another stream that this stream has not
  waited for (an event, `wait_stream`, a device synchronisation) raises `FakeCudaRaceError`.

What happens is counted in `FakeCuda.counts`: `"H2D"`, `"D2H"`, `"D2D"` copies (pageable
uploads add a `"sync"`, pinned non-blocking ones do not), host `"sync"`s (`.item()`,
`.cpu()`, `torch.cuda.synchronize()`), `"nccl_all_reduce"`, `"nccl_reduce"`,
`"nccl_broadcast"`, arithmetic passes by op name (`"op:div"`, `"op:cat"`, ...), and
`"set_device"`, `"record_stream"`.

It is a test double, not an emulator: kernels run at once on the CPU. It exists so that
placement, copy counts, synchronisations and stream ordering of the GPU paths can be
tested in CI, which has no GPU.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import torch
import torch.cuda.nccl
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["FakeCuda", "FakeCudaRaceError", "FakeCudaTensor", "fake_cuda"]


class FakeCudaRaceError(RuntimeError):
    """A stream read a tensor that another stream wrote, with nothing ordering the two."""


_STATE: FakeCuda | None = None


def _state() -> FakeCuda:
    if _STATE is None:  # pragma: no cover - a tensor outliving its harness
        raise RuntimeError("a FakeCudaTensor was used outside fake_cuda()")
    return _STATE


class FakeStream:
    """`torch.cuda.Stream` of the fake: a device, an id and a vector clock."""

    _ids = itertools.count()

    def __init__(self, device: Any = None, priority: int = 0, *, _default: bool = False) -> None:
        del priority
        self.device_index = _state().index_of(device)
        self.stream_id = 0 if _default else next(FakeStream._ids) + 1
        self.clock = 0
        self.seen: dict[int, int] = {}  # stream key -> clock of it this stream waited for

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    @property
    def key(self) -> int:
        return id(self)

    def tick(self) -> tuple[int, int]:
        self.clock += 1
        self.seen[self.key] = self.clock
        return (self.key, self.clock)

    def knows(self, writer: tuple[int, int]) -> bool:
        return self.seen.get(writer[0], 0) >= writer[1]

    def merge(self, seen: dict[int, int]) -> None:
        for key, clock in seen.items():
            if self.seen.get(key, 0) < clock:
                self.seen[key] = clock

    def wait_event(self, event: FakeEvent) -> None:
        self.merge(event.seen)

    def wait_stream(self, stream: FakeStream) -> None:
        self.merge(stream.seen)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _state().host_sync(self)

    def query(self) -> bool:
        return True

    def __enter__(self) -> FakeStream:  # `with stream:` is not torch API, kept simple
        raise TypeError("use torch.cuda.stream(s) to make a stream current")

    def __repr__(self) -> str:
        return f"<FakeStream {self.stream_id} on cuda:{self.device_index}>"


class FakeEvent:
    """`torch.cuda.Event` of the fake: a snapshot of a stream's clock."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ):
        del enable_timing, blocking, interprocess
        self.seen: dict[int, int] = {}

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or _state().current_stream()
        stream.tick()
        self.seen = dict(stream.seen)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or _state().current_stream()).wait_event(self)

    def synchronize(self) -> None:
        _state().counts["sync"] += 1

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: FakeEvent) -> float:
        return 0.0


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on `cuda:{_fake_index}`."""

    _fake_index: int

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return torch.device("cuda", self._fake_index)

    @property  # type: ignore[override]
    def is_cuda(self) -> bool:
        return True

    def get_device(self) -> int:  # type: ignore[override]
        return self._fake_index

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return _tag(torch._C.TensorBase.data.__get__(self), self._fake_index)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if not isinstance(value, FakeCudaTensor):
            raise RuntimeError("fake_cuda: moving a device tensor's .data to the host")
        torch._C.TensorBase.data.__set__(self, value)
        self._fake_index = value._fake_index

    def __deepcopy__(self, memo: dict[int, Any]) -> FakeCudaTensor:
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        with torch._C.DisableTorchFunctionSubclass():
            data = self.detach().clone()
        out = _tag(data.requires_grad_(self.requires_grad), self._fake_index)
        memo[id(self)] = out
        for key, value in self.__dict__.items():  # `_is_param` makes it a Parameter
            if key != "_fake_index":
                setattr(out, key, copy.deepcopy(value, memo))
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _state().dispatch(func, args, kwargs or {})


def _tag(t: torch.Tensor, index: int) -> FakeCudaTensor:
    with torch._C.DisableTorchFunctionSubclass():
        if t.requires_grad and t.grad_fn is None:  # a leaf stays a leaf
            out = torch.Tensor._make_subclass(FakeCudaTensor, t.detach(), True)
        else:
            out = t.as_subclass(FakeCudaTensor)
    out._fake_index = index
    return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


def _storage_key(t: torch.Tensor) -> int:
    """The address of `t`'s memory; 0 for an empty tensor (no memory, nothing to race on)."""
    with torch._C.DisableTorchFunctionSubclass():
        storage = t.untyped_storage()
        return int(storage.data_ptr()) if storage.nbytes() else 0


_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "rand",
    "randn",
    "randint",
    "arange",
    "linspace",
    "tensor",
    "as_tensor",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "empty_strided",
    "eye",
)

_NCCL_OPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
_NCCL_AS_UINT8 = {torch.bool} | {
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
}
_NCCL_UNSUPPORTED = {
    torch.complex64,
    torch.complex128,
    torch.int16,
    torch.uint16,
    torch.uint32,
    torch.uint64,
}


class FakeCuda:
    """The state of one `fake_cuda()` block; see the module docstring."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.counts: collections.Counter[str] = collections.Counter()
        self.writers: dict[int, tuple[int, int]] = {}
        self.stream_names: dict[int, str] = {}
        self.stream_devices: dict[int, int] = {}
        self.local = threading.local()
        self.lock = threading.RLock()
        self._patches: list[tuple[Any, str, Any]] = []
        self.default_streams: list[FakeStream] = []
        # Storages of device tensors adopted by parameters (`param.data = t`, which is how
        # Module.to() moves parameters and keeps their identity), with their device.
        self.adopted: dict[int, int] = {}
        self._keep: list[torch.Tensor] = []

    # --- devices and streams ----------------------------------------------------------
    def current_index(self) -> int:
        return getattr(self.local, "device", 0)

    def index_of(self, device: Any) -> int:
        if device is None:
            return self.current_index()
        if isinstance(device, int):
            index = device
        else:
            d = torch.device(device)
            if d.type != "cuda":
                raise ValueError(f"expected a CUDA device, got {device!r}")
            index = d.index if d.index is not None else self.current_index()
        if not 0 <= index < self.n:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (fake_cuda({self.n}))")
        return index

    def current_stream(self, device: Any = None) -> FakeStream:
        index = self.index_of(device)
        streams = getattr(self.local, "streams", None)
        if streams is None:
            streams = self.local.streams = {}
        return streams.get(index) or self.default_streams[index]

    def set_stream(self, stream: FakeStream) -> None:
        streams = getattr(self.local, "streams", None)
        if streams is None:
            streams = self.local.streams = {}
        streams[stream.device_index] = stream

    def host_sync(self, stream: FakeStream | None = None) -> None:
        self.counts["sync"] += 1

    # --- reads and writes -------------------------------------------------------------
    def read(self, t: torch.Tensor, stream: FakeStream) -> None:
        key = _storage_key(t)
        writer = self.writers.get(key) if key else None
        if writer is not None and writer[0] != stream.key and not stream.knows(writer):
            raise FakeCudaRaceError(
                f"{stream!r} read a tensor on cuda:{stream.device_index} that "
                f"{self.stream_names.get(writer[0], 'another stream')} wrote, without waiting "
                "for it (an event, wait_stream or synchronize)"
            )

    def write(self, t: torch.Tensor, stream: FakeStream) -> None:
        self.stream_names[stream.key] = repr(stream)
        self.stream_devices[stream.key] = stream.device_index
        key = _storage_key(t)
        clock = stream.tick()
        if key:
            self.writers[key] = clock

    def adopt(self, t: torch.Tensor, index: int) -> FakeCudaTensor:
        """Tag a tensor that torch made natively (autograd's gradients, `.data` aliases).

        Its memory may have been another device's before: a writer on another device is
        stale, and the tensor counts as written by this thread's stream of its device.
        """
        tagged = _tag(t, index)
        writer = self.writers.get(_storage_key(t))
        if writer is None or self.stream_devices.get(writer[0]) != index:
            self.write(tagged, self.current_stream(index))
        return tagged

    # --- dispatch of operations on fake tensors ---------------------------------------
    def dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        name = getattr(func, "__name__", str(func))
        if name in _NO_KERNEL:  # metadata: no memory read, nothing to check or tag
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        special = getattr(self, f"_t_{name}", None)
        if special is not None and name in _SPECIAL:
            return special(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        fakes = [a for a in flat if isinstance(a, FakeCudaTensor)]
        devices = {a._fake_index for a in fakes}
        device_kw = kwargs.get("device")
        others = []
        for a in flat:
            if isinstance(a, torch.Tensor) and not isinstance(a, FakeCudaTensor):
                index = self.device_index(a)
                if index is not None:
                    devices.add(index)
                elif a.dim() > 0:
                    others.append(a)
        if name in _META or not fakes:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return self._wrap_attr(name, args, out)
        if len(devices) > 1 or (others and name not in _HOST_OK):
            seen = sorted(f"cuda:{d}" for d in devices) + (["cpu"] if others else [])
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two "
                f"devices, {seen[0]} and {seen[1]}! (fake_cuda, in {name})"
            )
        index = devices.pop()
        generator = kwargs.get("generator")
        if generator is not None and getattr(generator, "fake_index", None) != index:
            raise RuntimeError(
                f"Expected a 'cuda' device type for generator but found "
                f"'{generator.device}' (fake_cuda, in {name} on cuda:{index})"
            )
        if device_kw is not None:
            kwargs = dict(kwargs)
            target = torch.device(device_kw)
            kwargs.pop("device")
            if target.type == "cuda":
                index = self.index_of(target)
        stream = self.current_stream(index)
        for a in fakes:
            self.read(a, stream)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if name not in _VIEWS and any(isinstance(x, torch.Tensor) for x in tree_flatten(out)[0]):
            self.counts[f"op:{name}"] += 1  # a kernel launch (passes over memory)
        identity = {id(a) for a in fakes}

        def wrap(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and id(x) not in identity:
                x = _tag(x, index)
            if isinstance(x, torch.Tensor):
                self.write(x, stream)
            return x

        if name.endswith("_") or "out" in kwargs:
            for a in fakes[:1]:
                self.write(a, stream)
        return tree_map(wrap, out)

    def _wrap_attr(self, name: str, args: Any, out: Any) -> Any:
        # `.grad`, `.data`: autograd stores plain tensors; give them their owner's device.
        owner = args[0] if args else None
        if (
            isinstance(owner, FakeCudaTensor)
            and isinstance(out, torch.Tensor)
            and not isinstance(out, FakeCudaTensor)
        ):
            return self.adopt(out, owner._fake_index)
        return out

    def _t_to(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        return self.move(
            x, device, dtype=dtype, non_blocking=bool(non_blocking), copy=bool(kwargs.get("copy"))
        )

    def _t_cuda(self, x: Any, device: Any = None, non_blocking: bool = False, **_: Any) -> Any:
        return self.move(x, torch.device("cuda", self.index_of(device)), non_blocking=non_blocking)

    def _t_cpu(self, x: Any, **_: Any) -> Any:
        return self.move(x, torch.device("cpu"))

    def _t_numpy(self, x: Any, **_: Any) -> Any:
        raise TypeError(
            f"can't convert cuda:{x._fake_index} device type tensor to numpy. Use Tensor.cpu() "
            "to copy the tensor to host memory first."
        )

    def _t___array__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        self._t_numpy(x)

    def _t_item(self, x: Any) -> Any:
        self.read(x, self.current_stream(x._fake_index))
        self.counts["sync"] += 1
        with torch._C.DisableTorchFunctionSubclass():
            return x.item()

    def _t___bool__(self, x: Any) -> Any:
        return bool(self._t_item(x))

    def _t___float__(self, x: Any) -> Any:
        return float(self._t_item(x))

    def _t___int__(self, x: Any) -> Any:
        return int(self._t_item(x))

    def _t_tolist(self, x: Any) -> Any:
        self.read(x, self.current_stream(x._fake_index))
        self.counts["sync"] += 1
        with torch._C.DisableTorchFunctionSubclass():
            return x.tolist()

    def _t_pin_memory(self, x: Any, *args: Any) -> Any:
        raise RuntimeError(
            "cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned"
        )

    def _t_is_pinned(self, x: Any, *args: Any) -> bool:
        return False

    def _t_backward(self, *args: Any, **kwargs: Any) -> None:
        # Tensor.backward(gradient, ...) or torch.autograd.backward(tensors, grad_tensors,
        # ...): run it NOT under DisableTorchFunctionSubclass, because gradient hooks run
        # inside backward and the tensors they touch must still say where they live.
        if "gradient" in kwargs:
            kwargs["grad_tensors"] = kwargs.pop("gradient")

        def plain(x: Any) -> Any:  # the same graph, without the subclass's dispatch
            return _plain(x) if isinstance(x, FakeCudaTensor) else x

        args, kwargs = tree_map(plain, (args, kwargs))
        torch.autograd.backward(*args, **kwargs)

    def _t_record_stream(self, x: Any, stream: Any) -> None:
        self.counts["record_stream"] += 1

    def _t_copy_(self, dst: Any, src: Any, non_blocking: bool = False) -> Any:
        if isinstance(dst, FakeCudaTensor):
            moved = self.move(src, dst.device, dtype=dst.dtype, non_blocking=non_blocking)
            stream = self.current_stream(dst._fake_index)
            with torch._C.DisableTorchFunctionSubclass():
                dst.copy_(moved)
            self.write(dst, stream)
            return dst
        moved = self.move(src, torch.device("cpu"), dtype=dst.dtype, non_blocking=non_blocking)
        with torch._C.DisableTorchFunctionSubclass():
            return dst.copy_(moved)

    def move(
        self,
        x: torch.Tensor,
        device: torch.device | None,
        *,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
        copy: bool = False,
    ) -> torch.Tensor:
        """`x.to(device, dtype)` between fake devices and the host, counted."""
        src = x._fake_index if isinstance(x, FakeCudaTensor) else None
        if device is None:
            dst = src
        elif device.type == "cuda":
            dst = self.index_of(device)
        else:
            dst = None
        with torch._C.DisableTorchFunctionSubclass():
            nbytes = x.numel() * x.element_size()
            data = x.to(dtype) if dtype is not None else x
            if src == dst and data is x and not copy:
                return x
            if data is x:
                data = data.clone()
        if src is None and dst is None:
            return _plain(data)
        if src is not None:
            self.read(x, self.current_stream(src))
        if src is None:
            self.counts["H2D"] += 1
            self.counts["H2D_bytes"] += nbytes
            if not (non_blocking and getattr(x, "_fake_pinned", False)):
                self.counts["sync"] += 1  # pageable or blocking: cudaStreamSynchronize
            out = _tag(data, dst)  # type: ignore[arg-type]
            self.write(out, self.current_stream(dst))
            return out
        if dst is None:
            self.counts["D2H"] += 1
            if not non_blocking:
                self.counts["sync"] += 1
            return _plain(data)
        if src != dst:
            self.counts["D2D"] += 1
            self.counts["D2D_bytes"] += nbytes
            # Copy.cu: the copy runs on the source's stream after the destination's, and
            # the destination's stream then waits for it.
            src_stream, dst_stream = self.current_stream(src), self.current_stream(dst)
            src_stream.merge(dst_stream.seen)
            out = _tag(data, dst)
            self.write(out, src_stream)
            dst_stream.merge(src_stream.seen)
            return out
        out = _tag(data, dst)
        self.write(out, self.current_stream(dst))
        return out

    # --- NCCL -------------------------------------------------------------------------
    def _nccl_check(self, tensors: list[Any], what: str) -> list[int]:
        indices = []
        for t in tensors:
            if not isinstance(t, FakeCudaTensor):
                raise TypeError(
                    f"NCCL {what}: expected CUDA tensors, got {type(t).__name__} on {t.device}"
                )
            if not t.is_contiguous():
                raise ValueError(f"NCCL {what}: tensors must be contiguous")
            if t.dtype in _NCCL_UNSUPPORTED:
                raise TypeError(f"Unconvertible NCCL type {t.dtype}")
            indices.append(t._fake_index)
        if len(set(indices)) != len(indices):
            raise RuntimeError(
                f"NCCL {what}: duplicate GPU in {indices}: NCCL needs one tensor per distinct "
                "device (invalid usage)"
            )
        for t in tensors:
            self.read(t, self.current_stream(t._fake_index))
        return indices

    def _nccl_combine(self, tensors: list[Any], op: int) -> torch.Tensor:
        plain = [_plain(t) for t in tensors]
        if tensors[0].dtype in _NCCL_AS_UINT8:
            plain = [p.view(torch.uint8) for p in plain]  # nccl.cpp: bool/fp8 -> ncclUint8
        stacked = torch.stack(
            [p.to(torch.float64) if p.dtype.is_floating_point else p for p in plain]
        )
        kind = _NCCL_OPS[op]
        if kind == "sum":
            out = stacked.sum(0)
        elif kind == "avg":
            out = stacked.sum(0) / len(plain)
        elif kind == "prod":
            out = stacked.prod(0)
        elif kind == "max":
            out = stacked.max(0).values
        else:
            out = stacked.min(0).values
        out = out.to(plain[0].dtype)
        if tensors[0].dtype in _NCCL_AS_UINT8:
            out = out.view(tensors[0].dtype)
        return out

    def nccl_all_reduce(
        self, inputs: Any, outputs: Any = None, op: int = 0, streams: Any = None, comms: Any = None
    ) -> None:
        inputs = list(inputs)
        self._nccl_check(inputs, "all_reduce")
        self.counts["nccl_all_reduce"] += 1
        total = self._nccl_combine(inputs, op)
        for t in list(outputs) if outputs is not None else inputs:
            with torch._C.DisableTorchFunctionSubclass():
                t.copy_(total)
            self.write(t, self.current_stream(t._fake_index))

    def nccl_reduce(
        self,
        inputs: Any,
        output: Any = None,
        root: int = 0,
        op: int = 0,
        streams: Any = None,
        comms: Any = None,
    ) -> None:
        inputs = list(inputs)
        self._nccl_check(inputs, "reduce")
        self.counts["nccl_reduce"] += 1
        target = output if output is not None else inputs[root]
        with torch._C.DisableTorchFunctionSubclass():
            target.copy_(self._nccl_combine(inputs, op))
        self.write(target, self.current_stream(target._fake_index))

    def nccl_broadcast(
        self, inputs: Any, root: int = 0, streams: Any = None, comms: Any = None
    ) -> None:
        inputs = list(inputs)
        self._nccl_check(inputs, "broadcast")
        self.counts["nccl_broadcast"] += 1
        source = _plain(inputs[root]).clone()
        for t in inputs:
            with torch._C.DisableTorchFunctionSubclass():
                t.copy_(source)
            self.write(t, self.current_stream(t._fake_index))

    # --- installation -----------------------------------------------------------------
    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patches.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    def install(self) -> None:
        # crossdevice replaces some of torch's functions while a strategy is in use
        # (torch_patches); hold them in force while the fake is, and patch over them, so
        # that uninstalling the fake puts crossdevice's replacements back, not torch's.
        from crossdevice._arrays import torch_guard, torch_patches, torch_random  # noqa: F401

        torch_patches.require(self)
        cuda = torch.cuda
        state = self

        class device:  # noqa: N801 - torch.cuda.device
            def __init__(self, device: Any) -> None:
                self.index = -1 if device is None or device == -1 else state.index_of(device)

            def __enter__(self) -> None:
                self.prev = state.current_index()
                if self.index >= 0:
                    state.local.device = self.index

            def __exit__(self, *exc: object) -> None:
                state.local.device = self.prev

        @contextlib.contextmanager
        def stream(s: FakeStream | None) -> Iterator[None]:
            if s is None:
                yield
                return
            prev_device = state.current_index()
            prev = state.current_stream(s.device_index)
            state.local.device = s.device_index
            state.set_stream(s)
            try:
                yield
            finally:
                state.set_stream(prev)
                state.local.device = prev_device

        def set_device(d: Any) -> None:
            state.counts["set_device"] += 1
            state.local.device = state.index_of(d)

        def synchronize(device: Any = None) -> None:
            state.counts["sync"] += 1
            index = state.index_of(device)
            everything: dict[int, int] = {}
            for s in [*state.default_streams, *FakeStreamRegistry.all]:
                everything.update({k: max(v, everything.get(k, 0)) for k, v in s.seen.items()})
            for s in [*state.default_streams, *FakeStreamRegistry.all]:
                if s.device_index == index:
                    s.merge(everything)

        class FakeStreamRegistry(FakeStream):
            all: ClassVar[list[FakeStream]] = []

            def __init__(self, device: Any = None, priority: int = 0, **kw: Any) -> None:
                super().__init__(device, priority, **kw)
                FakeStreamRegistry.all.append(self)

        real_generator = torch.Generator

        class FakeGenerator(real_generator):  # type: ignore[misc, valid-type]
            """`torch.Generator(device="cuda:i")`: a CPU generator that says it is cuda:i."""

            def __new__(cls, device: Any = "cpu") -> Any:
                target = torch.device(device)
                generator = real_generator.__new__(cls)
                generator.fake_index = state.index_of(target) if target.type == "cuda" else None
                return generator

            def __init__(self, device: Any = "cpu") -> None:
                super().__init__()

            @property
            def device(self) -> torch.device:
                index = self.fake_index
                return torch.device("cuda", index) if index is not None else torch.device("cpu")

        self._patch(torch, "Generator", FakeGenerator)
        patches: dict[str, Any] = {
            "is_available": lambda: True,
            "device_count": lambda: state.n,
            "current_device": state.current_index,
            "set_device": set_device,
            "device": device,
            "Stream": FakeStreamRegistry,
            "Event": FakeEvent,
            "current_stream": state.current_stream,
            "default_stream": lambda device=None: state.default_streams[state.index_of(device)],
            "stream": stream,
            "set_stream": state.set_stream,
            "synchronize": synchronize,
            "is_initialized": lambda: True,
            "get_device_name": lambda device=None: "fake_cuda",
            # No graph is ever captured here; a CUDA build of torch would ask the driver
            # (torch's optimizers check it once CUDA is available).
            "is_current_stream_capturing": lambda: False,
        }
        for name, value in patches.items():
            self._patch(cuda, name, value)
        self.default_streams = [FakeStream(i, _default=True) for i in range(self.n)]
        nccl = torch.cuda.nccl
        self._patch(nccl, "all_reduce", self.nccl_all_reduce)
        self._patch(nccl, "reduce", self.nccl_reduce)
        self._patch(nccl, "broadcast", self.nccl_broadcast)
        self._patch(nccl, "is_available", lambda tensors: True)
        self._patch(nccl, "version", lambda: (2, 21, 5))
        if not hasattr(torch._C, "_nccl_all_reduce"):
            self._patch(torch._C, "_nccl_all_reduce", self.nccl_all_reduce)
        for name in _FACTORIES:
            self._patch(torch, name, self._factory(getattr(torch, name)))
        tensor_to, tensor_cuda, tensor_pin, tensor_is_pinned = (
            torch.Tensor.to,
            torch.Tensor.cuda,
            torch.Tensor.pin_memory,
            torch.Tensor.is_pinned,
        )

        def to(x: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(x, FakeCudaTensor):
                return tensor_to(x, *args, **kwargs)
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
            if device is not None and device.type == "cuda":
                return state.move(x, device, dtype=dtype, non_blocking=bool(non_blocking))
            return tensor_to(x, *args, **kwargs)

        def to_cuda(x: Any, device: Any = None, non_blocking: bool = False, **kw: Any) -> Any:
            if isinstance(x, FakeCudaTensor):
                return tensor_cuda(x, device, non_blocking, **kw)
            return state.move(
                x, torch.device("cuda", state.index_of(device)), non_blocking=non_blocking
            )

        def pin_memory(x: Any, *args: Any) -> Any:
            if isinstance(x, FakeCudaTensor):
                return tensor_pin(x, *args)
            state.counts["pin_memory"] += 1
            out = x.clone()
            out._fake_pinned = True
            return out

        def is_pinned(x: Any, *args: Any) -> bool:
            if isinstance(x, FakeCudaTensor):
                return bool(tensor_is_pinned(x, *args))
            return bool(getattr(x, "_fake_pinned", False))

        def record_stream(x: Any, stream: Any) -> None:
            if not isinstance(stream, FakeStream):
                raise TypeError(f"record_stream expects a CUDA stream, got {stream!r}")
            if state.device_index(x) != stream.device_index:
                raise RuntimeError("record_stream: the stream is on another device")
            state.counts["record_stream"] += 1

        self._patch(torch.Tensor, "record_stream", record_stream)
        self._patch(torch.Tensor, "to", to)
        self._patch_parameters()
        self._patch(torch.Tensor, "cuda", to_cuda)
        self._patch(torch.Tensor, "pin_memory", pin_memory)
        self._patch(torch.Tensor, "is_pinned", is_pinned)
        _clear_caches()

    def device_index(self, t: torch.Tensor) -> int | None:
        """The fake device of `t`, or None for a host tensor."""
        if isinstance(t, FakeCudaTensor):
            return t._fake_index
        if self.adopted:
            return self.adopted.get(_storage_key(t))
        return None

    def _patch_parameters(self) -> None:
        """`param.data = device_tensor` (Module.to) makes the parameter a device tensor."""
        state = self
        real_data = torch._C.TensorBase.data
        real_device = torch._C.TensorBase.device

        def get_data(p: Any) -> Any:
            alias = real_data.__get__(p)
            index = state.device_index(p)
            return state.adopt(alias, index) if index is not None else alias

        def set_data(p: Any, value: Any) -> None:
            real_data.__set__(p, value)
            if isinstance(value, FakeCudaTensor):
                state.adopted[_storage_key(p)] = value._fake_index
                state._keep.append(value)  # the storage must not be reused by the host

        def device(p: Any) -> torch.device:
            index = state.device_index(p)
            return torch.device("cuda", index) if index is not None else real_device.__get__(p)

        real_grad = torch._C.TensorBase.grad

        def get_grad(p: Any) -> Any:
            grad = real_grad.__get__(p)
            index = state.device_index(p)
            if grad is None or index is None or isinstance(grad, FakeCudaTensor):
                return grad
            return state.adopt(grad, index)

        def set_grad(p: Any, value: Any) -> None:
            real_grad.__set__(p, value)

        parameter = torch.nn.Parameter
        self._patch(parameter, "grad", property(get_grad, set_grad))
        self._patch(parameter, "data", property(get_data, set_data))
        self._patch(parameter, "device", property(device))
        self._patch(parameter, "is_cuda", property(lambda p: state.device_index(p) is not None))

    def _factory(self, original: Any) -> Any:
        state = self

        like = original.__name__.endswith("_like")

        def factory(*args: Any, **kwargs: Any) -> Any:
            device = kwargs.get("device")
            if device is None and like and args and isinstance(args[0], torch.Tensor):
                index = state.device_index(args[0])
                if index is not None:  # a parameter: its device, as on CUDA
                    device = kwargs["device"] = torch.device("cuda", index)
            if device is None:
                return original(*args, **kwargs)
            target = (
                torch.device(device)
                if not isinstance(device, int)
                else torch.device("cuda", device)
            )
            if target.type != "cuda":
                return original(*args, **kwargs)
            kwargs = dict(kwargs)
            kwargs["device"] = "cpu"
            pin = kwargs.pop("pin_memory", False)
            del pin
            with torch._C.DisableTorchFunctionSubclass():
                out = original(
                    *[_plain(a) if isinstance(a, FakeCudaTensor) else a for a in args], **kwargs
                )
            if any(
                isinstance(a, np.ndarray | torch.Tensor) and not isinstance(a, FakeCudaTensor)
                for a in args
            ):
                state.counts["H2D"] += 1
                state.counts["sync"] += 1
            index = state.index_of(target)
            out = _tag(out, index)
            state.write(out, state.current_stream(index))
            return out

        factory.__name__ = getattr(original, "__name__", "factory")
        return factory

    def uninstall(self) -> None:
        for owner, name, old in reversed(self._patches):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._patches.clear()
        _clear_caches()
        from crossdevice._arrays import torch_patches

        torch_patches.release(self)


_MISSING = object()
_SPECIAL = {
    "backward",
    "__bool__",
    "__float__",
    "__int__",
    "to",
    "cuda",
    "cpu",
    "numpy",
    "__array__",
    "item",
    "tolist",
    "pin_memory",
    "is_pinned",
    "record_stream",
    "copy_",
}
#: Metadata queries: answered at once, without the device rules.
_NO_KERNEL = {
    "numel",
    "element_size",
    "dim",
    "size",
    "stride",
    "storage_offset",
    "is_contiguous",
    "data_ptr",
    "untyped_storage",
    "is_floating_point",
    "is_complex",
    "__len__",
    "nelement",
    "ndimension",
    "is_leaf",
    "requires_grad",
    "dtype",
    "shape",
}
#: Operations that make views or read metadata: no kernel, not counted as passes.
_VIEWS = {
    "view",
    "reshape",
    "split",
    "detach",
    "__getitem__",
    "as_strided",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "expand",
    "view_as",
    "reshape_as",
    "t",
    "transpose",
    "permute",
    "narrow",
    "select",
    "unbind",
    "chunk",
    "untyped_storage",
    "requires_grad_",
}
#: Operations that accept a CPU tensor next to device tensors (indexing with CPU indices).
_HOST_OK = {"__getitem__", "__setitem__", "index_select", "__eq__", "__ne__"}
#: Attribute access and type queries: no kernel, no device rule.
_META = {"__get__", "__set__", "_has_compatible_shallow_copy_type", "is_same_size"}


def _clear_caches() -> None:
    from crossdevice._cross_device import destinations, nccl

    nccl.nccl_status.cache_clear()
    destinations._check_cached.cache_clear()


@contextlib.contextmanager
def fake_cuda(n: int = 4) -> Iterator[FakeCuda]:
    """Pretend torch has `n` CUDA devices for the duration of the block (one at a time)."""
    global _STATE
    if _STATE is not None:
        raise RuntimeError("fake_cuda() blocks do not nest")
    state = FakeCuda(n)
    _STATE = state
    try:
        state.install()
        yield state
    finally:
        state.uninstall()
        _STATE = None
