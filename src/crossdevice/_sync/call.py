"""`CallSignature`: what one collective call is, as its peers must agree on it.

Peers that meet in a collective must have asked for the same thing: the same kind of call,
the same reduce op (or gather axis), the same nest structure, the same leaves' shapes and
dtypes, and across workers the same line of the user's program. The in-process rendezvous
compares signatures (`==`, with a gather's axis left out of the shapes) and shows them in
its error messages (`describe`); the worker fingerprints carry their digests
(`shapes_digest`, `structure_digest`), so both sides check one description of a call.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from typing import Any

from crossdevice._core import nest

__all__ = ["CallSignature", "describe_leaves", "digest"]


def digest(value: object) -> int:
    """A 56-bit digest of `repr(value)`: equal in every process for equal values."""
    data = hashlib.blake2b(repr(value).encode(), digest_size=7).digest()
    return int.from_bytes(data, "little")


@functools.lru_cache(maxsize=1024)
def _cached_digest(value: tuple[object, ...]) -> int:
    return digest(value)


def cached_digest(value: tuple[object, ...]) -> int:
    """`digest` of a tuple, remembered when it is hashable (a training step's repeat)."""
    try:
        return _cached_digest(value)
    except TypeError:  # an unhashable part: digest it afresh
        return digest(value)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class CallSignature:
    """One collective call, as every peer must make it.

    Attributes:
        kind: `"all_reduce"`, `"all_gather"`, `"merge_call"`, ...
        argument: the reduce op's name or the gather axis, as text (`"SUM"`, `"axis=0"`).
        structure: the nest structure the leaves came from (an optree spec), or None.
        leaves: (shape, dtype) of each leaf, in order.
        axis: a gather's axis: sizes along it may differ between peers.
        site: the user's line that made the call (file, function, line), when known.
    """

    kind: str
    argument: str = ""
    structure: Any = None
    leaves: tuple[tuple[Any, Any], ...] = ()
    axis: int | None = None
    site: object = None

    @property
    def key(self) -> tuple[Any, ...]:
        """What peers compare: everything but the sizes along a gather's axis."""
        leaves = self.leaves
        if self.axis is not None:
            leaves = tuple((_without_axis(shape, self.axis), str(dt)) for shape, dt in leaves)
        else:
            leaves = tuple((tuple(shape), str(dt)) for shape, dt in leaves)
        return (self.kind, self.argument, self.structure, leaves, self.site)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CallSignature) and self.key == other.key

    def __hash__(self) -> int:
        return hash((self.kind, self.argument, len(self.leaves)))

    def describe(self) -> str:
        """`all_reduce(SUM, {'a': float32[3]})`, or the kind alone for a call without leaves."""
        if not self.leaves:
            return self.kind
        return f"{self.kind}({self.argument}, {describe_leaves(self.leaves, self.structure)})"

    def shapes_digest(self) -> int:
        """Digest of the leaves' shapes and dtypes, for a worker fingerprint."""
        return cached_digest(tuple((tuple(shape), str(dt)) for shape, dt in self.leaves))

    def structure_digest(self) -> int:
        """Digest of the nest structure and the call site, for a worker fingerprint."""
        structure = None if self.structure is None else repr(self.structure)
        return cached_digest((structure, self.site))


def _without_axis(shape: Sequence[Any], axis: int) -> tuple[Any, ...]:
    """`shape` with the gather axis blanked: sizes may differ there (a partial batch)."""
    if not -len(shape) <= axis < len(shape):
        return tuple(shape)
    return tuple(None if k == axis % len(shape) else d for k, d in enumerate(shape))


def describe_leaves(sig: Sequence[tuple[Any, Any]], structure: Any = None) -> str:
    """`float32[3]` for one leaf, `[float32[3], int64[]]` for several, in `structure`'s shape.

    Args:
        sig: (shape, dtype) per leaf.
        structure: the nest's structure (an optree spec or a `nest.Structure`, whose
            `note` says where it differs from a peer's that prints alike), or None for a
            flat list.
    """
    leaves = [_Leaf(f"{dtype}{list(shape)}") for shape, dtype in sig]
    if structure is not None:
        try:
            return repr(nest.unflatten(structure, leaves)) + getattr(structure, "note", "")
        except (ValueError, TypeError):  # pragma: no cover - a spec that does not fit
            pass
    if len(leaves) == 1:
        return repr(leaves[0])
    return repr(leaves)


class _Leaf:
    """Shows a leaf's signature without quotes inside a nest's repr."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text
