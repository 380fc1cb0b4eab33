"""What the checkpoint tests build alike: a holder of any state, a manager, path names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import crossdevice as cd


class Holder:
    """Any object with a state_dict: the state it holds is what it saves."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def manager(directory: Path, value: Any = None, **kwargs: Any) -> Any:
    """A CheckpointManager of a Checkpoint of `value` (a float32 Variable), keeping 2."""
    value = cd.Variable(np.float32(0.0)) if value is None else value
    kwargs.setdefault("max_to_keep", 2)
    return cd.train.CheckpointManager(cd.train.Checkpoint(value=value), directory, **kwargs)


def names(paths: list[str]) -> list[str]:
    """The last part of each path."""
    return [Path(p).name for p in paths]
