"""`regroup` and `select_replica`: between per-replica structures and distributed values.

TF's rules (`distribute_utils.regroup`): structures are walked together (lists, tuples,
namedtuples, dicts); at each leaf, identical objects stay one plain object (except a
collective's result that every replica received only because we share its buffer, where
TF gives each replica a tensor of its own: `hand_out`'s `is_shared`), components of
one distributed variable become that variable, and anything else is wrapped in a
`PerReplica` (or the given class). A structure mismatch raises `StructureMismatchError`
naming both structures: an AssertionError, as in TF, and a ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from crossdevice._arrays.handout import is_shared
from crossdevice._core import nest
from crossdevice._values.values import DistributedValues, PerReplica
from crossdevice._values.variables import Variable

__all__ = ["regroup", "select_replica"]


def _regroup_leaf(
    components: Sequence[Any],
    wrap_class: type[DistributedValues],
    always_wrap: bool,
    devices: Sequence[str] | None,
) -> Any:
    first = components[0]
    if (
        all(c is first for c in components)
        and (not always_wrap or isinstance(first, Variable | DistributedValues))
        and not is_shared(first)
    ):
        return first
    if isinstance(first, Variable) and not type(first)._is_distributed_variable:
        # A component of a distributed variable (distributed variables have no container).
        container = first._distributed_container
        if container is not None and all(
            isinstance(c, Variable) and c._distributed_container is container for c in components
        ):
            return container
    if devices is not None and type(devices) is tuple and len(devices) == len(components):
        # The strategy's own canonical device tuple: skip re-validating it every step.
        return wrap_class._from_parts(tuple(components), devices)
    return wrap_class(components, devices)


#: Types optree treats as nodes; anything else is a leaf (None is a leaf: `nest`).
_NODE_TYPES = (list, tuple, dict)


#: Types that are always leaves, checked before asking optree (which costs ~1 us a call).
_LEAF_TYPES = (type(None), int, float, bool, str, np.ndarray)

#: Leaf base classes (NumPy scalars are `np.float32`, `np.int64`, ...: subclasses).
_LEAF_BASES = (np.ndarray, np.generic)


def _is_leaf(x: Any) -> bool:
    if type(x) in _LEAF_TYPES or isinstance(x, _LEAF_BASES):
        return True
    return not isinstance(x, _NODE_TYPES) and not nest.is_registered_node(x)


def regroup(
    per_replica: Sequence[Any],
    wrap_class: type[DistributedValues] = PerReplica,
    always_wrap: bool = False,
    devices: Sequence[str] | None = None,
) -> Any:
    """Turn one structure per replica into one structure of distributed values.

    Args:
        per_replica: a structure per replica, all of the same structure.
        wrap_class: the class for leaves that differ across replicas.
        always_wrap: wrap identical leaves too (variables are never wrapped).
        devices: the devices of the replicas (default: see `DistributedValues`).

    Returns:
        A structure whose leaves are plain objects, distributed variables or
        `wrap_class` instances.
    """
    if len(per_replica) == 1 and not always_wrap:
        # One replica: regroup unwraps, as TF's regroup does for 1-tuples.
        return per_replica[0]
    if all(_is_leaf(tree) for tree in per_replica):
        # The common case (None, an array, a number): no tree to walk.
        return _regroup_leaf(per_replica, wrap_class, always_wrap, devices)
    structure, columns = nest.flatten_columns(
        per_replica,
        lambda first, i, spec: (
            "replicas returned different structures; every replica must return the "
            f"same structure. Replica 0: {first}, replica {i}: {spec}"
        ),
    )
    regrouped = [_regroup_leaf(column, wrap_class, always_wrap, devices) for column in columns]
    return nest.unflatten(structure, regrouped)


def select_replica(replica_id: int, structure: Any) -> Any:
    """The component of replica `replica_id` of each non-variable distributed value.

    `validate.fits_strategy` first where the values come from user code (a `merge_fn`).
    """

    def select(x: Any) -> Any:
        if isinstance(x, DistributedValues) and not isinstance(x, Variable):
            return x.values[replica_id]
        return x

    return nest.map_structure(select, structure)
