"""Variables created inside `strategy.run`: replica 0 creates, the other replicas reuse.

TF's `mirrored_run` gives each replica thread a `shared_variable_creator`: replica 0
creates the strategy's variable (a `MirroredVariable`, or under CentralStorageStrategy
one `AggregatingVariable`), and replica i > 0 gets the variable replica 0 created in the
same position, provided the names match; otherwise "Tried to create variable ... with
mismatching name". Here all replicas meet in one `merge_call` instead: the creation
arguments are compared there, replica 0's are used, and every replica gets the one
variable back (so `run` returns that variable, not a `PerReplica` of copies).

Names match as TF matches them: after undoing name uniquification, so `"foo_" +
str(replica_id)` in every replica makes one variable named after replica 0's (`foo_0`).
TF drops a trailing `_<digit>` (and `_<digit>/` inside the name); with ten replicas or more
`foo_10` then no longer matches, so here any number of digits is dropped.
"""

from __future__ import annotations

import re
from typing import Any, Final

from crossdevice._core import context
from crossdevice._values.values import PerReplica
from crossdevice._values.variables import Variable, make_initial_value

__all__ = ["canonical_variable_name", "create_in_replica_context"]

#: `name_<n>/` inside a name and `name_<n>` at its end: what uniquification appends.
_UNIQUIFIED_INSIDE: Final = re.compile(r"_\d+/")
_UNIQUIFIED_AT_END: Final = re.compile(r"_\d+$")


def canonical_variable_name(name: Any) -> Any:
    """`name` with uniquifying suffixes dropped: the key replicas' names are matched by.

    TF `shared_variable_creator._canonicalize_variable_name` (with one digit only).
    """
    if not isinstance(name, str):
        return "Variable" if name is None else name
    return _UNIQUIFIED_AT_END.sub("", _UNIQUIFIED_INSIDE.sub("/", name))


def _first(value: Any) -> Any:
    """Replica 0's argument (arguments that differ across replicas come as a PerReplica)."""
    return value.values[0] if isinstance(value, PerReplica) else value


def create_in_replica_context(
    frame: context.Frame,
    initial_value: Any = None,
    trainable: bool | None = None,
    name: str | None = None,
    dtype: Any = None,
    synchronization: Any = None,
    aggregation: Any = None,
) -> Any:
    """Create one variable of `frame`'s strategy for all its replicas, from replica 0's arguments.

    Every replica must call it (it is a `merge_call`), asking for the same name up to
    uniquifying suffixes (`canonical_variable_name`); the variable takes replica 0's.

    Raises:
        RuntimeError: replicas asked for different names (TF's error).
    """
    replica_context = frame.replica_context
    assert replica_context is not None, "called in cross-replica context"
    value = make_initial_value(initial_value, dtype)

    def merge_fn(
        strategy: Any,
        value: Any,
        name: Any,
        trainable: Any,
        synchronization: Any,
        aggregation: Any,
    ) -> Any:
        names = name.values if isinstance(name, PerReplica) else (name,)
        first = canonical_variable_name(names[0])
        for i, other in enumerate(names):
            if canonical_variable_name(other) != first:
                device = strategy.extended.worker_devices[i]
                raise RuntimeError(
                    f"Tried to create variable {other!r} with mismatching name on device "
                    f"{device}: replica 0 created {names[0]!r}. Every replica must create "
                    "the same variables, with the same names (up to a trailing "
                    "`_<number>`), in the same order"
                )
        with strategy.scope():
            return Variable(
                _first(value),
                _first(trainable),
                names[0],
                None,
                _first(synchronization),
                _first(aggregation),
            )

    return replica_context.merge_call(
        merge_fn, args=(value, name, trainable, synchronization, aggregation)
    )
