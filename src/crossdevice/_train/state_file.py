"""The `checkpoint` file of a checkpoint directory: which checkpoints exist, which is latest.

The same text file TF writes (a `CheckpointState` text proto), so that tools reading TF's
`checkpoint` file find their way:

    model_checkpoint_path: "ckpt-3"
    all_model_checkpoint_paths: "ckpt-2"
    all_model_checkpoint_paths: "ckpt-3"
    all_model_checkpoint_timestamps: 1718000000.5
    all_model_checkpoint_timestamps: 1718000060.1
    last_preserved_timestamp: 1717999990.0

Paths inside the directory are stored relative to it. The file is replaced atomically
(written aside, fsynced, renamed), so a reader always finds the previous version or the
new one, never half of one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Final

from crossdevice._train import storage
from crossdevice._train.writer import wait_for_path

__all__ = ["CheckpointState", "latest_checkpoint", "read_state", "write_state"]

STATE_FILE: Final = "checkpoint"


@dataclasses.dataclass
class CheckpointState:
    """What a `checkpoint` file says: the latest path, all kept paths and their times."""

    latest: str | None = None
    paths: list[str] = dataclasses.field(default_factory=list)
    timestamps: list[float] = dataclasses.field(default_factory=list)
    last_preserved: float | None = None


def _absolute(directory: Path, path: str) -> str:
    return path if os.path.isabs(path) else str(directory / path)


def _relative(directory: Path, path: str) -> str:
    target = Path(path)
    return target.name if target.parent.resolve() == directory.resolve() else str(target)


def read_state(directory: Path, filename: str = STATE_FILE) -> CheckpointState | None:
    """The `checkpoint` file of `directory`, paths made absolute; None if there is none.

    Unknown lines are skipped (TF may add fields); a damaged value is a ValueError.
    """
    try:
        text = (directory / filename).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    state = CheckpointState()
    for number, line in enumerate(text.splitlines(), start=1):
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        try:
            if key == "model_checkpoint_path":
                state.latest = _absolute(directory, json.loads(value))
            elif key == "all_model_checkpoint_paths":
                state.paths.append(_absolute(directory, json.loads(value)))
            elif key == "all_model_checkpoint_timestamps":
                state.timestamps.append(float(value))
            elif key == "last_preserved_timestamp":
                state.last_preserved = float(value)
        except ValueError:
            raise ValueError(
                f"line {number} of {str(directory / filename)!r} is damaged: {line!r}; fix "
                "or delete the file (the checkpoints themselves are intact)"
            ) from None
    return state


def write_state(directory: Path, state: CheckpointState, filename: str = STATE_FILE) -> None:
    """Replace the `checkpoint` file of `directory` atomically."""
    lines = []
    if state.latest is not None:
        lines.append(f"model_checkpoint_path: {json.dumps(_relative(directory, state.latest))}")
    lines += [
        f"all_model_checkpoint_paths: {json.dumps(_relative(directory, p))}" for p in state.paths
    ]
    lines += [f"all_model_checkpoint_timestamps: {t!r}" for t in state.timestamps]
    if state.last_preserved is not None:
        lines.append(f"last_preserved_timestamp: {state.last_preserved!r}")
    tmp = directory / f".{filename}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / filename)
    storage.fsync_directory(directory)


def is_complete(path: str) -> bool:
    """Whether `path` is a checkpoint whose write finished (it has its index)."""
    return (Path(path) / storage.INDEX_FILE).is_file()


def latest_checkpoint(
    checkpoint_dir: str | os.PathLike[str], latest_filename: str | None = None
) -> str | None:
    """The newest complete checkpoint of a directory, from its `checkpoint` file (TF's).

    If the file names a checkpoint that is gone or incomplete, the newest complete one it
    lists is returned instead; None if there is none. Saves of this process still being
    written into the directory are waited for.

    Args:
        checkpoint_dir: the directory the checkpoints were saved in.
        latest_filename: the state file's name (default `"checkpoint"`).

    Example:
        >>> import tempfile
        >>> latest_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    wait_for_path(os.fspath(Path(checkpoint_dir)), inside=True)
    state = read_state(Path(checkpoint_dir), latest_filename or STATE_FILE)
    if state is None:
        return None
    candidates = [state.latest] if state.latest is not None else []
    candidates += list(reversed(state.paths))
    return next((path for path in candidates if path is not None and is_complete(path)), None)
