"""Parse and format the human units used in flags, config and scenarios (durations, sizes)."""

from __future__ import annotations

import math
import re

_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h|d)")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_duration(value: object) -> float:
    """Seconds from a number (seconds) or a string like ``500ms``, ``30s``, ``5m``, ``1h30m``."""
    try:
        return _parse_duration(value)
    except OverflowError:
        raise ValueError(f"duration is too large: {str(value)[:20]}...") from None


def _parse_duration(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 5s or 500ms, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            pos, seconds = 0, 0.0
            for match in _DURATION_PART.finditer(text):
                if match.start() != pos:
                    break
                seconds += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
                pos = match.end()
            if pos == 0 or pos != len(text):
                raise ValueError(
                    f"expected a duration like 5s, 500ms or 1m30s, got {value!r}"
                ) from None
    else:
        raise ValueError(f"expected a duration like 5s or 500ms, got {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"duration must be a finite, non-negative number, got {value!r}")
    return seconds


def parse_size(value: object) -> int:
    """Bytes from an integer or a string like ``512MiB``, ``4GiB``, ``80GB``."""
    try:
        return _parse_size(value)
    except OverflowError:
        raise ValueError(f"size is too large: {str(value)[:20]}...") from None


def _parse_size(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 4GiB or 512MiB, got {value!r}")
    if isinstance(value, int):
        number, unit = float(value), ""
    elif isinstance(value, float):
        number, unit = value, ""
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise ValueError(f"expected a size like 4GiB or 512MiB, got {value!r}")
    if unit not in _SIZE_UNITS:
        raise ValueError(
            f"unknown size unit {unit!r} in {value!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB)"
        )
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"size must be a finite, non-negative number, got {value!r}")
    return int(number * _SIZE_UNITS[unit])


def format_bytes(value: float | None) -> str:
    """``12.3GiB`` style, binary units; ``-`` for unknown."""
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"
