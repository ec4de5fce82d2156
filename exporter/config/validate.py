"""The one validator family: every setting, flag, environment variable and query parameter is
parsed by these functions, so the same words mean the same thing everywhere. Each returns the
value or raises ValueError with a one-line message (the caller adds the file and line, the flag,
the variable or the parameter).

YAML gives typed values (numbers, booleans); flags, variables and query parameters give strings.
Where both can come, both are taken: a number may be ``2`` or ``"2"``, a switch ``true`` or
``"on"``. Only ASCII digits are digits (``str.isdigit`` would take ``²`` and Arabic-Indic ones).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from exporter.core.units import (
    FOREVER,
    MAX_DURATION,
    MAX_SIZE,
    NEVER,
    UNLIMITED,
    format_duration,
    parse_duration,
    parse_size,
    quoted,
)

T = TypeVar("T")
U = TypeVar("U")


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
    """A size in bytes (``4GiB``, ``512MiB``), at most ``MAX_SIZE``; a bare number below 1 MiB
    (but 0) is refused with "did you mean 20GiB?" (see ``core.units.parse_size``)."""
    return parse_size(raw, MAX_SIZE)


def or_word(parse: Callable[[Any], T], word: str, value: U) -> Callable[[Any], T | U]:
    """``parse``, or ``word`` (in any case) for ``value``: ``or_word(duration, "forever",
    math.inf)`` takes ``10m`` and ``forever``. A message about the form names the word too."""

    def parsed(raw: Any) -> T | U:
        if isinstance(raw, str) and raw.strip().lower() == word:
            return value
        try:
            return parse(raw)
        except ValueError as exc:
            hint = f" (or {word})" if str(exc).startswith("expected") else ""
            raise ValueError(f"{exc}{hint}") from None

    return parsed


#: A duration from zero to ``MAX_DURATION``, or ``forever`` (``math.inf``): ``--wait``.
duration_or_forever: Callable[[Any], float] = or_word(duration, FOREVER, math.inf)
#: A duration greater than zero, or ``never`` (None): ``--restart-reset``.
positive_duration_or_never: Callable[[Any], float | None] = or_word(positive_duration, NEVER, None)


def whole_or_unlimited(minimum: int, maximum: int) -> Callable[[Any], int | None]:
    """A whole number from ``minimum`` to ``maximum``, or ``unlimited`` (None)."""
    return or_word(whole(minimum, maximum), UNLIMITED, None)


def ratio(raw: Any) -> float:
    """A number from 0 to 1, or a percentage string from ``0%`` to ``100%``."""
    if isinstance(raw, str) and raw.strip().endswith("%"):
        value = number(raw.strip()[:-1]) / 100
        if not 0 <= value <= 1:
            raise ValueError(f"must be from 0% to 100%, got {quoted(raw)}")
        return value
    value = number(raw)
    if not 0 <= value <= 1:
        hint = f" (did you mean {raw}%?)" if 1 < value <= 100 else ""
        raise ValueError(f"must be from 0 to 1, got {raw!r}{hint}")
    return value


_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_WHOLE = re.compile(r"[0-9]{1,18}")
#: The words a switch takes, in any case, from a flag, a variable or a query parameter.
TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")


def number(raw: Any) -> float:
    """A finite number: a YAML number, or a decimal string (ASCII digits, an optional sign,
    point and exponent; no ``nan``, ``inf`` or ``1_000``)."""
    if isinstance(raw, str):
        text = raw.strip()
        if not _DECIMAL.fullmatch(text):
            raise ValueError(f"expected a number, got {quoted(raw)}")
        raw = float(text)
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


def whole(minimum: int, maximum: int) -> Callable[[Any], int]:
    """A whole number from ``minimum`` to ``maximum``: a YAML integer, or a string of ASCII
    digits (for a minimum below 0, a leading ``-`` too)."""

    def parse(raw: Any) -> int:
        if isinstance(raw, str):
            text = raw.strip()
            digits = text[1:] if minimum < 0 and text.startswith("-") else text
            if not _WHOLE.fullmatch(digits):
                raise ValueError(f"expected a whole number, got {quoted(raw)}")
            raw = int(text)
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"expected a whole number, got {raw!r}")
        if not minimum <= raw <= maximum:
            raise ValueError(f"must be from {minimum} to {maximum}, got {raw!r}")
        return raw

    return parse


def boolean(raw: Any) -> bool:
    """true or false in a YAML file: YAML booleans only (the string "false" is an error, not
    true; YAML itself reads an unquoted yes/no/on/off as a boolean)."""
    if not isinstance(raw, bool):
        raise ValueError(f"expected true or false, got {raw!r}")
    return raw


def switch(raw: Any) -> bool:
    """true or false from a flag, a variable or a query parameter as well as from YAML: a
    boolean, or one of :data:`TRUE_WORDS` / :data:`FALSE_WORDS` in any case."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise ValueError(f"expected true or false, got {quoted(raw)} (or yes/no, on/off, 1/0)")


def string_list(raw: Any) -> tuple[str, ...]:
    """A list of strings."""
    if not isinstance(raw, list) or not all(isinstance(item, (str, int)) for item in raw):
        raise ValueError(f"expected a list of names, got {raw!r}")
    return tuple(str(item) for item in raw)


#: The most peers a status page lists (``peers``).
MAX_PEERS = 64


def base_url(value: str) -> str:
    """A peer's base URL (``http://host:9402`` or ``https://...``, a path allowed), without a
    trailing slash; ValueError saying what is wrong."""
    text = str(value).strip()
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        raise ValueError(f"peer {text!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"peer {text!r}: expected http://HOST:PORT or https://HOST:PORT")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"peer {text!r}: no credentials in a peer URL (the page shows it)")
    if parts.query or parts.fragment:
        raise ValueError(f"peer {text!r}: a base URL has no query or fragment")
    return text.rstrip("/")


def peer_urls(value: Any) -> tuple[str, ...]:
    """The ``peers`` setting: a YAML list or a comma-separated string of base URLs."""
    if value in (None, ""):
        return ()
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"expected a list of base URLs, got {type(value).__name__}")
    urls = tuple(base_url(item) for item in items if str(item).strip())
    if len(urls) > MAX_PEERS:
        raise ValueError(f"at most {MAX_PEERS} peers, got {len(urls)}")
    if len(set(urls)) != len(urls):
        raise ValueError("a peer is listed twice")
    return urls
