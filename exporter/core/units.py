"""Parse and format the human units used in flags, config and scenarios (durations, sizes).

Every duration and size has an upper bound: past it a value is a ValueError naming the bound,
so that no absurd value reaches a timer, a wait or a sleep (which raise OverflowError far below
what a float can hold).
"""

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
    "p": 1000**5,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h|d)")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_SHOWN = 40  # characters of a value quoted back in an error

#: The longest duration anything accepts: a year, leap day included. Far below what APScheduler,
#: datetime.timedelta, threading waits (threading.TIMEOUT_MAX) and time.sleep can hold.
MAX_DURATION = 366 * 86400.0
#: The largest size anything accepts: 1 PiB, far more than any GPU or host has.
MAX_SIZE = 1024**5
#: A size written without a unit is a count of bytes only from here on: ``20`` is far more
#: likely a forgotten ``GiB`` than 20 bytes of GPU memory, so a bare number from 1 to below
#: this is refused with a hint (``0`` and ``20B`` are fine).
BARE_BYTES_MIN = 1024**2
#: The words for "no limit" that a duration or a count may take where the caller allows it
#: (``--wait forever``, ``--max-restarts unlimited``, ``--restart-reset never``); see
#: ``config.validate.or_word``.
FOREVER, UNLIMITED, NEVER = "forever", "unlimited", "never"


def parse_duration(value: object, maximum: float = MAX_DURATION) -> float:
    """Seconds from a number (seconds) or a string like ``500ms``, ``30s``, ``5m``, ``1h30m``;
    from 0 to ``maximum`` (default :data:`MAX_DURATION`)."""
    seconds = _duration_seconds(value)
    if math.isnan(seconds) or (math.isinf(seconds) and _says_infinity(value)):
        raise ValueError(f"expected a finite duration, got {shown(value)}")
    if seconds < 0:
        raise ValueError(f"a duration must be 0 or more, got {shown(value)}")
    if seconds > maximum:
        longest = format_duration(maximum)
        raise ValueError(f"{shown(value)} is longer than the maximum {longest}")
    return seconds + 0.0  # -0.0 is 0


def _duration_seconds(value: object) -> float:
    """Seconds, unchecked: NaN, infinite or negative as written; ``inf`` when too large for a
    float."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 5s or 500ms, got {value!r}")
    if isinstance(value, (int, float)):
        return _float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a duration like 5s or 500ms, got {quoted(value)}")
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    pos, seconds = 0, 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            break
        seconds += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos == 0 or pos != len(text):
        raise ValueError(f"expected a duration like 5s, 500ms or 1m30s, got {quoted(value)}")
    return seconds


def parse_size(value: object, maximum: int = MAX_SIZE) -> int:
    """Bytes from an integer or a string like ``512MiB``, ``4GiB``, ``80GB``; from 0 to
    ``maximum`` (default :data:`MAX_SIZE`). A number without a unit is bytes only when it is 0
    or at least :data:`BARE_BYTES_MIN` (YAML integers and strings alike); ``20`` is refused with
    "did you mean 20GiB?"."""
    number, unit = _size_parts(value)
    if unit not in _SIZE_UNITS:
        raise ValueError(
            f"unknown size unit {unit!r} in {quoted(value)} "
            "(use B, KiB, MiB, GiB, TiB, PiB, KB, MB, GB, TB, PB)"
        )
    if math.isnan(number) or (math.isinf(number) and _says_infinity(value)):
        raise ValueError(f"expected a finite size, got {shown(value)}")
    if number < 0:
        raise ValueError(f"a size must be 0 or more, got {shown(value)}")
    if unit == "" and 0 < number < BARE_BYTES_MIN:
        raise ValueError(_bare_hint(value))
    total = number * _SIZE_UNITS[unit]
    if total > maximum:
        raise ValueError(f"{shown(value)} is larger than the maximum {format_size(maximum)}")
    return int(total)


def _bare_hint(value: object) -> str:
    """The message for a small size without a unit (``20``): what was probably meant."""
    text = shown(value)
    return f"{text} has no unit: did you mean {text}GiB? (write {text}B for bytes)"


def _size_parts(value: object) -> tuple[float, str]:
    """(number, lower-case unit) as written; the number is ``inf`` when too large for a float."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 4GiB or 512MiB, got {value!r}")
    if isinstance(value, (int, float)):
        return _float(value), ""
    if isinstance(value, str) and (match := _SIZE.match(value)):
        return float(match.group(1)), match.group(2).lower()
    raise ValueError(f"expected a size like 4GiB or 512MiB, got {quoted(value)}")


def _float(value: int | float) -> float:
    """``value`` as a float; ``inf`` (or ``-inf``) for an integer too large for one."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _says_infinity(value: object) -> bool:
    """Whether ``value`` is an infinity as written (``inf``, ``.inf``), not a huge number."""
    return isinstance(value, float) or (isinstance(value, str) and "inf" in value.lower())


def shown(value: object) -> str:
    """``value`` as written, cut short for an error message."""
    try:
        text = value.strip() if isinstance(value, str) else str(value)
    except ValueError:  # an integer of more digits than str() converts
        text = "a huge number"
    return _cut(text)


def quoted(value: object) -> str:
    """``repr(value)``, cut short for an error message."""
    return _cut(repr(value)) if isinstance(value, str) else shown(value)


def _cut(text: str) -> str:
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def format_duration(seconds: float) -> str:
    """``366d``, ``1h``, ``10ms``: the largest unit that holds ``seconds`` whole, else seconds."""
    for unit, size in sorted(_DURATION_UNITS.items(), key=lambda item: -item[1]):
        count = seconds / size
        if count >= 1 and abs(count - round(count)) < 1e-9:
            return f"{round(count)}{unit}"
    return f"{seconds:g}s"


def format_size(size: int) -> str:
    """``1PiB``, ``512MiB``: the largest binary unit that holds ``size`` whole, else bytes."""
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
        factor = _SIZE_UNITS[unit.lower()]
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}B"


def format_bytes(value: float | None) -> str:
    """``12.3GiB`` style, binary units; ``-`` for unknown."""
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"
