"""`Optional`: a value that may be absent (TF's `tf.experimental.Optional`).

`DistributedIterator.get_next_as_optional()` returns one: it holds the next step's
per-replica values, or nothing once the dataset is exhausted, so a training loop can
test for the end without catching `StopIteration`.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, final

__all__ = ["Optional"]

T = TypeVar("T")

#: Marks an empty Optional (None is a valid value).
_ABSENT: Any = object()


@final
class Optional(Generic[T]):
    """A value, or nothing (TF's `tf.experimental.Optional`, eager semantics).

    Make one with `Optional.from_value(v)` or `Optional.empty()`; ask `has_value()`
    before `get_value()`. `bool(optional)` is `has_value()` (ours: TF's is a tensor).

    Example:
        >>> full = Optional.from_value(3)
        >>> full.has_value(), full.get_value()
        (True, 3)
        >>> Optional.empty().has_value()
        False
    """

    __slots__ = ("_value",)

    def __init__(self, value: Any = _ABSENT) -> None:
        self._value = value

    @staticmethod
    def from_value(value: T) -> Optional[T]:
        """An Optional holding `value` (which may be None)."""
        return Optional(value)

    @staticmethod
    def empty(element_spec: Any = None) -> Optional[Any]:
        """An Optional holding nothing; `element_spec` is accepted for TF compatibility."""
        del element_spec
        return Optional()

    def has_value(self) -> bool:
        """Whether there is a value."""
        return self._value is not _ABSENT

    def get_value(self) -> T:
        """The value.

        Raises:
            ValueError: the Optional is empty (TF raises InvalidArgumentError); test
                `has_value()` first.
        """
        if self._value is _ABSENT:
            raise ValueError(
                "The Optional has no value (the iterator is exhausted); check has_value() "
                "before get_value()"
            )
        return self._value

    def __bool__(self) -> bool:
        return self.has_value()

    def __repr__(self) -> str:
        return f"<crossdevice.experimental.Optional has_value={self.has_value()}>"
