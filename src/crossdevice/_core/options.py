"""`CommunicationImplementation` and `CommunicationOptions` (`tf.distribute.experimental`)."""

from __future__ import annotations

import copy
import dataclasses
import enum

from crossdevice._core import validate
from crossdevice._core.coerce import coerce_enum

__all__ = ["CommunicationImplementation", "CommunicationOptions"]


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to use: `AUTO`, `RING` or `NCCL`.

    NCCL applies to GPU all-reduce only; host reductions, all-gather and broadcast use
    RING (the in-process sharded all-reduce, or Gloo across processes).
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


# TF's older name.
CollectiveCommunication = CommunicationImplementation


@dataclasses.dataclass(frozen=True, init=False)
class CommunicationOptions:
    """Options for cross-device communication (TF's `CommunicationOptions`).

    Args:
        bytes_per_pack: split gradients into packs of about this many bytes for batched
            reductions; 0 lets the implementation choose.
        timeout_seconds: a collective or rendezvous that takes longer raises
            `CollectiveTimeoutError`, naming the replicas or ranks that did not arrive.
            None or 0 means no timeout (failures in a peer still release everyone).
        implementation: a `CommunicationImplementation` or its name in any case.

    Example:
        >>> options = CommunicationOptions(bytes_per_pack=50 * 1024 * 1024, timeout_seconds=120)
        >>> options.merge(CommunicationOptions(implementation="ring")).implementation.name
        'RING'
    """

    bytes_per_pack: int
    timeout_seconds: float | None
    implementation: CommunicationImplementation

    def __init__(
        self,
        bytes_per_pack: int = 0,
        timeout_seconds: float | None = None,
        implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO,
    ) -> None:
        if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int):
            raise ValueError(
                f"Argument bytes_per_pack must be an int >= 0, received {bytes_per_pack!r}."
            )
        if bytes_per_pack < 0:
            raise ValueError(f"Argument bytes_per_pack must be >=0, Received {bytes_per_pack}.")
        timeout_seconds = validate.timeout_seconds(timeout_seconds)
        implementation = coerce_enum(
            implementation,
            CommunicationImplementation,
            message="Argument implementation must be one of {choices}: a "
            "crossdevice.experimental.CommunicationImplementation or its name, got {value}",
        )
        object.__setattr__(self, "bytes_per_pack", bytes_per_pack)
        object.__setattr__(self, "timeout_seconds", timeout_seconds)
        object.__setattr__(self, "implementation", implementation)

    def merge(self, options: CommunicationOptions | None) -> CommunicationOptions:
        """Options with each field of `options` that is not its default, else this one's.

        TF: `a.merge(b)` copies `a` and takes each non-default field of `b`. Options are
        immutable, so `a.merge(None)` is `a` itself (every collective's path merges its
        options with None: a copy cost about 2 us each).
        """
        if options is None:
            return self
        merged = copy.copy(self)
        if options.bytes_per_pack != 0:
            object.__setattr__(merged, "bytes_per_pack", options.bytes_per_pack)
        if options.timeout_seconds is not None:
            object.__setattr__(merged, "timeout_seconds", options.timeout_seconds)
        if options.implementation != CommunicationImplementation.AUTO:
            object.__setattr__(merged, "implementation", options.implementation)
        return merged
