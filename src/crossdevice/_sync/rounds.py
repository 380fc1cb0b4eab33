"""What a round of the `Rendezvous` is: the replicas' arrivals, who completes it, its results.

Each call every replica of a strategy makes (a `merge_call`, a collective) is one `Round`
of the strategy's rendezvous (`crossdevice._sync.rendezvous`). A replica brings an
`Arrival`; the last one to arrive has the arrivals' `Handler` validate and complete the
round. A handler needs nothing from the rendezvous but the round: the round carries the
rendezvous' name and says what each replica called (`describe_calls`) for error messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Arrival", "Handler", "Record", "Round"]

#: A round in the flight recorder: (seq, each replica's arrival time, kind, leaves, calls),
#: `calls` None when every replica made the same call (`kind` with `leaves`), else each
#: replica's (kind, leaves), None for one that has not arrived.
Record = tuple[int, list[float], str, Any, list[tuple[str, Any] | None] | None]


class Arrival(Protocol):
    """What one replica brought to a round (each `Handler` has its own kind of arrival)."""

    @property
    def kind(self) -> str:
        """The call: "merge_call", "all_reduce", "all_gather", "broadcast"."""

    @property
    def handler(self) -> Handler:
        """Who completes the round and hands out its results."""


class Handler(Protocol):
    """Completes the rounds of one family of calls (merge_call, a communicator's collectives)."""

    def describe(self, arrival: Any) -> str:
        """What `arrival` asked for, as an error message shows it: `all_reduce(SUM, float32[3])`."""

    def complete(self, rnd: Round, replica_id: int) -> None:
        """Run by the last arriver: validate (`rnd.set_error`), compute, or set `rnd.work`."""

    def finalize(self, rnd: Round) -> None:
        """After the shared work of a round: build its results."""

    def result(self, rnd: Round, replica_id: int) -> Any:
        """Replica `replica_id`'s result of a completed round."""


class Round:
    """One call: every replica's arrival, the error or the work, the shared results."""

    __slots__ = (
        "arrivals",
        "cancelled",
        "count",
        "done",
        "done_ids",
        "error",
        "failure",
        "failure_replica",
        "finished",
        "held",
        "kind",
        "name",
        "outputs",
        "plan",
        "ready",
        "results",
        "seq",
        "times",
        "work",
        "zero_gate",
        "zero_left",
    )

    def __init__(self, seq: int, n: int, name: str = "Rendezvous") -> None:
        self.seq = seq
        #: the rendezvous' name, for error messages.
        self.name = name
        self.arrivals: list[Any] = [None] * n
        #: each replica's arrival time (`time.monotonic`), for the flight recorder.
        self.times: list[float] = [0.0] * n
        self.count = 0
        self.kind = ""
        self.ready = False
        #: (exception type, message) raised in every replica: they disagree.
        self.error: tuple[type[BaseException], str] | None = None
        self.failure: BaseException | None = None
        self.failure_replica = -1
        self.plan: Any = None
        self.outputs: list[Any] = []
        self.results: Any = {}
        self.work: Callable[[int], None] | None = None
        self.cancelled = False
        self.done = 0
        self.done_ids: list[int] = []
        self.finished = False
        #: the gate replica 0 sleeps on while it waits for this round's peers, if it does.
        self.zero_gate: Any = None
        #: replica 0's sleeper entry, held back until the other replicas have left.
        self.held: tuple[int, Any] | None = None
        #: how many replicas other than 0 have still to leave before it is woken.
        self.zero_left = 0

    def set_error(self, kind: type[BaseException], message: str) -> None:
        """Make every replica of this round raise `kind(message)`."""
        self.error = (kind, message)

    def describe_calls(self) -> str:
        """`replica 0: all_reduce(SUM, float32[3]) #4; replica 1: merge_call #4`."""
        return "; ".join(
            f"replica {r}: {a.handler.describe(a)} #{self.seq}"
            for r, a in enumerate(self.arrivals)
            if a is not None
        )

    def record(self, agreed: bool) -> Record:
        """This round for the flight recorder; `agreed`: every replica made the same call.

        Its arrival times are kept, not copied: a round that is over does not change.
        """
        first = self.arrivals[0]
        if agreed:
            return (self.seq, self.times, first.kind, getattr(first, "sig", None), None)
        return (self.seq, self.times, first.kind, None, _calls(self.arrivals))

    def snapshot(self) -> Record:
        """This unfinished round for the flight recorder, whoever has arrived so far.

        Read without the rendezvous' lock (reports are written with it held): each copy
        is one C call, and arrivals are copied first, so a replica arriving meanwhile is
        in it whole (its time set) or not at all.
        """
        arrivals = list(self.arrivals)
        times = list(self.times)
        return (self.seq, times, "", None, _calls(arrivals))

    def odd_ones(self) -> list[str]:
        """The replicas whose call differs from what most called (a mismatch's culprits)."""
        try:
            calls = [a.handler.describe(a) if a is not None else None for a in self.arrivals]
        except Exception:  # a description that fails must not hide the error
            return []
        common = max(set(calls), key=calls.count)
        return [f"replica {r}" for r, c in enumerate(calls) if c != common]


def _calls(arrivals: list[Any]) -> list[tuple[str, Any] | None]:
    """Each replica's (kind, leaves); None where it has not arrived."""
    return [None if a is None else (a.kind, getattr(a, "sig", None)) for a in arrivals]
