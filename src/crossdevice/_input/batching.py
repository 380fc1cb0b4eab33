"""Splitting one global batch across replicas: pure functions over nests of arrays.

The rule (what TF's `experimental_distribute_dataset` does, measured with TF 2.15 and
2.21 on 2, 3 and 4 replicas, full and short batches, drop_remainder True and False,
static and unknown batch sizes): a batch of `B` examples over `N` replicas gives each
replica, in order, `ceil(B / N)` examples, and the last ones what is left, possibly
nothing. So a batch of 7 over 3 replicas splits 3/3/1, a batch of 4 over 3 splits 2/2/0,
and 10 examples in batches of 4 over 3 replicas give `[0,1]/[2,3]/[]`, `[4,5]/[6,7]/[]`,
`[8]/[9]/[]`. A short last batch is split by the same rule on its own size (a last
batch of 6 with global batch 8 over 2 replicas: 3/3). A replica left without examples
gets an empty slice (leading dimension 0, same dtype and trailing shape), as TF's
partial-batch handling does.

(Our docs said before that TF splits 7 over 3 as 3/2/2, the balanced sizes of its
`batch_sizes_for_worker`, and that a short last batch fills replicas in order (6 with
global batch 8 over 2 replicas as 4/2). TF computes those sizes, but what its
distributed dataset hands the replicas is the per-batch `ceil(B / N)` split above, the
one of its `_LegacyRebatchDataset`.) `strategy.reduce(MEAN, per_replica_losses, axis=0)`
is the mean over the global batch either way; a mean of per-replica means is TF's.

Every worker reads the same global batches and keeps global replicas
`[w*R, (w+1)*R)` of the split (`replica_ids`).

Slices are views of the input arrays (NumPy and torch both slice without copying).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import optree

from crossdevice._arrays import is_torch

__all__ = [
    "batch_size_of",
    "last_split",
    "split_batch",
    "split_batch_leaves",
    "split_bounds",
    "split_sizes",
]

# The same nest conventions as `crossdevice._core.nest` (None is a leaf, our namespace),
# with paths so that errors can name the offending component.
_NEST_KW: dict[str, Any] = {"none_is_leaf": True, "namespace": "crossdevice"}


#: Per thread: the leaves and size of the last batch `split_batch_leaves` split (`last_split`).
_LAST = threading.local()


def split_sizes(batch_size: int, num_replicas: int) -> tuple[int, ...]:
    """How many examples each of `num_replicas` replicas gets from a batch of `batch_size`.

    Args:
        batch_size: the number of examples in the global batch (>= 0).
        num_replicas: the number of replicas across all workers (>= 1).

    Returns:
        `num_replicas` sizes that add up to `batch_size`: `ceil(batch_size /
        num_replicas)` each, in replica order, until the examples run out (TF's split).

    Example:
        >>> split_sizes(7, 3)
        (3, 3, 1)
        >>> split_sizes(6, 4)
        (2, 2, 2, 0)
        >>> split_sizes(1, 2)
        (1, 0)
    """
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
    per_replica = -(-batch_size // num_replicas)  # ceil
    return tuple(
        max(0, min(batch_size - r * per_replica, per_replica)) for r in range(num_replicas)
    )


def split_bounds(batch_size: int, num_replicas: int) -> tuple[tuple[int, int], ...]:
    """`(start, stop)` of each replica's slice of a batch (see `split_sizes`).

    Example:
        >>> split_bounds(7, 3)
        ((0, 3), (3, 6), (6, 7))
    """
    bounds = []
    start = 0
    for size in split_sizes(batch_size, num_replicas):
        bounds.append((start, start + size))
        start += size
    return tuple(bounds)


def _format_path(path: tuple[Any, ...]) -> str:
    if not path:
        return "<batch>"
    return "batch" + "".join(f"[{key!r}]" for key in path)


def _leading_dim(leaf: Any, path: tuple[Any, ...], num_replicas: int) -> int:
    """The batch dimension of one component, or the error for a component without one."""
    if isinstance(leaf, np.ndarray) or is_torch(leaf):
        shape = tuple(leaf.shape)
        if shape:
            return int(shape[0])
        kind = f"a 0-d {type(leaf).__module__}.{type(leaf).__name__}"
    elif isinstance(leaf, np.generic | int | float | complex | bool):
        kind = f"a scalar {type(leaf).__name__}"
    else:
        raise TypeError(
            "every component of a global batch must be a NumPy array or a torch tensor "
            f"with a batch dimension; got {type(leaf).__name__} at {_format_path(path)}: "
            f"{leaf!r}. Convert it with numpy.asarray or drop it from the batch"
        )
    raise ValueError(
        f"Call the batch method on the input dataset in order to be able to split your "
        f"input across {num_replicas} replicas: expected every component of a global batch "
        f"to have a leading batch dimension, got {kind} at {_format_path(path)}: {leaf!r}. "
        "Batch the data first, e.g. [x[i:i + B] for i in range(0, len(x), B)] for a "
        "global batch size B (a list of numbers is a nest of scalars: wrap it in "
        "numpy.asarray)"
    )


def _flatten(batch: Any) -> tuple[list[tuple[Any, ...]], list[Any], Any]:
    paths, leaves, structure = optree.tree_flatten_with_path(batch, **_NEST_KW)
    return paths, leaves, structure


def _batch_size(paths: Sequence[tuple[Any, ...]], leaves: Sequence[Any], num_replicas: int) -> int:
    if not leaves:
        raise ValueError(
            "a global batch must contain at least one array to split across "
            f"{num_replicas} replicas, got an empty structure"
        )
    sizes = [
        _leading_dim(leaf, path, num_replicas) for path, leaf in zip(paths, leaves, strict=True)
    ]
    if any(size != sizes[0] for size in sizes):
        listing = ", ".join(
            f"{_format_path(path)}: {size}" for path, size in zip(paths, sizes, strict=True)
        )
        raise ValueError(
            "the components of a global batch disagree on the batch size (their leading "
            f"dimension): expected every component to have {sizes[0]} examples like "
            f"{_format_path(paths[0])}, got {listing}. Every component of a batch must hold "
            "the same examples; batch them together (e.g. zip features and labels before "
            "batching)"
        )
    return sizes[0]


def _common_leading_dim(leaves: Sequence[Any]) -> int | None:
    """The batch size when every leaf is an array with the same leading dimension, else None.

    The per-step case, without the paths that only an error needs (`_batch_size` then
    checks the batch again, with them).
    """
    torch = sys.modules.get("torch")
    size = None
    for leaf in leaves:
        if not (type(leaf) is np.ndarray or (torch is not None and type(leaf) is torch.Tensor)):
            return None
        if not leaf.ndim or (size is not None and leaf.shape[0] != size):
            return None
        size = leaf.shape[0]
    return size


def _flatten_sized(batch: Any, num_replicas: int) -> tuple[list[Any], Any, int]:
    """The batch's leaves, structure and batch size, after checking its components agree."""
    leaves, structure = optree.tree_flatten(batch, **_NEST_KW)
    size = _common_leading_dim(leaves)
    if size is None:  # something to explain, or a leaf of another kind: the full check
        paths, leaves, structure = _flatten(batch)
        size = _batch_size(paths, leaves, num_replicas)
    return leaves, structure, size


def batch_size_of(batch: Any, num_replicas: int = 1) -> int:
    """The number of examples in a global batch, after checking that its components agree.

    Args:
        batch: a nest (dict, list, tuple, namedtuple) of NumPy arrays or torch tensors.
        num_replicas: the number of replicas it will be split across (for the message).

    Returns:
        The common leading dimension of every component.

    Raises:
        ValueError: a component has no batch dimension (a scalar or 0-d array), the
            components disagree on the batch size, or the nest has no components.
        TypeError: a component is not an array.
    """
    return _flatten_sized(batch, num_replicas)[2]


def split_batch_leaves(
    batch: Any, num_replicas: int, replica_ids: Sequence[int] | None = None
) -> tuple[Any, list[tuple[Any, ...]], int]:
    """Split every component of a global batch across replicas.

    Args:
        batch: a nest of NumPy arrays or torch tensors sharing their leading dimension.
        num_replicas: the number of replicas across all workers.
        replica_ids: the global replicas whose slices to return (default: all), e.g.
            `range(w * R, (w + 1) * R)` on worker `w` with `R` local replicas.

    Returns:
        The nest's structure (for `optree.tree_unflatten`); per component in flattening
        order, a tuple with the slice of each requested replica; the batch size.

    Raises:
        ValueError, TypeError: see `batch_size_of`; also a replica id out of range.
    """
    leaves, structure, size = _flatten_sized(batch, num_replicas)
    bounds = split_bounds(size, num_replicas)
    ids = range(num_replicas) if replica_ids is None else replica_ids
    for replica in ids:
        if isinstance(replica, bool) or not isinstance(replica, int):
            raise ValueError(f"replica ids must be ints, got {replica!r} in {list(ids)!r}")
        if not 0 <= replica < num_replicas:
            raise ValueError(
                f"replica id {replica} is out of range for {num_replicas} replicas; "
                f"expected ids in [0, {num_replicas})"
            )
    sliced = [tuple(leaf[bounds[r][0] : bounds[r][1]] for r in ids) for leaf in leaves]
    _LAST.split = (leaves, size)
    return structure, sliced, size


def last_split(size: int) -> list[Any] | None:
    """The leaves of the global batch this thread split last, if it had `size` examples.

    Taken once (None after): the has-data agreement that follows each step's split
    (`_input/distributed.py`) digests the whole global batch the workers must share
    (`_input/agreement.py`). None where this thread split nothing since, or another size.
    """
    split = getattr(_LAST, "split", None)
    _LAST.split = None
    if split is None or split[1] != size:
        return None
    return list(split[0])


def split_batch(
    batch: Any, num_replicas: int, replica_ids: Sequence[int] | None = None
) -> list[Any]:
    """One nest per requested replica, holding that replica's slice of every component.

    Args:
        batch: a nest of NumPy arrays or torch tensors sharing their leading dimension.
        num_replicas: the number of replicas across all workers.
        replica_ids: the global replicas to return (default: all of them).

    Returns:
        A list with one nest (the structure of `batch`) per requested replica.

    Example:
        >>> import numpy as np
        >>> [part["x"].tolist() for part in split_batch({"x": np.arange(7)}, 3)]
        [[0, 1, 2], [3, 4, 5], [6]]
    """
    structure, sliced, _ = split_batch_leaves(batch, num_replicas, replica_ids)
    count = len(range(num_replicas) if replica_ids is None else replica_ids)
    return [
        optree.tree_unflatten(structure, [components[j] for components in sliced])
        for j in range(count)
    ]
