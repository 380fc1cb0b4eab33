"""Reading a checkpoint directory as it is: the `checkpoint` file, checked against the disk.

The `checkpoint` file is written after the checkpoint it names, so a crash between the
two leaves a checkpoint on disk that the file does not list. The rename of a
checkpoint's hidden write directory into place is its commit (`storage.write`: every
file, then the index, fsynced before it), so a `ckpt-N` directory with a readable index
is whole. TF's manager reads only the file and would restore the older checkpoint, then
fail to save `ckpt-N` again; here a complete checkpoint newer than every listed one is
listed again (`scan`). Its files' sizes and CRC-32s are still checked when it is
restored.

Older unlisted checkpoints are left alone: `keep_checkpoint_every_n_hours` keeps some out
of the list on purpose (TF's), and listing them would let `max_to_keep` delete them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from crossdevice._train import storage
from crossdevice._train.state_file import CheckpointState

__all__ = ["Listing", "index_time", "scan", "set_aside"]


@dataclasses.dataclass
class Listing:
    """What a manager keeps: its checkpoints and their times, oldest first, and the latest."""

    kept: list[tuple[str, float]]
    latest: str | None
    last_preserved: float
    #: Complete checkpoints on disk that the `checkpoint` file did not list, now kept.
    adopted: list[str]
    #: Listed checkpoints without a readable index (incomplete or damaged), not kept.
    skipped: list[str]
    state_missing: bool


def index_time(path: str) -> float | None:
    """When the checkpoint at `path` was written (its index says); None: it has no index.

    None for a directory without a readable crossdevice index: an interrupted or damaged
    write, or another tool's files.
    """
    index_path = Path(path) / storage.INDEX_FILE
    try:
        index: Any = json.loads(index_path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("format") != storage.FORMAT:
        return None
    created = index.get("created")
    if isinstance(created, int | float) and not isinstance(created, bool):
        return float(created)
    try:
        return os.path.getmtime(index_path)
    except OSError:
        return None


def scan(
    directory: Path, name: str, state: CheckpointState | None, max_to_keep: int | None
) -> Listing:
    """The checkpoints a manager of `name-N` in `directory` keeps, given its `checkpoint` file.

    Listed checkpoints without an index are skipped. Complete `name-N` directories that
    are not listed and are newer than every listed one are appended (oldest first); with
    no `checkpoint` file at all, the newest `max_to_keep` of them.
    """
    missing = state is None
    state = state or CheckpointState()
    listed = [*state.paths, *([state.latest] if state.latest else [])]
    times = dict(zip(state.paths, state.timestamps, strict=False))
    written = {path: index_time(path) for path in dict.fromkeys(listed)}
    kept_paths = [p for p in state.paths if written[p] is not None]
    skipped = [p for p in dict.fromkeys(listed) if written[p] is None]
    newest = max((t for t in written.values() if t is not None), default=float("-inf"))
    pattern = re.compile(rf"{re.escape(name)}-\d+")
    found = []
    if directory.is_dir():
        for entry in directory.iterdir():
            path = str(directory / entry.name)
            if path in written or not pattern.fullmatch(entry.name) or not entry.is_dir():
                continue
            when = index_time(path)
            if when is not None and when > newest:
                found.append((when, path))
    found.sort()
    if missing and max_to_keep is not None:
        found = found[-max_to_keep:]
    now = time.time()
    kept = [(p, times.get(p, written[p] or now)) for p in kept_paths]
    kept += [(p, when) for when, p in found]
    if found:
        latest: str | None = found[-1][1]
    elif state.latest is not None and written[state.latest] is not None:
        latest = state.latest
    else:
        latest = kept[-1][0] if kept else None
    return Listing(
        kept=kept,
        latest=latest,
        last_preserved=state.last_preserved or now,
        adopted=[p for _, p in found],
        skipped=skipped,
        state_missing=missing,
    )


def set_aside(path: Path) -> Path:
    """Rename the directory `path` (no checkpoint) to `path.incomplete-<time>`, unique."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(1000):
        suffix = f".incomplete-{stamp}" + (f"-{attempt}" if attempt else "")
        aside = path.with_name(path.name + suffix)
        if not aside.exists():
            os.rename(path, aside)
            return aside
    raise FileExistsError(
        f"cannot move {str(path)!r} aside: 1000 names {path.name}.incomplete-{stamp}-* are "
        "taken; expected a free one. Delete the old .incomplete-* directories"
    )
