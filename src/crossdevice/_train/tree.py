"""A checkpoint's contents as JSON plus named arrays: no pickle, no format of our own.

`encode(state)` walks a nest of state (what `state_dict()` methods return: dicts, lists,
tuples, numbers, strings, None, NumPy arrays, torch tensors) and splits it into a
*skeleton* that JSON can hold and a flat dict of arrays, keyed by their dotted path
(`model.layers.0.weight`, `optimizer.state.0.exp_avg`: the keys torch's DCP gives the
same nest, so torch tools can read a model's tensors by their usual names). `decode`
puts them back together, with each array in the library it came from.

Skeleton nodes: JSON scalars and lists stand for themselves; a dict with string keys is
a JSON object; anything else is an object with one `$`-key: `{"$array": key, "lib":
"numpy"|"torch", "scalar": bool}`, `{"$tuple": [...]}`, `{"$dict": [[key, value], ...]}`
(int or non-plain keys, as optimizers have), `{"$bytes": base64}`.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Mapping
from typing import Any, Final

import numpy as np

from crossdevice._arrays import is_torch

__all__ = ["decode", "encode", "format_path"]

#: Dict keys that a JSON object may hold as-is (no "$" tags, no dots to confuse paths).
_PLAIN_KEY: Final = "$"


def format_path(path: tuple[Any, ...]) -> str:
    """The dotted key of an array at `path` (`("model", "fc.weight")` -> `model.fc.weight`)."""
    return ".".join(str(part) for part in path)


def encode(state: Any, path: tuple[Any, ...], arrays: dict[str, Any]) -> Any:
    """The skeleton of `state`; its arrays go into `arrays` under their dotted paths.

    Raises:
        TypeError: a value that is neither an array, a JSON scalar nor a container,
            named with its path.
        ValueError: two arrays would get the same key.
    """
    if isinstance(state, np.ndarray | np.generic) or is_torch(state):
        key = format_path(path)
        if not is_torch(state) and state.dtype.hasobject:
            # `.npz` would pickle it, and a checkpoint is read without pickle (nor can DCP
            # hold it): refused here, at save(), rather than found unreadable at restore.
            raise TypeError(
                f"cannot checkpoint {key or 'the state'}: a NumPy array of dtype "
                f"{state.dtype} (Python objects). A checkpoint holds arrays of numbers, bools, "
                "strings, bytes and datetimes, without pickle; convert it (e.g. "
                "`.astype(str)`, or a list of its values), or keep it out of the tracked state"
            )
        if key in arrays:
            raise ValueError(
                f"two arrays of the checkpoint would both be stored under {key!r}; give the "
                "objects (or their state_dict entries) names that stay distinct when joined "
                "with dots"
            )
        if isinstance(state, np.generic):
            arrays[key] = np.asarray(state)
            return {"$array": key, "lib": "numpy", "scalar": True}
        arrays[key] = state.detach() if is_torch(state) else state
        return {"$array": key, "lib": "torch" if is_torch(state) else "numpy", "scalar": False}
    if state is None or isinstance(state, bool | int | str):
        return state
    if isinstance(state, float):
        # JSON has no infinities or NaN: keep them as tagged strings.
        return state if math.isfinite(state) else {"$float": repr(state)}
    if isinstance(state, bytes):
        return {"$bytes": base64.b64encode(state).decode("ascii")}
    if isinstance(state, list):
        return [encode(item, (*path, i), arrays) for i, item in enumerate(state)]
    if isinstance(state, tuple):
        return {"$tuple": [encode(item, (*path, i), arrays) for i, item in enumerate(state)]}
    if isinstance(state, Mapping):
        plain = all(isinstance(k, str) and not k.startswith(_PLAIN_KEY) for k in state)
        for key in state:
            if type(key) not in (str, int):  # not bool, nor NumPy integers
                raise TypeError(
                    f"a checkpoint's dicts need str or int keys; {format_path(path) or 'the state'}"
                    f" has the key {key!r}. Return a state_dict with str or int keys"
                )
        if plain:
            return {key: encode(value, (*path, key), arrays) for key, value in state.items()}
        return {"$dict": [[key, encode(v, (*path, key), arrays)] for key, v in state.items()]}
    raise TypeError(
        f"cannot checkpoint {format_path(path) or 'the state'}: a {type(state).__name__} "
        f"({state!r}). A checkpoint holds arrays (NumPy, torch), numbers, strings, None, and "
        "lists, tuples and dicts of them; return those from state_dict()"
    )


def decode(skeleton: Any, arrays: Mapping[str, Any], convert: Callable[[Any, str], Any]) -> Any:
    """Rebuild the state that `encode` split; `convert(array, lib)` makes each array.

    Raises:
        ValueError: the skeleton names an array that `arrays` lacks, or is malformed.
    """
    if isinstance(skeleton, list):
        return [decode(item, arrays, convert) for item in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "$array" in skeleton:
        key = skeleton["$array"]
        if key not in arrays:
            raise ValueError(
                f"the checkpoint's index names the array {key!r} but its data has no such "
                "array: the checkpoint is damaged or incomplete"
            )
        value = convert(arrays[key], skeleton.get("lib", "numpy"))
        return value[()] if skeleton.get("scalar") else value
    if "$tuple" in skeleton:
        return tuple(decode(item, arrays, convert) for item in skeleton["$tuple"])
    if "$dict" in skeleton:
        return {key: decode(value, arrays, convert) for key, value in skeleton["$dict"]}
    if "$bytes" in skeleton:
        return base64.b64decode(skeleton["$bytes"])
    if "$float" in skeleton:
        return float(skeleton["$float"])
    return {key: decode(value, arrays, convert) for key, value in skeleton.items()}
