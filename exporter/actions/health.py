"""The ``health`` action: a verdict per GPU that launchers, schedulers and alerts act on.

The checks and their rules are :mod:`exporter.core.health`'s (the launcher runs the same ones
over its own samples). This action runs them over every Snapshot with the thermal action's
levels, publishes the verdicts (:class:`~exporter.core.findings.HealthVerdicts`) for
``/recommend``, ``/health/gpus`` and ``/snapshot``, logs and counts every transition of a
check, and keeps critical XIDs in a state file so that a restart within ``xid_window`` does not
forget them. It never signals a process and never resets a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from exporter.actions.base import Action, ActionType, Context
from exporter.config.validate import number, positive_duration, ratio, string_list, whole
from exporter.config.yamlconf import Section
from exporter.core.findings import Findings, HealthVerdicts, ThermalLevels
from exporter.core.health import CHECKS, LEVELS, HealthConfig, HealthTracker, Verdict, XidMark
from exporter.core.snapshot import Snapshot
from exporter.core.statefile import StateError, default_state_file, load_state, save_state
from exporter.core.units import format_duration
from exporter.exposition.metrics import GPU_LABELS, AnyFamily, counter, gauge

log = logging.getLogger(__name__)

STATE_VERSION = 1
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _positive(raw: Any) -> float:
    value = number(raw)
    if value <= 0:
        raise ValueError(f"must be more than 0, got {raw!r}")
    return value


def _checks(raw: Any) -> frozenset[str]:
    names = string_list(raw)
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check {unknown[0]!r} (the checks: {', '.join(CHECKS)})")
    return frozenset(names)


def parse_health(section: Section) -> HealthConfig:
    """The thresholds of ``actions.health`` (not enabled/every/cron, and without ``done()``)."""
    defaults = HealthConfig()
    get = section.get
    config = HealthConfig(
        xid_window=get("xid_window", positive_duration, defaults.xid_window),
        xid_repeat=get("xid_repeat", whole(1, 1_000_000), defaults.xid_repeat),
        remapped_rows_warning=get(
            "remapped_rows_warning", whole(1, 1_000_000), defaults.remapped_rows_warning
        ),
        retired_pages_warning=get(
            "retired_pages_warning", whole(1, 1_000_000), defaults.retired_pages_warning
        ),
        error_window=get("error_window", positive_duration, defaults.error_window),
        rate_window=get("rate_window", positive_duration, defaults.rate_window),
        nvlink_crc_critical_rate=get(
            "nvlink_crc_critical_rate", _positive, defaults.nvlink_crc_critical_rate
        ),
        pcie_replay_rate=get("pcie_replay_rate", _positive, defaults.pcie_replay_rate),
        clocks_window=get("clocks_window", positive_duration, defaults.clocks_window),
        clocks_warning_share=get("clocks_warning_share", ratio, defaults.clocks_warning_share),
        clocks_critical_share=get("clocks_critical_share", ratio, defaults.clocks_critical_share),
        ignore=get("ignore", _checks, defaults.ignore),
    )
    if config.clocks_critical_share < config.clocks_warning_share:
        raise section.error(
            "clocks_critical_share",
            f"must be at least clocks_warning_share ({config.clocks_warning_share:g}), "
            f"got {config.clocks_critical_share:g}",
        )
    return config


def read_boot_id(path: str = BOOT_ID) -> str:
    """This boot's id ("" when the kernel does not say): a reboot resets every GPU."""
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except (OSError, ValueError):
        return ""


