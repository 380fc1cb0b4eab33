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
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_as_child"]


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
