"""Settings of ``actions.zombie_reaper`` and the classes the reaper sorts GPU holders into."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from exporter.config.options import option, parse_options
from exporter.config.validate import boolean, duration, positive_duration, size, string_list, whole
from exporter.config.yamlconf import Section

CLASSES = ("orphan", "defunct", "uninterruptible", "unverifiable", "leaked")
#: The classes a signal can be sent to: only an orphan's evidence is conclusive (see evidence).
SIGNALLABLE_CLASSES = ("orphan",)
_NEVER_SIGNALLED = {
    "defunct": "a defunct process has exited already; only its parent can reap it",
    "uninterruptible": "a process in uninterruptible sleep (D) cannot be ended by a signal",
    "unverifiable": "the agent cannot tell whose job an unverifiable process is",
    "leaked": "leaked memory has no process to signal",
}
DEFAULT_PROTECT_NAMES = (
    "nvidia-persistenced",
    "nv-hostengine",
    "nvidia-fabricmanager",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "Xorg",
    "Xwayland",
    "dcgm*",
)


def _kill_classes(raw: Any) -> tuple[str, ...]:
    names = string_list(raw)
    for name in names:
        if name in _NEVER_SIGNALLED:
            raise ValueError(f"{name!r} is never signalled: {_NEVER_SIGNALLED[name]}")
        if name not in SIGNALLABLE_CLASSES:
            raise ValueError(
                f"unknown class {name!r} (signallable: {', '.join(SIGNALLABLE_CLASSES)})"
            )
    return tuple(dict.fromkeys(names))


def _audit_path(raw: Any) -> str | None:
    if raw in (None, ""):
        return None
    path = str(raw)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"directory {parent!r} does not exist")
    return path


@dataclass(frozen=True)
class ReaperConfig:
    """Settings of ``actions.zombie_reaper``."""

    dry_run: bool = option(boolean, True)
    min_age: float = option(duration, 60.0)
    grace_period: float = option(duration, 30.0)
    kill_timeout: float = option(positive_duration, 60.0)
    max_kills_per_run: int = option(whole(0, 1000), 4)
    protect_names: tuple[str, ...] = option(string_list, DEFAULT_PROTECT_NAMES)
    protect_users: tuple[str, ...] = option(string_list, ("root",))
    audit_log: str | None = option(_audit_path, None)
    leaked_min_memory: int = option(size, 1024**3)
    kill_classes: tuple[str, ...] = option(_kill_classes, SIGNALLABLE_CLASSES)


def parse_reaper(section: Section) -> ReaperConfig:
    """The reaper's own keys of ``actions.zombie_reaper`` (not enabled/every/cron)."""
    config = parse_options(ReaperConfig, section)
    if not config.dry_run and config.audit_log is None:
        raise section.error("dry_run", "dry_run: false needs audit_log: every signal is recorded")
    return config
