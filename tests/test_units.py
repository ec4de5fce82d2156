"""Durations, sizes and byte formatting: the units every flag, config key and scenario uses."""

from __future__ import annotations

import math
import re

import pytest

from exporter.config.policies import policy_with
from exporter.config.validate import (
    duration_or_forever,
    positive_duration_or_never,
    size,
    whole_or_unlimited,
)
from exporter.core.selection import Policy
from exporter.core.units import (
    MAX_DURATION,
    MAX_SIZE,
    format_bytes,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1h", 3600.0),
        ("1m30s", 90.0),
        ("2d", 172800.0),
        ("250us", 0.00025),
        ("1.5s", 1.5),
        ("0s", 0.0),
        (" 30s ", 30.0),
        (2, 2.0),
        (0, 0.0),
        (0.25, 0.25),
        ("2.5", 2.5),
        ("10", 10.0),
    ],
)
def test_parse_duration_accepts(text: object, seconds: float) -> None:
    result = parse_duration(text)
    assert isinstance(result, float)
    assert result == pytest.approx(seconds)


def test_parse_duration_ms_is_not_minutes() -> None:
    # "ms" must win over "m" followed by a stray "s": 5ms is 5 thousandths, not 5 minutes.
    assert parse_duration("5ms") == pytest.approx(0.005)
    assert parse_duration("5m5s") == pytest.approx(305.0)


@pytest.mark.parametrize(
    "bad",
    [
        "abc",
        "5x",
        "-1",
        "-1s",
        True,
        False,
        "",
        "   ",
        "1m5",
        "s",
        "5 s",
        "5S",
        "nan",
        "inf",
        float("nan"),
        float("inf"),
        -1,
        -0.5,
        None,
        [5],
        {"s": 5},
    ],
)
def test_parse_duration_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_parse_duration_error_names_the_value() -> None:
    with pytest.raises(ValueError, match="5x"):
        parse_duration("5x")


@pytest.mark.parametrize("huge", [10**400, "1" + "0" * 400, "1" + "0" * 305 + "d"])
def test_parse_duration_huge_is_a_value_error(huge: object) -> None:
    # float(10**400) raises OverflowError: it must come out as the ValueError validators catch.
    with pytest.raises(ValueError):
        parse_duration(huge)


# -- upper bounds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["366d", "365d24h", "8784h", 366 * 86400, 366 * 86400.0])
def test_parse_duration_accepts_the_maximum(text: object) -> None:
    assert parse_duration(text) == MAX_DURATION == 366 * 86400


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("367d", "367d"),
        ("366d1us", "366d1us"),
        ("99999999999999999999999999999d", "99999999999999999999999999999d"),
        ("200d200d", "200d200d"),
        (99999999999999999999999999999, "99999999999999999999999999999"),
        (1e300, "1e+300"),
        ("1e999", "1e999"),  # too large for a float: a huge number, not an infinity
        (10**400, "1" + "0" * 36 + "..."),
        ("1" + "0" * 305 + "d", "1" + "0" * 36 + "..."),
    ],
)
def test_parse_duration_rejects_longer_than_the_maximum(text: object, shown: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(text)
    assert str(info.value) == f"{shown} is longer than the maximum 366d"


def test_parse_duration_takes_a_smaller_maximum() -> None:
    assert parse_duration("1h", 3600) == 3600
    with pytest.raises(ValueError, match=r"^61m is longer than the maximum 1h$"):
        parse_duration("61m", 3600)


@pytest.mark.parametrize("bad", ["nan", "NaN", "inf", "-inf", "Infinity", math.nan, math.inf])
def test_parse_duration_rejects_non_finite(bad: object) -> None:
    with pytest.raises(ValueError, match="expected a finite duration"):
        parse_duration(bad)


def test_parse_duration_negative_zero_is_zero() -> None:
    assert math.copysign(1, parse_duration("-0.0")) == 1


@pytest.mark.parametrize("text", ["1PiB", "1024TiB", "1.0PiB", MAX_SIZE, float(MAX_SIZE)])
def test_parse_size_accepts_the_maximum(text: object) -> None:
    assert parse_size(text) == MAX_SIZE == 1024**5


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("2PiB", "2PiB"),
        ("1025TiB", "1025TiB"),
        ("2PB", "2PB"),  # 2 * 1000**5 bytes
        (MAX_SIZE + 1, str(MAX_SIZE + 1)),
        ("99999999999999999999999999999GiB", "99999999999999999999999999999GiB"),
        (10**400, "1" + "0" * 36 + "..."),
        ("1" + "0" * 300 + "TiB", "1" + "0" * 36 + "..."),
    ],
)
def test_parse_size_rejects_larger_than_the_maximum(text: object, shown: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert str(info.value) == f"{shown} is larger than the maximum 1PiB"


def test_parse_size_takes_a_smaller_maximum() -> None:
    with pytest.raises(ValueError, match=r"^2GiB is larger than the maximum 1GiB$"):
        parse_size("2GiB", 1024**3)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_parse_size_rejects_non_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="expected a finite size"):
        parse_size(bad)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(MAX_DURATION, "366d"), (3600, "1h"), (90, "90s"), (0.01, "10ms"), (1.5, "1500ms")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("size", "text"), [(MAX_SIZE, "1PiB"), (1024**3, "1GiB"), (1536, "1536B"), (0, "0B")]
)
def test_format_size(size: int, text: str) -> None:
    assert format_size(size) == text
    assert parse_size(text) == size


