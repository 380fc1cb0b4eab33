"""A `MirroredModule` inside a plain module: loading the parent's `state_dict` loads it.

A prepared model kept inside another module (`torch.optim.swa_utils.AveragedModel(
model)`, an EMA wrapper, `self.net = model`) saves through its parent: the parent's
`state_dict` asks the mirrored module for its entries under its prefix. Loading them
back, torch's `Module.load_state_dict` walks the parent's submodules' own parameters
and buffers, and a `MirroredModule` has none of its own (its replicas hold them): every
entry of the prepared model was "unexpected", and a checkpoint of an averaged model
could be written but never restored (the bug hunt of session 57). `load_as_child` is
the mirrored module's part of that walk: its entries, loaded as its own
`load_state_dict` loads them (once, into every replica), and the keys it lacks or does
not know reported to the parent's load under their full names.

`before_checkpoint` is what a checkpoint asks a mirrored module before it saves it: a
checkpoint holds no gradient (as torch's and Accelerate's do not), so one saved in the
middle of gradient accumulation counts the accumulated micro-batches as consumed and a
job resumed from it steps without them, silently (the resume hunt of session 57): it
warns.
"""

from __future__ import annotations

import warnings
from typing import Any

from crossdevice._core.callers import user_stacklevel

__all__ = ["before_checkpoint", "install", "load_as_child"]


def install(cls: Any) -> None:
    """Give `cls` (`MirroredModule`) its parts of a parent's load and of a checkpoint."""
    cls._load_from_state_dict = load_as_child
    cls._before_checkpoint = before_checkpoint


def before_checkpoint(self: Any) -> None:
    """Warn if a replica holds gradients accumulated since its optimizer's last step."""
    states = self.__dict__["_gradients"]._states
    if any(any(state.touched) for state in states):
        warnings.warn(
            "a checkpoint is saving a prepared model that holds gradients accumulated since "
            "its optimizer's last step (micro-batches of a step not taken yet: no_sync(), or "
            "backward in several runs before step()). A checkpoint holds no gradient, so a "
            "job resumed from it would take that step without them; save at a step "
            "boundary (after optimizer.step())",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def load_as_child(
    self: Any,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """`torch.nn.Module._load_from_state_dict` for a `MirroredModule` (see the module doc)."""
    del strict, error_msgs  # the parent's load reports and raises (its own `strict`)
    own = {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
    assign = bool(local_metadata.get("assign_to_params_buffers", False))
    result = self.load_state_dict(own, strict=False, assign=assign)
    missing_keys.extend(prefix + key for key in result.missing_keys)
    unexpected_keys.extend(prefix + key for key in result.unexpected_keys)
