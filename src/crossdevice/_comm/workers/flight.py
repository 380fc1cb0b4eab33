"""A worker communicator's part of a flight-recorder report: its last numbered collectives.

Its `Sequencer` keeps each collective's `Call` (name, number, purpose, start, end and
fingerprint) in a bounded deque (`crossdevice._trace.flight.COLLECTIVES`); a report
renders them here, with each fingerprint decoded into words (`Fingerprint.describe`).
(Here, not in `crossdevice._trace`: that package sits below the synchronisation kernel,
and decoding a fingerprint needs this layer.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from crossdevice._comm.workers.fingerprint import Fingerprint

__all__ = ["sequencer_group"]


def sequencer_group(sequencer: Any, now: float) -> dict[str, Any]:
    """`flight.register`'s `render` for a worker communicator's sequencer."""
    standing = sequencer._standing
    collectives = []
    for call in list(sequencer.history.copy()):  # one C call: it may be appended to
        ended = getattr(call, "ended", 0.0)
        entry = {
            "seq": call.seq,
            "kind": call.name,
            "purpose": call.purpose,
            "fingerprint": _describe(call.fingerprint, standing.rank),
            "started_seconds_ago": round(now - call.started, 6),
            "ended_seconds_ago": round(now - ended, 6) if ended else None,
        }
        state = f"ended {entry['ended_seconds_ago'] * 1e3:.3f} ms ago" if ended else "did not end"
        entry["text"] = (
            f"#{call.seq} {call.label}: started {entry['started_seconds_ago'] * 1e3:.3f} ms "
            f"ago, {state}; {entry['fingerprint']}"
        )
        collectives.append(entry)
    return {
        "name": f"worker rank {standing.rank} of {standing.world_size}",
        "kind": "this worker's numbered collectives",
        "broken": standing.broken,
        "collectives": collectives,
    }


def _describe(fingerprint: Any, rank: int) -> str:
    if fingerprint is None:
        return "no fingerprint"
    if isinstance(fingerprint, Fingerprint):
        return fingerprint.describe()
    try:
        header = np.asarray(fingerprint)
        return Fingerprint.decode(header, rank=rank, num_dtypes=1 << 20).describe()
    except (ValueError, IndexError) as err:
        return f"undecodable fingerprint ({err})"
