"""`coerce_enum`: the one way a public argument becomes a member of one of our enums.

TF accepts an enum member or its name as a string in several places
(`tf.distribute.ReduceOp`, `VariableSynchronization`, `VariableAggregation`,
`CommunicationImplementation`, `InputReplicationMode`), and crossdevice's own string
choices are `StrEnum`s (replica execution modes, buffer aggregations); every one of them
goes through here, so a string in any case is accepted everywhere and a bad value raises the same
kind of error naming what was received and what would have been accepted.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["coerce_enum"]

E = TypeVar("E", bound=enum.Enum)


def coerce_enum(
    value: Any,
    kind: type[E],
    *,
    default: E | None = None,
    message: str | None = None,
    spellings: Mapping[str, E] | None = None,
    error: type[Exception] = ValueError,
) -> E:
    """`value` as a member of `kind`: the member itself, or its name (or value) as a string.

    Args:
        value: what the caller passed; a string names a member in any case.
        kind: the enum.
        default: the member None stands for; None: None is an error.
        message: the error's text, formatted with `value` (its `!r`) and `choices` (the
            accepted names); default: "expected one of ..., received ...".
        spellings: exact strings looked up first (a hot path's common spellings).
        error: the exception raised for a value that names no member.

    Returns:
        The member.

    Raises:
        error: `value` is neither a member nor a string naming one.

    Example:
        >>> import enum
        >>> class Color(enum.Enum):
        ...     RED = "red"
        >>> coerce_enum("Red", Color)
        <Color.RED: 'red'>
    """
    if type(value) is kind:
        return value
    if spellings is not None and type(value) is str:
        known = spellings.get(value)
        if known is not None:
            return known
    if value is None and default is not None:
        return default
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind[value.upper()]
        except KeyError:
            pass
    # A StrEnum is spelled by its values ('threads', 'first_replica'); others by name.
    choices = [m.value if issubclass(kind, enum.StrEnum) else m.name for m in kind]
    text = message or "expected a {kind} (one of {choices}, or its name), received {value}"
    raise error(text.format(value=repr(value), choices=choices, kind=kind.__name__))
