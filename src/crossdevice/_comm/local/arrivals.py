"""What a replica brings to a collective round, and whether the replicas' arrivals agree.

A `ThreadCommunicator` turns each replica's inputs into a `CollectiveArrival`: its values,
their host NumPy views (`host_view`), their (shape, dtype) signature and which of them are
torch tensors. The last replica to arrive checks that the arrivals agree (`validate`):
the same structure, reduce op, shapes and dtypes for an all-reduce, compatible shapes for
an all-gather, one root for a broadcast. A disagreement is an error message naming both
sides, raised in every replica.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final, Protocol

import numpy as np

from crossdevice._arrays import is_torch
from crossdevice._arrays.numpy_backend import NUMPY
from crossdevice._comm.local.host_reduce import Plan, describe_sig
from crossdevice._core.purpose import current as current_purpose
from crossdevice._core.reduce_op import ReduceOp

__all__ = [
    "NUMERIC_KINDS",
    "ONE_NUMPY",
    "Call",
    "CollectiveArrival",
    "host_view",
    "no_torch",
    "validate",
]


class Call(Protocol):
    """The call the arrivals were made for, as error messages name it (a `Round` is one)."""

    @property
    def name(self) -> str:
        """Who reports: the rendezvous' name, or the function's."""

    @property
    def seq(self) -> int:
        """The call's number."""

    def describe_calls(self) -> str:
        """What each replica called."""


#: What a collective made outside any `purpose` block is, as the mismatch names it.
_PLAIN: Final = "a collective the step function made, of values that do not require grad"

#: dtype kinds NumPy adds on the host fast path.
NUMERIC_KINDS: Final = frozenset("iufc")


@dataclasses.dataclass(slots=True)
class CollectiveArrival:
    """What one replica brought to a collective round (`ThreadCommunicator`)."""

    kind: str
    values: list[Any]
    #: host NumPy views of `values` (C-contiguous), or None when some value is not a
    #: host array NumPy can add (CUDA or bfloat16 tensors, bool or object arrays).
    arrays: list[np.ndarray] | None
    #: ((shape, dtype), ...) for validation and planning.
    sig: tuple[Any, ...]
    #: which values are torch tensors (results follow each replica's own library).
    torch_mask: tuple[bool, ...]
    op: ReduceOp | None = None
    plan: Plan | None = None
    #: per dtype group: this replica's packed small arrays (or None).
    packs: list[np.ndarray | None] | None = None
    extra: Any = None
    #: the nest structure the arrays were flattened from (None: a flat list).
    structure: Any = None
    handler: Any = None
    #: what the collective is for (`_core/purpose.py`, read on the arriving replica's
    #: thread): "" for the step function's own, else the library's or autograd's words.
    label: str = dataclasses.field(default_factory=current_purpose)


def host_view(value: Any) -> tuple[Any, np.ndarray | None, bool]:
    """(value as an array, its C-contiguous host NumPy view or None, is_torch)."""
    if type(value) is np.ndarray:
        arr = value
    elif is_torch(value):
        t = value.detach()
        if t.device.type != "cpu" or str(t.dtype) not in _TORCH_NUMPY_DTYPES:
            return value, None, True
        arr = t.resolve_conj().resolve_neg().numpy()
        value = t
    else:
        value = NUMPY.asarray(value)
        arr = value
    if arr.dtype.kind not in NUMERIC_KINDS:
        return value, None, is_torch(value)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return value, arr, is_torch(value)


