"""Cron expressions fire when cron would: weekdays, steps, day-of-month OR day-of-week, macros."""

from __future__ import annotations

import datetime

import pytest
from tzlocal import get_localzone

from exporter.actions.cron import cron_trigger
from exporter.actions.engine import parse_actions
from exporter.config.yamlconf import ConfigError, parse_document

UTC = datetime.timezone.utc
START = datetime.datetime(2026, 12, 1, tzinfo=UTC)  # a Tuesday, 00:00


def fires(expression: str, count: int, tz: datetime.tzinfo = UTC) -> list[str]:
    """The first ``count`` firing times (UTC, ``YYYY-MM-DD HH:MM``) from START."""
    trigger = cron_trigger(expression, timezone=tz)
    found: list[str] = []
    now = START
    for _ in range(count):
        fire = trigger.get_next_fire_time(None, now)
        assert fire is not None
        found.append(fire.astimezone(UTC).strftime("%Y-%m-%d %H:%M"))
        now = fire + datetime.timedelta(seconds=1)
    return found


def days(*dates: str, at: str = "09:00") -> list[str]:
    """``2026-12-DD HH:MM`` for each day ``DD`` (or a full ``YYYY-MM-DD``)."""
    return [f"{d if '-' in d else '2026-12-' + d} {at}" for d in dates]


def test_start_is_a_tuesday():
    assert START.strftime("%a") == "Tue"


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("0 9 * * 0", days("06", "13")),  # Sundays
        ("0 9 * * 7", days("06", "13")),  # 7 is Sunday too
        ("0 9 * * 0,7", days("06", "13")),
        ("0 9 * * 0-6", days("01", "02", "03", "04", "05", "06", "07")),  # every day
        ("0 9 * * 0-7", days("01", "02", "03", "04", "05", "06", "07")),
        ("0 9 * * 0-5", days("01", "02", "03", "04", "06", "07")),  # not Saturday the 5th
        ("0 9 * * 1-5/2", days("02", "04", "07", "09")),  # Mon, Wed, Fri
        ("0 9 * * */2", days("01", "03", "05", "06", "08")),  # Sun, Tue, Thu, Sat
        ("0 9 * * */3", days("02", "05", "06", "09")),  # Sun, Wed, Sat
        ("0 9 * * sun", days("06", "13")),
        ("0 9 * * SUN", days("06", "13")),
        ("0 9 * * mon-fri", days("01", "02", "03", "04", "07")),
        ("0 9 * * Mon-Fri/2", days("02", "04", "07")),
        ("0 9 * * fri-7", days("04", "05", "06", "11")),  # Fri, Sat, Sun
        ("0 0 * * 6,0", days("05", "06", "12", "13", at="00:00")),
        ("0 9 1 * 1", days("01", "07", "14", "21", "28", "2027-01-01", "2027-01-04")),  # dom OR dow
        ("0 9 1-2 * sat", days("01", "02", "05", "12")),
        ("0 9 1 * */2", days("01", "2027-04-01")),  # dow starts with *: dom AND dow, as in cron
        ("0 9 * * 1", days("07", "14")),  # dom * : weekdays only
        ("0 9 30 2 1", days("2027-02-01", "2027-02-08")),  # no Feb 30: Mondays of February
        ("0 9 29 2 *", days("2028-02-29")),
        (
            "*/15 * * * *",
            [
                "2026-12-01 00:00",
                "2026-12-01 00:15",
                "2026-12-01 00:30",
                "2026-12-01 00:45",
                "2026-12-01 01:00",
            ],
        ),
        (
            "5,10-11 22-23 * * *",
            ["2026-12-01 22:05", "2026-12-01 22:10", "2026-12-01 22:11", "2026-12-01 23:05"],
        ),
        ("0 12 1 jan-MAR/2 *", days("2027-01-01", "2027-03-01", "2028-01-01", at="12:00")),
        ("0 12 15 */4 *", days("2027-01-15", "2027-05-15", "2027-09-15", at="12:00")),
        ("00 09 01 * *", days("01", "2027-01-01")),  # leading zeros
        ("  0\t9 * *   0 ", days("06")),  # any whitespace between fields
        ("@hourly", ["2026-12-01 00:00", "2026-12-01 01:00"]),
        ("@daily", days("01", "02", at="00:00")),
        ("@midnight", days("01", "02", at="00:00")),
        ("@DAILY", days("01", at="00:00")),
        ("@weekly", days("06", "13", at="00:00")),  # Sunday
        ("@monthly", days("01", "2027-01-01", at="00:00")),
        ("@yearly", days("2027-01-01", "2028-01-01", at="00:00")),
        ("@annually", days("2027-01-01", at="00:00")),
    ],
)
def test_next_fire_times(expression, expected):
    assert fires(expression, len(expected)) == expected


