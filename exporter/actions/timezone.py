"""The time zone the actions' schedules (``cron``) are read in: the host's, or UTC where none is
configured, as in a slim container image.

APScheduler asks tzlocal for the local zone, and tzlocal warns on standard error ("Can not find
any timezone configuration, defaulting to UTC") where neither ``TZ`` nor ``/etc/localtime`` nor
``/etc/timezone`` says one. The agent decides first: ``TZ`` when it is set (``TZ=Europe/Berlin``,
or ``:Europe/Berlin``), else the host's zone files through tzlocal, else UTC, without a warning.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import warnings
import zoneinfo
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

#: Where a Linux host keeps its zone (tzlocal reads these).
ZONE_FILES = ("/etc/localtime", "/etc/timezone")


def schedule_timezone(
    environ: Mapping[str, str] | None = None,
    exists: Callable[[str], bool] = os.path.exists,
) -> datetime.tzinfo:
    """The zone cron expressions are read in (see the module docstring)."""
    environ = os.environ if environ is None else environ
    name = environ.get("TZ", "").strip()
    if name:
        key = name[1:] if name.startswith(":") else name
        try:
            return zoneinfo.ZoneInfo(key)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            log.warning("TZ=%r is not a time zone this host knows; schedules use UTC", name)
            return datetime.timezone.utc
    if not any(exists(path) for path in ZONE_FILES):
        return datetime.timezone.utc  # no zone configured: what tzlocal would say, silently
    import tzlocal  # APScheduler's own dependency

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a zone file it cannot read: UTC, said below instead
        try:
            return tzlocal.get_localzone()
        except Exception as exc:  # tzlocal raises its own errors for broken zone files
            log.warning("the host's time zone cannot be read (%s); schedules use UTC", exc)
            return datetime.timezone.utc


@functools.cache
def host_timezone() -> datetime.tzinfo:
    """:func:`schedule_timezone` of this process, decided once."""
    return schedule_timezone()
