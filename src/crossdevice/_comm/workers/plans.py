"""`ReducePlan`: what an all-reduce's arguments decide, made once per kind of call.

A training step repeats its all-reduces: the same kinds of values (type, dtype, shape),
the same options, the same donation. Everything those decide (the wire dtypes, the
layout, this worker's part of the fingerprint, MEAN's divisor, how results come back)
is worked out once by the communicator's general path and kept here, so a repeated
call only wraps its values (`torch.from_numpy`, `detach`) and sends them: measured on
the 2-worker Gloo path, about 50 us of Python per call less.

Only values that travel as they are get a plan: C-contiguous writeable NumPy arrays and
contiguous host torch tensors whose dtype a process group carries natively, none of
them empty. Anything else (a copy, a widened or viewed dtype, a CUDA tensor, an empty
buffer) takes the general path every time, so a plan never changes what a call sends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import torch

from crossdevice._comm.protocol import ReduceOptions
from crossdevice._comm.workers.fingerprint import ReductionPrints
from crossdevice._comm.workers.speculation import Predictor
from crossdevice._comm.workers.transport import Layout, host_layout
from crossdevice._comm.workers.wire import Wire, describe_site, describe_wires, divide, donation

__all__ = [
    "AS_IS",
    "AS_NUMPY",
    "CONVERT",
    "MAX_PLANS",
    "VIEW",
    "ReducePlan",
    "ReducePlans",
    "make_plan",
]


#: How a plan makes a value's result from its flat output (`ReducePlan.how`).
AS_NUMPY: Final = 0
AS_IS: Final = 1
VIEW: Final = 2
CONVERT: Final = 3

#: Plans kept per communicator (a step has a handful of distinct all-reduces); the table
#: is emptied when full.
MAX_PLANS: Final = 256


@dataclasses.dataclass(frozen=True, slots=True)
class ReducePlan:
    """One kind of all-reduce call, as the general path worked it out.

    Attributes:
        options: the call's `options` argument itself (kept: the key holds its id).
        opts: the `ReduceOptions` it stands for.
        count: MEAN's divisor, None for SUM.
        wires: each value's `Wire` (a kept plan's hold empty tensors: only their dtype,
            kind, device and shape are read).
        ours: per value, whether it is ours to reduce in place (donated).
        layout: the host layout (None: not predicted).
        own: the layout this worker sends.
        sizes: each value's element count.
        template: the encoded fingerprint, sequence number 0.
        history: what the predictor learns of this call when every worker's header is
            this one (`Predictor.history`: the sequence number is left out).
        how: per value, how its result is made from the transport's flat output:
            `AS_NUMPY` (a NumPy view: a host NumPy value sent in its own dtype), `AS_IS`
            (the output itself: a 1-D torch value sent in its own dtype, on its own
            device), `VIEW` (the output in the value's shape: such a value of any other
            shape), `CONVERT` (`Wire.result`: anything else).
    """

    options: Any
    opts: ReduceOptions
    count: float | None
    wires: tuple[Wire, ...]
    ours: tuple[bool, ...]
    layout: Layout | None
    own: Layout
    sizes: list[int]
    template: np.ndarray
    history: bytes
    how: tuple[int, ...]

    def describe(self) -> str:
        """The call's buffers and where it came from, for mismatch messages."""
        site = "" if self.opts.signature is None else describe_site(self.opts.signature.site)
        return f"{describe_wires(self.wires)}{'; ' if site else ''}{site}"

    def tensors(self, values: Sequence[Any]) -> list[torch.Tensor]:
        """The values' memory as flat tensors, as the general path would send them."""
        return [
            torch.from_numpy(v.reshape(-1)) if w.kind == "numpy" else v.detach().view(-1)
            for v, w in zip(values, self.wires, strict=True)
        ]

    def results(self, outputs: list[torch.Tensor]) -> list[Any]:
        """The values the caller gets, from the transport's flat `outputs`.

        `outputs` are the non-empty buffers'; an empty one comes back as its own wire's.
        """
        sums = iter(outputs)
        # NumPy results of their own wire dtype are NumPy views (the work after a wait runs
        # with cold caches, where each torch call costs several times what NumPy's does).
        # A transport's outputs are flat and exactly as long as their values.
        reduced: list[Any] = []
        for w, n, how in zip(self.wires, self.sizes, self.how, strict=True):
            out = next(sums) if n else w.tensor.view(w.shape)  # empty: never the input
            if how == AS_NUMPY:
                reduced.append(out.numpy().reshape(w.shape))
            elif how == AS_IS:
                reduced.append(out)
            elif how == VIEW:
                reduced.append(out.view(w.shape))
            else:
                reduced.append(w.result(out.view(w.shape)))
        count = self.count
        return reduced if count is None else [divide(r, count) for r in reduced]


