"""Findings that actions publish for other actions, routes and the composition root to read.

Each kind of finding is a frozen dataclass; an action publishes the latest of its kinds after
each run, and whoever needs one reads it from the :class:`Findings` board by type, without
knowing which action made it (or whether it runs: an absent finding reads as None).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from exporter.core.health import Verdict
from exporter.core.selection import Recommendation

_NONE: Mapping[Any, Any] = MappingProxyType({})


@dataclass(frozen=True)
class ThermalLevels:
    """The thermal action's level by GPU uuid (0 ok, 1 warning, 2 critical); GPUs whose
    temperature is unknown are absent."""

    levels: Mapping[str, int] = field(default_factory=lambda: _NONE)


@dataclass(frozen=True)
class ZombieHolders:
    """What the zombie reaper's last run found."""

    #: uuid -> its orphaned, defunct and leaked holders (``1 orphan, 1 defunct``); GPUs with
    #: none are absent
    holders: Mapping[str, str] = field(default_factory=lambda: _NONE)
    #: (uuid, pid) -> (reaper class, last decision) of every process it looked at
    verdicts: Mapping[tuple[str, int], tuple[str | None, str | None]] = field(
        default_factory=lambda: _NONE
    )
    #: whether it only reports (the default) or signals orphans
    dry_run: bool = True
    #: its latest decisions, oldest first, as written to the audit log (at most
    #: ``RECENT_DECISIONS``): event, class, gpu, uuid, pid, process, user, reason, signal, time
    recent: tuple[Mapping[str, Any], ...] = ()


#: Decisions of the reaper kept for ``ZombieHolders.recent`` (/snapshot, the status page).
RECENT_DECISIONS = 20


@dataclass(frozen=True)
class Recommendations:
    """The recommend action's latest choice of every configured policy, by policy name."""

    by_policy: Mapping[str, Recommendation] = field(default_factory=lambda: _NONE)


@dataclass(frozen=True)
class HealthVerdicts:
    """The health action's verdict by GPU uuid (lost GPUs included)."""

    verdicts: Mapping[str, Verdict] = field(default_factory=lambda: _NONE)
    #: wall-clock time of the Snapshot they judge
    timestamp: float | None = None


@dataclass(frozen=True)
class ProcessWaste:
    """What the waste action found of one process (only processes with a finding)."""

    user: str
    name: str
    memory_bytes: int | None
    #: idle so far while holding at least min_memory (None: not idle, or holding less)
    idle_seconds: float | None
    idle_holder: bool  # idle for at least ``for``
    growth_bytes: int | None  # a leak suspect's growth over the window; None: no suspect

    def to_dict(self) -> dict[str, Any]:
        return {
            "idle_seconds": self.idle_seconds,
            "idle_holder": self.idle_holder,
            "leak_growth_bytes": self.growth_bytes,
        }


@dataclass(frozen=True)
class GpuWaste:
    """What the waste action found of one GPU."""

    index: int
    idle_seconds: float | None  # its activity at or below max_utilization so far; None: not
    allocated: bool
    allocated_idle: bool  # allocated, and idle for at least ``for``
    owners: tuple[str, ...]  # "pod NAMESPACE/NAME", "job ID"
    power_watts: float | None  # beside the finding, never its proof
    processes: Mapping[int, ProcessWaste]
    orphaned_memory_bytes: int | None  # None: cannot be told here
    dead_pids: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "idle_seconds": self.idle_seconds,
            "allocated_idle": self.allocated_idle if self.allocated else None,
            "owners": list(self.owners),
            "power_watts": self.power_watts,
            "orphaned_memory_bytes": self.orphaned_memory_bytes,
            "dead_pids": list(self.dead_pids),
            "idle_holders": sum(p.idle_holder for p in self.processes.values()),
            "leak_suspects": sum(p.growth_bytes is not None for p in self.processes.values()),
        }


@dataclass(frozen=True)
class Waste:
    """The waste action's findings by GPU uuid, as of the latest Snapshot it ran on."""

    gpus: Mapping[str, GpuWaste] = field(default_factory=lambda: _NONE)


F = TypeVar("F")


class Findings:
    """The latest finding of each kind; safe to read from any thread."""

    def __init__(self) -> None:
        self._latest: Mapping[type, Any] = _NONE
        self._lock = threading.Lock()

    def publish(self, finding: object) -> None:
        """Make ``finding`` the latest of its kind."""
        with self._lock:
            self._latest = MappingProxyType({**self._latest, type(finding): finding})

    def withdraw(self, kind: type) -> None:
        """Forget the finding of ``kind`` (its action stopped)."""
        with self._lock:
            self._latest = MappingProxyType(
                {k: v for k, v in self._latest.items() if k is not kind}
            )

    def get(self, kind: type[F]) -> F | None:
        """The latest finding of ``kind``; None when none is published."""
        found = self._latest.get(kind)
        return found if isinstance(found, kind) else None
