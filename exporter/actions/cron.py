"""Crontab expressions as APScheduler triggers that fire when cron would.

Five fields: minute, hour, day of month, month, day of week, as in Vixie cron and crontab(5).
Each field is parsed here into an explicit set of values (lists, ranges, steps on ``*`` and on
ranges, names of months and weekdays in any case) and handed to APScheduler as plain lists, so
that APScheduler's own dialect never gets to reinterpret it. Day of week: 0 and 7 are Sunday
(APScheduler alone reads 0 as Monday). As in cron, when both the day of month and the day of
week are restricted (neither field starts with ``*``), a day matches when EITHER matches; then
the trigger is an ``OrTrigger`` of two ``CronTrigger``. The ``@hourly`` ... ``@yearly`` macros
work too. Anything else raises ValueError naming the field and the bad token.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.combining import OrTrigger
from apscheduler.triggers.cron import CronTrigger

from exporter.actions.timezone import host_timezone

#: The ``@`` macros of Vixie cron (``@reboot`` has no meaning for a scheduler of repeats).
MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_CRON_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")  # cron's numbers: 0 is Sunday
_APS_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # APScheduler's: 0 is Monday
_MONTH_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)  # longest length of each month
_NUMBER = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class _Field:
    """One crontab field: its name in errors, its range, and the names of its values."""

    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()
    first_named: int = 0  # the number that names[0] stands for

    def error(self, token: str, why: str) -> ValueError:
        """A ValueError naming this field and the bad token."""
        return ValueError(f"cron {self.name} field {token!r}: {why}")


_MINUTE = _Field("minute", 0, 59)
_HOUR = _Field("hour", 0, 23)
_DOM = _Field("day-of-month", 1, 31)
_MONTH = _Field("month", 1, 12, _MONTHS, 1)
_DOW = _Field("day-of-week", 0, 7, _CRON_DAYS, 0)  # 7 is Sunday again
_FIELDS = (_MINUTE, _HOUR, _DOM, _MONTH, _DOW)


def cron_trigger(expression: str, timezone: datetime.tzinfo | str | None = None) -> BaseTrigger:
    """A trigger that fires when cron would run ``expression`` (five fields or an ``@`` macro),
    in ``timezone`` (default: the host's, see ``actions.timezone``)."""
    texts = _split(expression)
    minute, hour, dom, month, dow = (
        _parse_field(text, field) for text, field in zip(texts, _FIELDS, strict=True)
    )
    common = {
        "second": 0,
        "minute": _listing(minute, _MINUTE),
        "hour": _listing(hour, _HOUR),
        "month": _listing(month, _MONTH),
        "timezone": timezone if timezone is not None else host_timezone(),
    }
    by_dom = {"day": _listing(dom, _DOM)}
    by_dow = {"day_of_week": _weekdays(dow)}
    if texts[2].startswith("*") or texts[4].startswith("*"):  # cron: both must match
        _check_possible(dom, month, texts)
        return CronTrigger(**by_dom, **by_dow, **common)
    if not _possible(dom, month):  # that half never fires: only the weekdays do
        return CronTrigger(**by_dow, **common)
    return OrTrigger([CronTrigger(**by_dom, **common), CronTrigger(**by_dow, **common)])


def _split(expression: str) -> list[str]:
    """The five fields of ``expression``, a macro expanded."""
    texts = expression.split()
    if len(texts) == 1 and texts[0].startswith("@"):
        macro = texts[0].lower()
        if macro not in MACROS:
            known = ", ".join(MACROS)
            raise ValueError(f"cron: unknown macro {texts[0]!r} (known: {known})")
        texts = MACROS[macro].split()
    if len(texts) != 5:
        raise ValueError(
            f"cron: expected 5 fields (minute hour day-of-month month day-of-week), "
            f"got {len(texts)} in {expression!r}"
        )
    return texts


def _parse_field(text: str, field: _Field) -> frozenset[int]:
    """The values ``text`` (a comma-separated list) selects; for day of week 0..6, 0 Sunday."""
    values: set[int] = set()
    for item in text.split(","):
        if not item:
            raise field.error(text, "empty list item")
        values |= _parse_item(item, field)
    if field is _DOW:
        values = {value % 7 for value in values}
    return frozenset(values)


def _parse_item(item: str, field: _Field) -> set[int]:
    """The values of one list item: ``*``, ``N``, ``A-B``, each of the first and last ``/STEP``."""
    base, slash, step_text = item.partition("/")
    step = _step(step_text, item, field) if slash else 1
    if base == "*":
        first, last = field.low, field.high
    elif "-" in base:
        first, last = _range(base, item, field)
    elif slash:
        raise field.error(item, "a step needs * or a range before it (e.g. */2 or 1-5/2)")
    else:
        first = last = _value(base, item, field)
    return set(range(first, last + 1, step))


def _step(text: str, item: str, field: _Field) -> int:
    """The step after ``/``: a whole number of at least 1."""
    if not _NUMBER.fullmatch(text) or int(text) < 1:
        raise field.error(item, f"step {text!r} must be a whole number of at least 1")
    return int(text)


def _range(text: str, item: str, field: _Field) -> tuple[int, int]:
    """The first and last value of ``A-B``; cron ranges never wrap around."""
    start, _, end = text.partition("-")
    first, last = _value(start, item, field), _value(end, item, field)
    if first > last:
        raise field.error(
            item,
            f"range {start}-{end} runs backwards; cron ranges do not wrap around "
            f"(write it as a list, e.g. {start}-{field.high},{field.low}-{end})",
        )
    return first, last


def _value(token: str, item: str, field: _Field) -> int:
    """One number or name of ``field``."""
    if _NUMBER.fullmatch(token):
        number = int(token)
        if not field.low <= number <= field.high:
            raise field.error(item, f"{number} is out of range {field.low}-{field.high}")
        return number
    if token.lower() in field.names:
        return field.names.index(token.lower()) + field.first_named
    if not token:
        raise field.error(item, "a value is missing")
    expected = f"a number {field.low}-{field.high}"
    if field.names:
        expected += f" or a name {field.names[0]}..{field.names[-1]}"
    raise field.error(item, f"{token!r} is not {expected}")


def _possible(dom: frozenset[int], month: frozenset[int]) -> bool:
    """Whether some selected day of month exists in some selected month."""
    return any(day <= _MONTH_DAYS[number - 1] for number in month for day in dom)


def _check_possible(dom: frozenset[int], month: frozenset[int], texts: list[str]) -> None:
    """Refuse a day of month that none of the months has (cron would silently never run)."""
    if not _possible(dom, month):
        raise _DOM.error(texts[2], f"no month in month field {texts[3]!r} has such a day")


def _listing(values: Iterable[int], field: _Field) -> str:
    """An APScheduler expression for ``values`` of ``field``: ``*`` or a list of runs."""
    return _runs(values, field.low, field.high, str)


def _weekdays(dow: frozenset[int]) -> str:
    """An APScheduler day_of_week expression (names) for cron weekday numbers (0 Sunday)."""
    return _runs({(day - 1) % 7 for day in dow}, 0, 6, _APS_DAYS.__getitem__)


def _runs(values: Iterable[int], low: int, high: int, label: Callable[[int], str]) -> str:
    """``*`` when ``values`` is all of low..high, else its consecutive runs: ``1-5,7``."""
    ordered = sorted(set(values))
    if ordered == list(range(low, high + 1)):
        return "*"
    runs: list[list[int]] = []
    for value in ordered:
        if runs and runs[-1][1] == value - 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ",".join(
        label(first) if first == last else f"{label(first)}-{label(last)}" for first, last in runs
    )
