"""One checkpoint on disk: a directory, written aside and renamed into place.

A checkpoint is a directory (`ckpt-3/`) holding

* the arrays, in an existing standard format: torch's Distributed Checkpoint (DCP:
  `.metadata` plus `__0_0.distcp`, readable with `torch.distributed.checkpoint.load`)
  whenever the state holds a torch tensor, else NumPy's `.npz` (`arrays.npz`, read with
  `numpy.load`), so that a NumPy-only install can checkpoint. A NumPy array that torch
  cannot hold (strings, bytes, datetimes, structured records, long doubles, another byte
  order) goes into DCP as its raw bytes, a flat uint8 tensor, with its dtype in the index
  (`"descr"`, NumPy's `.npy` notation): it reads back bitwise, as `.npz` keeps it;
* `crossdevice.json`: the index. It holds the state's structure and every non-array
  value (`tree.encode`), each array's shape and dtype, and each file's size.

The write is atomic. Everything goes into a hidden sibling directory (`.ckpt-3.tmp-...`),
each file is fsynced, the index is written last, and one `rename` makes the checkpoint
appear whole; a crash at any point leaves only the hidden directory, which no reader
takes for a checkpoint. An existing checkpoint is never overwritten.

Reads check before they trust: a missing directory, a missing index (an interrupted or
foreign write) and a file shorter than the index says (truncated) are each an error that
names the path.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import os
import re
import shutil
import sys
import time
import uuid
import warnings
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from crossdevice._arrays import is_torch

__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "TMP_PATTERN",
    "discard",
    "fsync_directory",
    "prepare",
    "read_arrays",
    "read_index",
    "unwritable",
    "write",
]

INDEX_FILE: Final = "crossdevice.json"
_NPZ_FILE: Final = "arrays.npz"
FORMAT: Final = "crossdevice-checkpoint"
_VERSION: Final = 1
#: The version of a checkpoint with arrays stored as raw bytes (`descr`): a reader of
#: version 1 would misread them, so it refuses them and asks for an upgrade instead.
_VERSION_BYTES: Final = 2
#: The dtypes `torch.from_numpy` takes (in native byte order); others are stored as bytes.
_TORCH_DTYPES: Final = frozenset(
    np.dtype(name)
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
)  # fmt: skip
#: Bytes read at a time for a file's CRC-32.
_CRC_CHUNK: Final = 1 << 20
#: Hidden directories of writes in progress (or interrupted): `.ckpt-3.tmp-<id>`.
TMP_PATTERN: Final = re.compile(r"^\..+\.tmp-[0-9a-f]+$")
#: DCP warns on every single-process save and load; one process writing the whole
#: job's checkpoint is exactly what we mean (`no_dist=True`).
_DCP_NO_DIST_WARNING: Final = "torch.distributed is disabled, unavailable or uninitialized"


def fsync_directory(path: Path) -> None:
    """Make a directory's entries (a new file, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare(path: Path) -> Path:
    """Check that `path` can become a new checkpoint and make its hidden write directory.

    Runs on the training thread, so that a bad path fails the `save` call itself.

    Raises:
        FileExistsError: `path` exists (a checkpoint is never overwritten).
        OSError: its directory cannot be created or written (PermissionError, ...).
    """
    if path.exists():
        raise FileExistsError(
            f"cannot save the checkpoint {str(path)!r}: that path exists already, and a "
            "checkpoint is never overwritten. Save under another name, or delete it first"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
    except OSError as err:
        # OSError(errno, ...) comes back as the matching subclass (PermissionError, ...).
        raise OSError(err.errno, unwritable(path.parent, err)) from err
    return tmp


def unwritable(directory: Path, error: OSError) -> str:
    """The message for a checkpoint directory that cannot be created or written."""
    return (
        f"cannot write checkpoints to {str(directory)!r}: it is not writable "
        f"({error.strerror or error}). Choose a directory this process may write, or fix its "
        "permissions"
    )


def discard(tmp: Path) -> None:
    """Remove an unfinished write directory (best effort)."""
    shutil.rmtree(tmp, ignore_errors=True)


def _storage_kind(arrays: Mapping[str, Any]) -> str:
    return "dcp" if any(is_torch(a) for a in arrays.values()) else "npz"


def _as_bytes(array: Any) -> bool:
    """Whether DCP stores `array` as raw bytes: a NumPy array of a dtype torch lacks."""
    return not is_torch(array) and np.asarray(array).dtype not in _TORCH_DTYPES


def _array_entry(array: Any, kind: str) -> dict[str, Any]:
    entry = {
        "shape": list(array.shape),
        "dtype": _dtype_name(array),
        "lib": "torch" if is_torch(array) else "numpy",
    }
    if kind == "dcp" and _as_bytes(array):
        # `.npy`'s own notation (a str, or a list for records), read with literal_eval.
        entry["descr"] = repr(np.lib.format.dtype_to_descr(array.dtype))
    return entry


def write(tmp: Path, path: Path, index: dict[str, Any], arrays: Mapping[str, Any]) -> None:
    """Write `arrays` and `index` into `tmp`, then rename it to `path` (writer thread).

    `arrays` are the staged copies: nothing else may change them until this returns.
    On an error `tmp` is removed and `path` does not exist.
    """
    try:
        kind = _storage_kind(arrays)
        entries = {key: _array_entry(array, kind) for key, array in arrays.items()}
        index = {
            "format": FORMAT,
            "version": _VERSION_BYTES if any("descr" in e for e in entries.values()) else _VERSION,
            "storage": kind,
            "created": time.time(),
            **index,
            "arrays": entries,
        }
        if kind == "dcp":
            _write_dcp(tmp, arrays)
        else:
            _write_npz(tmp, arrays)
        files = sorted(tmp.iterdir())
        index["files"] = {f.name: f.stat().st_size for f in files}
        # A flipped bit keeps a file's size: the CRC-32 of every byte sees it (TF's
        # checkpoints carry a CRC-32C per tensor for the same reason). ~2.8 GB/s here, on
        # the writer thread; checkpoints written before it have none and are read as before.
        index["crc32"] = {f.name: _crc32(f) for f in files}
        _write_file(tmp / INDEX_FILE, json.dumps(index, allow_nan=False).encode())
        fsync_directory(tmp)
        if path.exists():
            raise FileExistsError(
                f"cannot save the checkpoint {str(path)!r}: it appeared while this one was "
                "being written (two jobs saving into one directory?); this write is discarded"
            )
        os.rename(tmp, path)
        fsync_directory(path.parent)
    except BaseException:
        discard(tmp)
        raise


def _dtype_name(array: Any) -> str:
    return str(array.dtype).removeprefix("torch.")


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_npz(tmp: Path, arrays: Mapping[str, Any]) -> None:
    with open(tmp / _NPZ_FILE, "wb") as f:
        named: dict[str, Any] = {key: np.asarray(a) for key, a in arrays.items()}
        np.savez(f, **named)
        f.flush()
        os.fsync(f.fileno())


def _dcp() -> Any:
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError as err:
        raise ImportError(
            "this checkpoint is in torch's Distributed Checkpoint format (it holds torch "
            "tensors), which needs torch: pip install 'crossdevice[torch]' (on a CPU-only "
            "machine first pip install torch==2.13.0)"
        ) from err
    # Set on every call: pytest and `warnings.catch_warnings` reset the filters, and
    # adding one is safe from the writer thread (catch_warnings is not).
    warnings.filterwarnings("ignore", message=_DCP_NO_DIST_WARNING, category=UserWarning)
    return dcp


def _write_dcp(tmp: Path, arrays: Mapping[str, Any]) -> None:
    import torch

    dcp = _dcp()
    tensors = {key: a if is_torch(a) else _numpy_to_torch(torch, a) for key, a in arrays.items()}
    writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
    with _dcp_errors():
        dcp.save(tensors, storage_writer=writer, no_dist=True)


def _numpy_to_torch(torch: Any, array: np.ndarray) -> Any:
    """A tensor of `array`: its own dtype, or its raw bytes when torch lacks the dtype."""
    # Not np.ascontiguousarray: it turns a 0-d array into a 1-d one.
    contiguous = array if array.flags.c_contiguous else array.copy()
    if not _as_bytes(contiguous):
        return torch.from_numpy(contiguous)
    return torch.from_numpy(contiguous.reshape(-1).view(np.uint8))


@contextlib.contextmanager
def _dcp_errors() -> Iterator[None]:
    """Turn torch DCP's `CheckpointException` into an ordinary exception.

    It derives from BaseException, so `except Exception` (ours around a damaged read, a
    user's that falls back to an earlier checkpoint) would miss it: a RuntimeError with
    its text instead, the original as the cause.
    """
    try:
        yield
    except Exception:
        raise
    except BaseException as err:
        api = sys.modules.get("torch.distributed.checkpoint.api")
        if api is None or not isinstance(err, api.CheckpointException):
            raise
        raise RuntimeError(f"torch.distributed.checkpoint failed: {err}") from err


def _crc32(file: Path) -> str:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


# -- reading ------------------------------------------------------------------------------


def _describe_siblings(path: Path) -> str:
    parent = path.parent
    if not parent.is_dir():
        return f"the directory {str(parent)!r} does not exist either"
    found = sorted(p.name for p in parent.iterdir() if (p / INDEX_FILE).is_file())
    if not found:
        return f"{str(parent)!r} holds no checkpoint"
    return f"{str(parent)!r} holds {found!r}"


def read_index(path: Path) -> dict[str, Any]:
    """The index of the checkpoint at `path`, after checking the checkpoint is whole.

    Raises:
        FileNotFoundError: no checkpoint at `path`.
        ValueError: an incomplete, truncated or foreign directory.
    """
    if not path.is_dir():
        hint = ""
        if re.search(r"-\d+$", path.name) is None:
            hint = " (a checkpoint saved with save(prefix) is named prefix-N)"
        raise FileNotFoundError(
            f"no checkpoint at {str(path)!r}{hint}: {_describe_siblings(path)}. Pass a path "
            "that save() or CheckpointManager.save() returned, or latest_checkpoint(directory)"
        )
    index_path = path / INDEX_FILE
    try:
        index = json.loads(index_path.read_bytes())
    except FileNotFoundError:
        raise ValueError(
            f"{str(path)!r} is not a complete crossdevice checkpoint: it has no {INDEX_FILE} "
            "(its write was interrupted, or it was written by another tool). Restore an "
            "earlier checkpoint"
        ) from None
    except ValueError as err:
        raise ValueError(
            f"the checkpoint index {str(index_path)!r} is damaged ({err}); restore an earlier "
            "checkpoint"
        ) from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{str(index_path)!r} is not a crossdevice checkpoint index")
    if index.get("version", 0) > _VERSION_BYTES:
        raise ValueError(
            f"the checkpoint {str(path)!r} has format version {index.get('version')!r}, newer "
            f"than this crossdevice reads ({_VERSION_BYTES}); upgrade crossdevice"
        )
    for name, size in index.get("files", {}).items():
        file = path / name
        actual = file.stat().st_size if file.is_file() else None
        if actual is None:
            raise ValueError(
                f"the checkpoint {str(path)!r} is incomplete: its file {name!r} is missing "
                "(the index lists it). Restore an earlier checkpoint"
            )
        if actual != size:
            raise ValueError(
                f"the checkpoint {str(path)!r} is truncated or damaged: {name!r} has {actual} "
                f"bytes, the index recorded {size}. Restore an earlier checkpoint"
            )
    for name, crc in index.get("crc32", {}).items():
        actual_crc = _crc32(path / name)
        if actual_crc != crc:
            raise ValueError(
                f"the checkpoint {str(path)!r} is damaged: {name!r} has CRC-32 {actual_crc}, "
                f"the index recorded {crc} (its size is right: changed bytes). Restore an "
                "earlier checkpoint"
            )
    return index


def read_arrays(path: Path, index: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """The arrays `keys` of the checkpoint at `path` (NumPy arrays or torch tensors)."""
    keys = list(keys)
    try:
        if index.get("storage") == "dcp":
            return _read_dcp(path, index, keys)
        with np.load(path / _NPZ_FILE, allow_pickle=False) as data:
            return {key: data[key] for key in keys}
    except (ImportError, KeyboardInterrupt):
        raise
    except Exception as err:
        raise ValueError(
            f"cannot read the arrays of the checkpoint {str(path)!r}: it is damaged "
            f"({type(err).__name__}: {err}). Restore an earlier checkpoint"
        ) from err


def _read_dcp(path: Path, index: Mapping[str, Any], keys: list[str]) -> dict[str, Any]:
    import torch

    dcp = _dcp()
    meta = index["arrays"]
    out = {}
    records = {}
    for key in keys:
        shape = tuple(meta[key]["shape"])
        if "descr" in meta[key]:  # raw bytes of a NumPy dtype torch lacks (`_as_bytes`)
            records[key] = np.lib.format.descr_to_dtype(ast.literal_eval(meta[key]["descr"]))
            size = records[key].itemsize * math.prod(shape)
            out[key] = torch.empty((size,), dtype=torch.uint8)
        else:
            out[key] = torch.empty(shape, dtype=getattr(torch, meta[key]["dtype"]))
    if out:
        with _dcp_errors():
            dcp.load(out, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    arrays: dict[str, Any] = dict(out)
    for key, dtype in records.items():
        arrays[key] = out[key].numpy().view(dtype).reshape(meta[key]["shape"])
    return arrays