class HealthAction(Action):
    """Verdicts per GPU from every Snapshot; state kept across restarts in ``state_file``."""

    name: ClassVar[str] = "health"
    publishes: ClassVar[tuple[type, ...]] = (HealthVerdicts,)

    def __init__(
        self,
        config: HealthConfig,
        findings: Findings | None = None,
        *,
        state_file: str | None = None,
        boot_id: Callable[[], str] = read_boot_id,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.findings = findings if findings is not None else Findings()
        self.state_file = state_file
        self._boot_id = boot_id()
        self._clock = clock or time.time
        self._tracker = HealthTracker(config)
        self._verdicts: dict[str, Verdict] | None = None
        self._levels: dict[tuple[str, str], int] = {}  # (uuid, check) -> level last published
        self.transitions: dict[tuple[str, str], int] = {}  # (check, to) -> count
        self._saved: Any = None  # what the state file holds, as last written or read
        self._state_problem = ""
        self._restore()

    # -- the state file --------------------------------------------------------------------

    def _restore(self) -> None:
        if not self.state_file:
            return
        try:
            data = load_state(self.state_file)
        except StateError as exc:
            self._problem(str(exc))
            return
        if data is None:
            return
        try:
            marks = _parse_state(data)
        except (KeyError, TypeError, ValueError) as exc:
            self._problem(f"the state file {self.state_file} is not ours ({exc}); ignoring it")
            return
        if data.get("boot_id") != self._boot_id or not self._boot_id:
            log.info(
                "health: the host restarted since %s was written: its GPUs were reset, "
                "so its critical XIDs are dropped",
                self.state_file,
            )
            return
        cutoff = self._clock() - self.config.xid_window
        for uuid, (index, kept) in marks.items():
            recent = [m for m in kept if m.timestamp > cutoff]
            if recent:
                self._tracker.restore_xids(uuid, index, recent)
                log.warning(
                    "health: GPU %d %s: %d critical XID(s) from before the restart are kept "
                    "until %s after the last (state file %s)",
                    index,
                    uuid,
                    sum(m.count for m in recent),
                    format_duration(self.config.xid_window),
                    self.state_file,
                )
        self._saved = data

    def _problem(self, message: str) -> None:
        if message != self._state_problem:
            log.error("health: %s", message)
        self._state_problem = message

    def _save(self) -> None:
        if not self.state_file:
            return
        critical = self._tracker.critical_xids()
        state = {
            "version": STATE_VERSION,
            "boot_id": self._boot_id,
            "gpus": {
                uuid: {"index": index, "xids": [m.to_dict() for m in marks]}
                for uuid, (index, marks) in sorted(critical.items())
            },
        }
        if self._saved is not None and self._saved.get("gpus") == state["gpus"]:
            return
        if self._saved is None and not critical:
            return  # nothing to remember, and no file to clear
        try:
            save_state(self.state_file, state)
        except StateError as exc:
            self._problem(f"{exc}; the verdict will not survive a restart")
            return
        self._state_problem = ""
        self._saved = state

    # -- running ---------------------------------------------------------------------------

    def run(self, snapshots: Sequence[Snapshot], now: float) -> None:
        """Observe the new Snapshots and judge every GPU as of the latest."""
        self._tracker.observe_all(snapshots)
        thermal = self.findings.get(ThermalLevels)
        verdicts = self._tracker.verdicts(thermal.levels if thermal is not None else None)
        for uuid, verdict in verdicts.items():
            for check in verdict.checks:
                before = self._levels.get((uuid, check.name))
                if before == check.level or (before is None and check.level == 0):
                    self._levels[(uuid, check.name)] = check.level
                    continue
                self._levels[(uuid, check.name)] = check.level
                key = (check.name, check.status)
                self.transitions[key] = self.transitions.get(key, 0) + 1
                was = LEVELS[before] if before is not None else "ok"
                text = f": {check.reason}" if check.reason else ""
                emit = log.warning if check.level else log.info
                emit(
                    "health: GPU %d %s: %s %s -> %s%s",
                    verdict.index,
                    uuid,
                    check.name,
                    was,
                    check.status,
                    text,
                )
        self._verdicts = verdicts
        self._save()
        stamp = snapshots[-1].timestamp if snapshots else None
        self.findings.publish(HealthVerdicts(dict(verdicts), stamp))

    def verdicts(self) -> dict[str, Verdict]:
        """uuid -> verdict as of the last run (empty before it)."""
        return dict(self._verdicts or {})

    def families(self) -> list[AnyFamily]:
        """gpu_health, gpu_health_check, gpu_exporter_health_transitions_total."""
        transitions = counter(
            "gpu_exporter_health_transitions",
            "Changes of a health check's level, by check and the level it went to.",
            labels=["check", "to"],
        )
        for (name, to), count in sorted(self.transitions.items()):
            transitions.add_metric([name, to], count)
        if self._verdicts is None:
            return [transitions]
        health = gauge(
            "gpu_health",
            "The GPU's health verdict, its worst check: 0 ok, 1 warning, 2 critical.",
            labels=GPU_LABELS,
        )
        checks = gauge(
            "gpu_health_check",
            "One health check of the GPU: 0 ok, 1 warning, 2 critical.",
            labels=[*GPU_LABELS, "check"],
        )
        for uuid, verdict in sorted(self._verdicts.items(), key=lambda item: item[1].index):
            labels = [str(verdict.index), uuid]
            health.add_metric(labels, float(verdict.level))
            for check in verdict.checks:
                checks.add_metric([*labels, check.name], float(check.level))
        return [health, checks, transitions]

    def close(self, reason: str = "agent_stopped") -> None:
        self.findings.withdraw(HealthVerdicts)


def _parse_state(data: Any) -> dict[str, tuple[int, list[XidMark]]]:
    if data.get("version") != STATE_VERSION:
        raise ValueError(f"version {data.get('version')!r}, not {STATE_VERSION}")
    out = {}
    for uuid, gpu in data["gpus"].items():
        index = gpu["index"]
        if not isinstance(uuid, str) or not isinstance(index, int):
            raise ValueError("a GPU without a uuid or an index")
        marks = [
            XidMark(float(x["timestamp"]), int(x["xid"]), int(x.get("count", 1)))
            for x in gpu["xids"]
        ]
        out[uuid] = (index, marks)
    return out


def _make(settings: HealthConfig, context: Context) -> HealthAction:
    state = context.state_file
    if state is None:
        state = default_state_file()
    return HealthAction(settings, context.findings, state_file=state or None)


ACTION = ActionType("health", 5.0, HealthConfig, parse_health, _make)