def test_expected_weekdays_are_the_days_cron_names():
    names = {
        "0 9 * * 1-5/2": {"Mon", "Wed", "Fri"},
        "0 9 * * */2": {"Sun", "Tue", "Thu", "Sat"},
        "0 9 * * 0-5": {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri"},
    }
    for expression, weekdays in names.items():
        week = fires(expression, len(weekdays))
        seen = {datetime.datetime.strptime(f, "%Y-%m-%d %H:%M").strftime("%a") for f in week}
        assert seen == weekdays, expression


def test_timezone_is_the_one_given():
    plus_one = datetime.timezone(datetime.timedelta(hours=1))
    assert fires("0 9 * * *", 1, tz=plus_one) == ["2026-12-01 08:00"]


def test_timezone_defaults_to_host_local_time():
    assert cron_trigger("0 9 * * *").timezone == get_localzone()


def test_the_engine_schedules_with_this_cron_trigger():
    from exporter.actions import engine as scheduler

    assert scheduler.cron_trigger is cron_trigger


@pytest.mark.parametrize(
    ("expression", "needles"),
    [
        ("0 9 * * 8", ["day-of-week", "'8'", "out of range 0-7"]),
        ("0 9 * * 5-1", ["day-of-week", "'5-1'", "do not wrap", "5-7,0-1"]),
        ("0 9 * * sat-sun", ["day-of-week", "'sat-sun'", "do not wrap"]),
        ("0 9 * * mon-", ["day-of-week", "'mon-'", "missing"]),
        ("0 9 * * -1", ["day-of-week", "'-1'", "missing"]),
        ("0 9 * * * *", ["expected 5 fields", "got 6"]),
        ("0 9 * *", ["expected 5 fields", "got 4"]),
        ("", ["expected 5 fields", "got 0"]),
        ("every day", ["expected 5 fields", "got 2"]),
        ("0 24 * * *", ["hour", "'24'", "out of range 0-23"]),
        ("60 * * * *", ["minute", "'60'", "out of range 0-59"]),
        ("0 9 0 * *", ["day-of-month", "'0'", "out of range 1-31"]),
        ("0 9 * 13 *", ["month", "'13'", "out of range 1-12"]),
        ("0 9 * * 1/0", ["day-of-week", "'1/0'", "step '0'"]),
        ("0 9 * * */0", ["day-of-week", "'*/0'", "step '0'"]),
        ("0 9 * * 1-5/x", ["day-of-week", "step 'x'"]),
        ("0 9 * * 1/2", ["day-of-week", "'1/2'", "needs * or a range"]),
        ("0 9 * * monday", ["day-of-week", "'monday'", "sun..sat"]),
        ("0 9 * foo *", ["month", "'foo'", "jan..dec"]),
        ("0 9 1,,2 * *", ["day-of-month", "'1,,2'", "empty list item"]),
        ("0 9 * * L", ["day-of-week", "'L'"]),  # no Quartz / APScheduler extensions
        ("0 9 last * *", ["day-of-month", "'last'"]),
        ("0 9 ? * *", ["day-of-month", "'?'"]),
        ("0 9 * * \u0663", ["day-of-week"]),  # only ASCII digits
        ("0 0 30 2 *", ["day-of-month", "'30'", "no month"]),
        ("@reboot", ["unknown macro", "@reboot"]),
    ],
)
def test_invalid_expressions_name_the_field_and_token(expression, needles):
    with pytest.raises(ValueError) as failed:
        cron_trigger(expression)
    assert all(needle in str(failed.value) for needle in needles), str(failed.value)


def test_a_bad_cron_is_a_config_error_at_its_line():
    text = "actions:\n  thermal:\n    cron: '0 9 * * 5-1'\n"
    with pytest.raises(ConfigError) as failed:
        parse_actions(parse_document(text, "c.yaml").root().section("actions"))
    message = str(failed.value)
    assert message.startswith("c.yaml:3") and "actions.thermal.cron" in message, message
    assert "do not wrap" in message, message


# -- the schedules' time zone ------------------------------------------------------------------


def test_the_schedule_zone_is_utc_without_a_warning_where_none_is_configured(caplog):
    import warnings

    from exporter.actions.timezone import schedule_timezone

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tzlocal's UserWarning would fail the test
        zone = schedule_timezone({}, exists=lambda path: False)
    assert zone is datetime.timezone.utc and caplog.records == []


def test_the_schedule_zone_follows_tz(caplog):
    import zoneinfo

    from exporter.actions.timezone import schedule_timezone

    assert schedule_timezone({"TZ": "Europe/Berlin"}) == zoneinfo.ZoneInfo("Europe/Berlin")
    assert schedule_timezone({"TZ": ":Asia/Tokyo"}) == zoneinfo.ZoneInfo("Asia/Tokyo")
    assert schedule_timezone({"TZ": "Mars/Olympus_Mons"}) is datetime.timezone.utc
    assert caplog.messages == [
        "TZ='Mars/Olympus_Mons' is not a time zone this host knows; schedules use UTC"
    ]


def test_cron_triggers_use_the_schedule_zone():
    from exporter.actions.timezone import host_timezone

    assert cron_trigger("0 9 * * 1").timezone == host_timezone()