# -- sizes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512MiB", 512 * 1024**2),
        ("4GiB", 4 * 1024**3),
        ("80GB", 80 * 1000**3),
        ("80gb", 80 * 1000**3),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("4 GiB", 4 * 1024**3),
        ("2KiB", 2048),
        ("2k", 2000),
        ("1TiB", 1024**4),
        ("100B", 100),
        ("0", 0),
        (0, 0),
        ("1048576", 1024**2),  # a bare number is bytes from 1 MiB on
        (8 * 1024**3, 8 * 1024**3),
    ],
)
def test_parse_size_accepts(text: object, size: int) -> None:
    result = parse_size(text)
    assert isinstance(result, int)
    assert result == size


@pytest.mark.parametrize(
    "bad", ["4 XB", "-1", "GiB", "", "abc", "4GiBs", "1e3", True, None, -1, float("inf"), [4]]
)
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


def test_parse_size_unknown_unit_is_named() -> None:
    with pytest.raises(ValueError, match="XB"):
        parse_size("4 XB")


@pytest.mark.parametrize("huge", [10**400, "1" + "0" * 400, "1" + "0" * 300 + "TiB"])
def test_parse_size_huge_is_a_value_error(huge: object) -> None:
    # Each overflows a float somewhere (the number, or the number times the unit).
    with pytest.raises(ValueError):
        parse_size(huge)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "-"),
        (0, "0B"),
        (1, "1B"),
        (1023, "1023B"),
        (1024, "1.0KiB"),
        (1536, "1.5KiB"),
        (512 * 1024**2, "512.0MiB"),
        (80 * 1024**3, "80.0GiB"),
        (61 * 1024**3 + 512 * 1024**2, "61.5GiB"),
        (2 * 1024**4, "2.0TiB"),
        (1024**5, "1024.0TiB"),
        (-2048, "-2.0KiB"),
    ],
)
def test_format_bytes(value: float | None, text: str) -> None:
    assert format_bytes(value) == text


def test_format_bytes_round_trips_parse_size() -> None:
    assert format_bytes(parse_size("4GiB")) == "4.0GiB"
    assert format_bytes(parse_size("537MiB")) == "537.0MiB"


# -- a bare number below 1 MiB is a forgotten unit -------------------------------------------------


@pytest.mark.parametrize(
    ("bare", "shown"),
    [("20", "20"), (20, "20"), ("  8 ", "8"), ("0.5", "0.5"), (1024, "1024"), (1048575, "1048575")],
)
def test_a_small_size_without_a_unit_is_refused_with_a_hint(bare: object, shown: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(bare)
    assert (
        str(info.value)
        == f"{shown} has no unit: did you mean {shown}GiB? (write {shown}B for bytes)"
    )


@pytest.mark.parametrize("spelled", ["20B", "20b", "1024B", "20 B"])
def test_bytes_spelled_as_bytes_are_fine(spelled: str) -> None:
    assert parse_size(spelled) == int(spelled.strip().rstrip("Bb").strip())


def test_the_config_key_the_query_parameter_and_the_flag_agree() -> None:
    """One parser behind the three: YAML (validate.size), /recommend and the flags
    (policies.policy_with)."""
    for parse in (size, lambda raw: policy_with(Policy("p"), {"min_free_memory": raw})):
        with pytest.raises(ValueError, match=r"did you mean 20GiB\?"):
            parse("20")
    with pytest.raises(ValueError, match=r"did you mean 20GiB\?"):
        size(20)  # a YAML integer too
    assert size("20GiB") == policy_with(Policy("p"), {"min_free_memory": "20GiB"}).min_free_memory


# -- words for "no limit" ----------------------------------------------------------------------


def test_forever_unlimited_and_never() -> None:
    assert duration_or_forever("forever") == math.inf
    assert duration_or_forever(" Forever ") == math.inf
    assert duration_or_forever("10m") == 600
    assert whole_or_unlimited(0, 10)("unlimited") is None
    assert whole_or_unlimited(0, 10)("3") == 3
    assert positive_duration_or_never("never") is None
    assert positive_duration_or_never("10m") == 600
    for parse, bad, needle in [
        (duration_or_forever, "inf", "(or forever)"),
        (duration_or_forever, "soon", "(or forever)"),
        (duration_or_forever, "-5s", "-5s"),
        (whole_or_unlimited(0, 10), "many", "(or unlimited)"),
        (whole_or_unlimited(0, 10), "11", "from 0 to 10"),
        (positive_duration_or_never, "0", "more than 0s"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            parse(bad)
