"""The one way crossdevice reads a setting from an environment variable.

Two kinds of settings come from the environment: switches (`CROSSDEVICE_NATIVE`,
`CROSSDEVICE_KEEP_HEAP`, `CROSSDEVICE_SHARED_MEMORY`, `CROSSDEVICE_DEBUG`,
`CROSSDEVICE_PASS_ALL_REDUCE`) and counts
(`CROSSDEVICE_LOGICAL_CPUS`, `CROSSDEVICE_LOGICAL_GPUS`,
`CROSSDEVICE_SHARED_MEMORY_MIN_BYTES`, `CROSSDEVICE_TRACE_REPORT_EVERY`), and
durations (`CROSSDEVICE_DEAD_AFTER_SECONDS`, `CROSSDEVICE_INIT_TIMEOUT_SECONDS`). Each is read
here, alike: unset or blank means the default; surrounding spaces do not count; a switch
takes `1`/`0` or `true`/`false`, `yes`/`no`, `on`/`off` in any case. Anything else is a
`ValueError` naming the variable, what it received and what it accepts, never a silent
default: `CROSSDEVICE_SHARED_MEMORY=off` once meant "on" (only `0` turned it off).
"""

from __future__ import annotations

import math
import os
from typing import Final, TypeVar

__all__ = ["env_int", "env_seconds", "env_switch"]

_N = TypeVar("_N", int, float)
_ON: Final = frozenset({"1", "true", "yes", "on"})
_OFF: Final = frozenset({"0", "false", "no", "off"})


def env_switch(name: str, *, default: bool) -> bool:
    """Whether switch `name` is on: `default` when unset or blank.

    Raises:
        ValueError: the variable holds something other than a switch's words.
    """
    raw = os.environ.get(name)
    word = "" if raw is None else raw.strip().lower()
    if not word:
        return default
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise ValueError(
        f"{name} must be 1 or 0 (or true/false, yes/no, on/off), got {raw!r}; set one of "
        f"those or unset it for the default ({'on' if default else 'off'})"
    )


def env_int(name: str, *, minimum: int, what: str = "an integer") -> int | None:
    """The integer in `name`, at least `minimum`; None when unset or blank.

    Args:
        name: the variable.
        minimum: the smallest value accepted.
        what: what the value counts, for the error ("a byte count").

    Raises:
        ValueError: not an integer, or below `minimum`.
    """
    got = _number(name, int)
    if got is None:
        return None
    raw, value = got
    if value is None or value < minimum:
        raise ValueError(
            f"{name} must be {what} >= {minimum}, got {raw!r}; fix it (e.g. {name}="
            f"{max(minimum, 4)}) or unset it for the default"
        )
    return value


def env_seconds(name: str, *, minimum: float) -> float | None:
    """The duration in seconds in `name`, at least `minimum`; None when unset or blank.

    Raises:
        ValueError: not a number, not finite, or below `minimum`.
    """
    got = _number(name, float)
    if got is None:
        return None
    raw, value = got
    if value is None or not math.isfinite(value) or value < minimum:
        raise ValueError(
            f"{name} must be a number of seconds >= {minimum:g}, got {raw!r}; fix it (e.g. "
            f"{name}=20) or unset it for the default"
        )
    return value


def _number(name: str, kind: type[_N]) -> tuple[str, _N | None] | None:
    """(the text of `name`, its value as `kind` or None if it is no such number).

    None when the variable is unset or blank.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return raw, kind(raw)
    except ValueError:
        return raw, None