def make_plan(
    values: Sequence[Any],
    options: Any,
    donate: bool | Sequence[bool],
    fills: bool,
    local: int,
    world_size: int,
    prints: ReductionPrints,
    to_wire: Callable[[Any], Wire],
) -> tuple[ReducePlan, list[torch.Tensor]]:
    """The general path: (the plan of this call, its values as the flat tensors to send).

    Checks the arguments (`donation`) and converts every value (`wire.to_wire`: a copy
    where a process group cannot take its memory as it is).
    """
    opts = ReduceOptions.of(options)
    count = opts.divide_by(world_size)
    donated = donation(values, donate, fills)
    wires = [to_wire(v) for v in values]
    sizes = [w.tensor.numel() for w in wires]
    # A copy made on the way (a non-contiguous or read-only input) is ours too.
    ours = tuple(d or w.owned for w, d, n in zip(wires, donated, sizes, strict=True) if n)
    tensors = [w.tensor.reshape(-1) for w, n in zip(wires, sizes, strict=True) if n]
    layout = host_layout(tensors)
    own = tuple((t.dtype, t.numel()) for t in tensors)
    template = prints.all_reduce(opts, wires, tensors, layout, local)
    history = Predictor.history([template] * world_size)
    how = tuple(_how(w) for w in wires)
    plan = ReducePlan(
        options,
        opts,
        count,
        tuple(wires),
        ours,
        layout,
        own,
        sizes,
        template,
        history,
        how,
    )
    return plan, tensors


def _how(wire: Wire) -> int:
    """How a plan makes `wire`'s result from its flat output (`ReducePlan.how`)."""
    same = wire.tensor.dtype == wire.dtype and wire.tensor.device.type == "cpu"
    if same and wire.kind == "numpy":
        return AS_NUMPY
    if same and wire.kind == "torch" and wire.tensor.device == wire.device:
        return AS_IS if len(wire.shape) == 1 else VIEW
    return CONVERT


class ReducePlans:
    """A communicator's plans, by kind of call (see the module doc)."""

    def __init__(self) -> None:
        self._plans: dict[Any, ReducePlan] = {}

    @staticmethod
    def key(values: Sequence[Any], options: Any, donate: Any, fills: bool, local: int) -> Any:
        """The key of a call whose values travel as they are, else None (no plan)."""
        kinds: list[tuple[Any, ...]] = []
        for v in values:
            t = type(v)
            if t is np.ndarray:
                layout = v.flags
                if not (layout.c_contiguous and layout.writeable) or not v.size:
                    return None
                kinds.append((v.dtype, v.shape))
            elif t is torch.Tensor or t is torch.nn.Parameter:
                if v.is_cuda or not v.is_contiguous() or not v.numel():
                    return None
                kinds.append((v.dtype, v.shape, v.device))
            else:
                return None
        opts = id(options) if type(options) is ReduceOptions else options
        donated = donate if type(donate) is bool else tuple(donate)
        return (opts, donated, fills, local, *kinds)

    def get(self, key: Any, options: Any) -> ReducePlan | None:
        """The plan of `key`, made for this very `options` object, or None."""
        plan = self._plans.get(key)
        if plan is None or (plan.options is not options and type(options) is ReduceOptions):
            return None
        return plan

    def keep(self, key: Any, plan: ReducePlan) -> None:
        """Remember `plan` for calls of `key` (only plans of values sent as they are).

        The plan keeps no memory of the call that made it (its wires' tensors are
        replaced by empty ones).
        """
        if any(w.owned or w.tensor.dtype != w.dtype for w in plan.wires):
            return
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        wires = tuple(
            dataclasses.replace(w, tensor=torch.empty(0, dtype=w.tensor.dtype)) for w in plan.wires
        )
        self._plans[key] = dataclasses.replace(plan, wires=wires)
