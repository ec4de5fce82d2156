"""Validators for settings in config and scenario files: each returns the value or raises
ValueError with a one-line message (yamlconf adds the file, line and key)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from exporter.core.units import (
    MAX_DURATION,
    MAX_SIZE,
    format_duration,
    parse_duration,
    parse_size,
    quoted,
)


def positive_duration(raw: Any) -> float:
    """A duration greater than zero (``500ms``, ``30s``, ``5m``), at most ``MAX_DURATION``."""
    seconds = parse_duration(raw)
    if seconds <= 0:
        raise ValueError(f"must be more than 0s, got {quoted(raw)}")
    return seconds


def duration(raw: Any) -> float:
    """A duration from zero to ``MAX_DURATION``."""
    return parse_duration(raw)


def duration_between(minimum: float, maximum: float) -> Callable[[Any], float]:
    """A duration from ``minimum`` to ``maximum`` (which is at most ``MAX_DURATION``)."""
    if not 0 <= minimum <= maximum <= MAX_DURATION:
        raise ValueError(f"bad bounds {minimum!r} to {maximum!r}")

    def parse(raw: Any) -> float:
        seconds = parse_duration(raw, maximum)
        if seconds < minimum:
            raise ValueError(f"must be at least {format_duration(minimum)}, got {quoted(raw)}")
        return seconds

    return parse


def size(raw: Any) -> int:
    """A size in bytes (``4GiB``, ``512MiB``), at most ``MAX_SIZE``."""
    return parse_size(raw, MAX_SIZE)


def ratio(raw: Any) -> float:
    """A number from 0 to 1."""
    value = number(raw)
    if not 0 <= value <= 1:
        raise ValueError(f"must be from 0 to 1, got {raw!r}")
    return value


def number(raw: Any) -> float:
    """A finite number."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ValueError(f"expected a number, got {raw!r}")
    if not math.isfinite(raw):
        raise ValueError(f"expected a finite number, got {raw!r}")
    return float(raw)


def non_negative(raw: Any) -> float:
    """A finite number of 0 or more."""
    value = number(raw)
    if value < 0:
        raise ValueError(f"must be 0 or more, got {raw!r}")
    return value


def positive(raw: Any) -> float:
    """A finite number of more than 0."""
    value = number(raw)
    if value <= 0:
        raise ValueError(f"must be more than 0, got {raw!r}")
    return value


def celsius(raw: Any) -> float:
    """A temperature from -50 to 200 celsius."""
    value = number(raw)
    if not -50 <= value <= 200:
        raise ValueError(f"must be a temperature from -50 to 200 celsius, got {raw!r}")
    return value


def whole(minimum: int, maximum: int) -> Any:
    """A whole number from ``minimum`` to ``maximum``."""

    def parse(raw: Any) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"expected a whole number, got {raw!r}")
        if not minimum <= raw <= maximum:
            raise ValueError(f"must be from {minimum} to {maximum}, got {raw!r}")
        return raw

    return parse


def boolean(raw: Any) -> bool:
    """true or false (YAML booleans only: the string "false" is an error, not true)."""
    if not isinstance(raw, bool):
        raise ValueError(f"expected true or false, got {raw!r}")
    return raw


def string_list(raw: Any) -> tuple[str, ...]:
    """A list of strings."""
    if not isinstance(raw, list) or not all(isinstance(item, (str, int)) for item in raw):
        raise ValueError(f"expected a list of names, got {raw!r}")
    return tuple(str(item) for item in raw)