def validate(rnd: Call, arrivals: list[CollectiveArrival]) -> str | None:
    """Whether the replicas' arrivals agree: None, or what differs (for a ValueError)."""
    first = arrivals[0]
    if first.kind == "all_reduce":
        # The per-step case, every replica agreeing: one pass (the messages below say
        # what differs).
        op, sig, structure, label = first.op, first.sig, first.structure, first.label
        for a in arrivals:
            if a.op is not op or a.sig != sig or a.structure != structure or a.label != label:
                break
        else:
            return None
    name = rnd.name
    if any(a.label != first.label for a in arrivals):
        # Collectives made for different things meet (a replica's backward pass of a
        # differentiable all_reduce with another's all_reduce): combining them is wrong
        # whatever their shapes.
        doing = "; ".join(f"replica {r}: {a.label or _PLAIN}" for r, a in enumerate(arrivals))
        return (
            f"{name}: {first.kind} #{rnd.seq}: the replicas were making different "
            f"collectives ({doing}; {rnd.describe_calls()}). Every replica must make the "
            "same collectives in the same order."
        )
    if any(a.structure != first.structure for a in arrivals):
        return (
            f"{name}: {first.kind} #{rnd.seq}: the replicas passed different nest "
            f"structures: {rnd.describe_calls()}. Every replica must pass the "
            "same structure."
        )
    if first.kind == "all_reduce":
        for r, a in enumerate(arrivals):
            if a.op is not first.op:
                return (
                    f"{name}: all_reduce #{rnd.seq}: replica 0 reduces with "
                    f"{first.op} but replica {r} with {a.op}; use one reduce op "
                    f"everywhere ({rnd.describe_calls()})."
                )
            if a.sig != first.sig:
                return _sig_mismatch(name, rnd, first, r, a)
        return None
    if first.kind == "broadcast":
        root = first.extra
        for r, a in enumerate(arrivals):
            if a.extra != root:
                return (
                    f"{name}: broadcast #{rnd.seq}: replica 0 broadcasts from root "
                    f"{root} but replica {r} from root {a.extra}; use one root everywhere."
                )
        if not arrivals[root].values:
            return (
                f"{name}: broadcast #{rnd.seq}: the root replica {root} passed "
                "None; expected the array to broadcast."
            )
        expected = arrivals[root].sig
        for r, a in enumerate(arrivals):
            if a.values and a.sig != expected:
                return (
                    f"{name}: broadcast #{rnd.seq}: expected every replica's "
                    f"array to match the root's {describe_sig(expected)}, but replica {r} "
                    f"passed {describe_sig(a.sig)}; pass None or a matching array."
                )
        return None
    return _validate_gather(name, rnd, arrivals)


def _sig_mismatch(
    name: str, rnd: Call, first: CollectiveArrival, r: int, a: CollectiveArrival
) -> str:
    head = f"{name}: all_reduce #{rnd.seq}:"
    if len(a.sig) != len(first.sig):
        return (
            f"{head} expected {len(first.sig)} arrays (as replica 0 passed) but replica "
            f"{r} passed {len(a.sig)}; every replica must reduce the same structure."
        )
    for i, (want, got) in enumerate(zip(first.sig, a.sig, strict=True)):
        if want != got:
            return (
                f"{head} array {i}: expected shape {want[0]!r} dtype {want[1]!s} (as "
                f"replica 0 passed) but replica {r} passed shape {got[0]!r} dtype "
                f"{got[1]!s}; every replica must pass the same shapes and dtypes."
            )
    return f"{head} replica {r}'s arrays differ from replica 0's"  # pragma: no cover


def _validate_gather(name: str, rnd: Call, arrivals: list[CollectiveArrival]) -> str | None:
    head = f"{name}: all_gather #{rnd.seq}:"
    axis = arrivals[0].extra
    shape0, dtype0 = arrivals[0].sig[0]
    for r, a in enumerate(arrivals):
        if a.extra != axis:
            return (
                f"{head} replica 0 gathers along axis {axis} but replica {r} along "
                f"axis {a.extra}; use one axis everywhere."
            )
    if isinstance(axis, bool) or not isinstance(axis, int):
        return f"{head} axis must be an int, received {axis!r}"
    ndim = len(shape0)
    if ndim == 0:
        return (
            f"{head} cannot gather 0-d (scalar) values along axis {axis}; expected "
            "arrays with at least one dimension (reshape scalars to [1])."
        )
    if not -ndim <= axis < ndim:
        return f"{head} axis {axis} is out of range for arrays of shape {shape0!r}"
    axis %= ndim
    for r, a in enumerate(arrivals):
        shape, dtype = a.sig[0]
        if dtype != dtype0:
            return (
                f"{head} expected dtype {dtype0!s} (as replica 0 passed) but replica {r} "
                f"passed {dtype!s}; every replica must gather the same dtype."
            )
        if len(shape) != ndim or any(
            d != e for k, (d, e) in enumerate(zip(shape, shape0, strict=True)) if k != axis
        ):
            return (
                f"{head} shapes may differ along axis {axis} only, but replica 0 passed "
                f"shape {shape0!r} and replica {r} passed shape {shape!r}."
            )
    arrivals[0].extra = axis
    for a in arrivals:
        a.extra = axis
    return None


_NO_TORCH: dict[int, tuple[bool, ...]] = {}


def no_torch(n: int) -> tuple[bool, ...]:
    """`(False,) * n`, cached (the result key of an all-NumPy arrival)."""
    mask = _NO_TORCH.get(n)
    if mask is None:
        mask = _NO_TORCH[n] = (False,) * n
    return mask


ONE_NUMPY: Final = no_torch(1)


_TORCH_NUMPY_DTYPES: Final = frozenset(
    f"torch.{name}"
    for name in (
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
    )
)
