"""Nested structures through optree (dicts, lists, tuples, namedtuples).

`None` is a leaf, as in `tf.nest`; distributed values and variables are leaves because
they are not registered as nodes. optree's own structure-mismatch errors reach the user.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import optree

from crossdevice._core.errors import StructureMismatchError

__all__ = [
    "assert_same_structure",
    "flatten",
    "flatten_columns",
    "is_registered_node",
    "map_structure",
    "plain_leaves",
    "structure_repr",
    "unflatten",
]

_KW: dict[str, Any] = {"none_is_leaf": True, "namespace": "crossdevice"}

#: Exact types optree never walks into and that are never distributed values or
#: variables (those are classes of their own). torch's `Tensor` joins once torch is
#: imported (`plain_leaves`).
_PLAIN_TYPES: set[type] = {np.ndarray, int, float, complex, bool, str, bytes, type(None)}


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """Leaves of `tree` in a fixed order (dict keys sorted) and its structure."""
    return optree.tree_flatten(tree, **_KW)


def flatten_columns(
    trees: Sequence[Any], mismatch: Callable[[Any, int, Any], str]
) -> tuple[Any, list[tuple[Any, ...]]]:
    """Flatten same-structured trees; return the structure and the leaves column by column.

    Column k holds leaf k of every tree, in the order of `trees`.

    Raises:
        StructureMismatchError: (a ValueError and an AssertionError, as TF's `regroup`
            asserts) `mismatch(structure_0, i, structure_i)` for the first tree `i` whose
            structure differs from the first tree's.
    """
    flats = []
    structure = None
    for i, tree in enumerate(trees):
        leaves, spec = flatten(tree)
        if structure is None:
            structure = spec
        elif spec != structure:
            raise StructureMismatchError(mismatch(structure, i, spec))
        flats.append(leaves)
    return structure, list(zip(*flats, strict=True))


def structure_repr(tree: Any) -> str:
    """The text of `tree`'s structure, leaves aside: equal text, equal nest.

    `structure_repr({"a": 1, "b": 2}) != structure_repr([1, 2])`; it is what workers
    compare (through a digest) before reducing nests together.
    """
    return repr(optree.tree_structure(tree, **_KW))


def plain_leaves(items: Iterable[Any]) -> bool:
    """Whether every item is a leaf of a plain type (an array, a tensor, a number, ...).

    Such items hold no distributed value: `strategy.run`'s arguments (`args=(batch,)`)
    then need no flatten to know that (about 3 us a step on the dev VM). False is no
    verdict: the caller flattens. Exact types only, so no subclass (a user's array type
    registered as a node) passes.
    """
    for item in items:
        if type(item) not in _PLAIN_TYPES:
            torch = sys.modules.get("torch")
            tensor = getattr(torch, "Tensor", None)
            if tensor is None or tensor in _PLAIN_TYPES:
                return False
            _PLAIN_TYPES.add(tensor)  # torch was imported since: its tensors are leaves
            if type(item) is not tensor:
                return False
    return True


def unflatten(structure: Any, leaves: list[Any]) -> Any:
    """Rebuild a structure from `flatten`'s leaves."""
    return optree.tree_unflatten(structure, leaves)


def map_structure(fn: Callable[..., Any], tree: Any, *rests: Any) -> Any:
    """Apply `fn` to corresponding leaves of same-structured trees."""
    return optree.tree_map(fn, tree, *rests, **_KW)


def is_registered_node(x: Any) -> bool:
    """Whether optree would walk into `x` (a registered container type, e.g. a deque)."""
    return not optree.tree_is_leaf(x, **_KW)


def assert_same_structure(a: Any, b: Any) -> None:
    """Raise ValueError when `a` and `b` differ in structure, naming both."""
    sa = optree.tree_structure(a, **_KW)
    sb = optree.tree_structure(b, **_KW)
    if sa != sb:
        raise ValueError(f"Tree structure mismatch; expected: {sa}, got: {sb}.")
