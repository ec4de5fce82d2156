"""Settings of ``actions.zombie_reaper`` and the classes the reaper sorts GPU holders into."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class ReaperConfig:
    """Settings of ``actions.zombie_reaper``."""

    dry_run: bool = True
    min_age: float = 60.0
    grace_period: float = 30.0
    kill_timeout: float = 60.0
    max_kills_per_run: int = 4
    protect_names: tuple[str, ...] = DEFAULT_PROTECT_NAMES
    protect_users: tuple[str, ...] = ("root",)
    audit_log: str | None = None
    leaked_min_memory: int = 1024**3
    kill_classes: tuple[str, ...] = SIGNALLABLE_CLASSES


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


def parse_reaper(section: Section) -> ReaperConfig:
    """The reaper's own keys of ``actions.zombie_reaper`` (not enabled/every/cron)."""
    default = ReaperConfig()
    config = ReaperConfig(
        dry_run=section.get("dry_run", boolean, default.dry_run),
        min_age=section.get("min_age", duration, default.min_age),
        grace_period=section.get("grace_period", duration, default.grace_period),
        kill_timeout=section.get("kill_timeout", positive_duration, default.kill_timeout),
        max_kills_per_run=section.get(
            "max_kills_per_run", whole(0, 1000), default.max_kills_per_run
        ),
        protect_names=section.get("protect_names", string_list, default.protect_names),
        protect_users=section.get("protect_users", string_list, default.protect_users),
        audit_log=section.get("audit_log", _audit_path, default.audit_log),
        leaked_min_memory=section.get("leaked_min_memory", size, default.leaked_min_memory),
        kill_classes=section.get("kill_classes", _kill_classes, default.kill_classes),
    )
    if not config.dry_run and config.audit_log is None:
        raise section.error("dry_run", "dry_run: false needs audit_log: every signal is recorded")
    return config
