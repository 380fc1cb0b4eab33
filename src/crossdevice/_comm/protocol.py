"""`Communicator`: what every communicator offers, wherever its peers live.

One protocol for the three places peers live (docs/design.md §2b): the replica threads
of this process (`local.thread.ThreadCommunicator`, through the `Participant` of one
replica), worker processes (`workers.communicator.ProcessGroupCommunicator`), devices of
this process. A caller holds a `Communicator` and one options object per operation, as
torch's `ProcessGroup` takes an `AllreduceOptions`:

    comm.all_reduce([grads], ReduceOptions("mean", timeout=30.0))
    pending = comm.all_reduce_async([bucket], ReduceOptions("sum"))
    ...                                   # more backward work
    reduced = pending.wait()              # bounded by the timeout; errors as themselves

A shorthand stands for the options wherever they would only name one thing: a reduce op
(`"sum"`), a gather `axis`, a broadcast `root`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from crossdevice._core.reduce_op import ReduceOp, as_reduce_op
from crossdevice._sync.call import CallSignature

__all__ = [
    "BroadcastOptions",
    "Communicator",
    "Done",
    "GatherOptions",
    "Pending",
    "ReduceOptions",
    "Then",
]


@dataclasses.dataclass(frozen=True, slots=True)
class ReduceOptions:
    """How one all-reduce runs.

    Attributes:
        op: `ReduceOp.SUM` or `ReduceOp.MEAN` (or their names).
        timeout: seconds to wait for the peers (None: the communicator's bound).
        divisor: MEAN's divisor (default: the number of peers); a strategy whose peers
            each bring the sum of several replicas passes the global replica count.
        signature: what the caller reduces before any packing (shapes, nest structure,
            the user's line): peers compare it, so equal byte counts of different calls
            never pass for the same collective. None: the values' own shapes.
        overlap: the caller computes while the all-reduce travels (`all_reduce_async`
            waited on later): work a transport would do in `wait` (a ring's sums and
            second phase) runs in the background instead. Results are the same bits.
    """

    op: ReduceOp = ReduceOp.SUM
    timeout: float | None = None
    divisor: float | None = None
    signature: CallSignature | None = None
    overlap: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", as_reduce_op(self.op))

    @classmethod
    def of(cls, options: ReduceOptions | ReduceOp | str) -> ReduceOptions:
        """`options` itself, or the options of a bare reduce op."""
        return options if isinstance(options, ReduceOptions) else cls(options)  # type: ignore[arg-type]

    def replace(self, **changes: Any) -> ReduceOptions:
        """A copy with `changes`."""
        return dataclasses.replace(self, **changes)

    def divide_by(self, peers: int) -> float | None:
        """What the sum is divided by: None for SUM, `divisor` or `peers` for MEAN.

        Raises:
            ValueError: a divisor with SUM, or one that is not a positive number.
        """
        mean = self.op is ReduceOp.MEAN
        divisor = self.divisor
        if divisor is None:
            return peers if mean else None
        if not mean:
            raise ValueError(
                f"divisor applies to ReduceOp.MEAN only, got divisor={divisor!r} with "
                f"{self.op}; pass reduce_op='mean' or drop the divisor"
            )
        if isinstance(divisor, bool) or not isinstance(divisor, int | float) or divisor <= 0:
            raise ValueError(f"divisor must be a positive number, got {divisor!r}")
        return divisor


def _index(value: Any, what: str) -> int:
    """`value` as an int (NumPy integers too); TypeError naming `what` for anything else."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what} must be an int, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True, slots=True)
class GatherOptions:
    """How one all-gather runs: the concatenation `axis` and the `timeout`.

    `signature`: what the gathered rows stand for, when a caller adds them up itself (a
    compressed all-reduce: its op, leaves and call site); the workers compare it, so
    workers that would add different things get `CollectiveMismatchError`.
    """

    axis: int = 0
    timeout: float | None = None
    signature: CallSignature | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", _index(self.axis, "axis"))

    @classmethod
    def of(cls, options: GatherOptions | int) -> GatherOptions:
        """`options` itself, or the options of a bare axis."""
        return options if isinstance(options, GatherOptions) else cls(options)


@dataclasses.dataclass(frozen=True, slots=True)
class BroadcastOptions:
    """How one broadcast runs: the `root` rank that sends and the `timeout`."""

    root: int = 0
    timeout: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", _index(self.root, "root"))

    @classmethod
    def of(cls, options: BroadcastOptions | int) -> BroadcastOptions:
        """`options` itself, or the options of a bare root."""
        return options if isinstance(options, BroadcastOptions) else cls(options)


class Pending(Protocol):
    """An all-reduce in flight (`Communicator.all_reduce_async`)."""

    def done(self) -> bool:
        """Whether `wait` would return at once."""

    def wait(self) -> Any:
        """The results; raises the collective's error. Bounded by the collective's timeout."""


class Done:
    """A collective that completed when it was issued: its `wait` returns `results`."""

    __slots__ = ("_results",)

    def __init__(self, results: Any) -> None:
        self._results = results

    def done(self) -> bool:
        """Always: it completed when it was issued."""
        return True

    def wait(self) -> Any:
        """The results."""
        return self._results


class Then:
    """Collectives in flight, and what their results become: `shape(*results)`.

    `wait()` waits for each of `pendings` in order (each bounded by its collective's
    timeout) and returns `shape` of their results, computed once and kept; an error of
    a collective is raised as itself, each time `wait` is asked. Waiting from several
    threads is serialised (one waits on the collectives, the others on it).

    Args:
        pendings: the collectives, in the order they were issued.
        shape: turns their results into what the caller gets.
    """

    __slots__ = ("_lock", "_pendings", "_result", "_shape")

    def __init__(self, pendings: Sequence[Pending], shape: Callable[..., Any]) -> None:
        self._pendings: tuple[Pending, ...] | None = tuple(pendings)
        self._shape = shape
        self._result: Any = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Whether `wait` would return (or raise) at once."""
        pendings = self._pendings
        return pendings is None or all(p.done() for p in pendings)

    def wait(self) -> Any:
        """`shape` of the collectives' results (see the class doc)."""
        with self._lock:  # bounded: its holder waits at most the collectives' timeouts
            pendings = self._pendings
            if pendings is not None:
                self._result = self._shape(*(p.wait() for p in pendings))
                self._pendings = None
            return self._result


@runtime_checkable
class Communicator(Protocol):
    """Collectives among peers: every peer makes the same calls in the same order."""

    @property
    def rank(self) -> int:
        """This peer's index, 0 .. size - 1."""

    @property
    def size(self) -> int:
        """How many peers take part."""

    def all_reduce(
        self, values: Sequence[Any], options: ReduceOptions | ReduceOp | str = ReduceOp.SUM
    ) -> list[Any]:
        """Reduce each array element-wise across the peers; every peer gets the results.

        Inputs never change; results may be shared read-only buffers (NumPy).
        """

    def all_reduce_async(
        self, values: Sequence[Any], options: ReduceOptions | ReduceOp | str = ReduceOp.SUM
    ) -> Pending:
        """`all_reduce`, issued now and waited on later (`Pending.wait`), bitwise the same.

        Issuing any other collective first completes the one in flight: at most one is.
        """

    def all_gather(self, value: Any, axis: GatherOptions | int = 0) -> Any:
        """Concatenate every peer's `value` along `axis` (or `GatherOptions`), in rank order."""

    def broadcast(self, value: Any, root: BroadcastOptions | int = 0) -> Any:
        """Every peer gets a copy of `root`'s `value` (others may pass None)."""

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every peer reaches this barrier."""

    def abort(self, error: BaseException) -> None:
        """Give up: release the peers waiting in a collective with an error naming `error`."""
