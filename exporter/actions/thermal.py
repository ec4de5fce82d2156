"""Thermal hotspots: a warning/critical level per GPU with hysteresis, and thermal outliers.

Rules (the contract the docs quote):

- Level per GPU: 0 ok, 1 warning, 2 critical, exported as ``gpu_thermal_hotspot{gpu, uuid}``.
- Warning when the temperature stays at or above ``warning_celsius`` for ``for``. Critical when it
  stays at or above ``critical_celsius`` for ``for``, or when a thermal clock-event reason
  (``sw_thermal_slowdown``, ``hw_thermal_slowdown``) is active continuously for ``for``.
- Level 2 drops to 1 only after the temperature stays below ``critical - hysteresis`` with no
  thermal reason active, for ``for``; level 1 or 2 drops to 0 only after the temperature stays
  below ``warning - hysteresis`` for ``for``. Between the bands the level holds.
- Outlier: ``outlier_celsius`` or more above the median temperature of the other GPUs of the same
  Snapshot whose utilization is within ``outlier_utilization_band`` of its own (at least 2 such
  peers), and at least ``outlier_min_celsius`` (default 70) itself, continuously for ``for``:
  ``gpu_thermal_outlier{gpu, uuid}`` 1, else 0.
- "Stays for ``for``": the condition held in every processed Snapshot from some Snapshot S up to
  the current one, and ``current.monotonic - S.monotonic >= for``. Time is the Snapshots' own
  monotonic clock, so a wall-clock step (NTP, a resumed VM) never shortens or skips ``for``.
- An unknown temperature (None, GPU down, GPU missing) gives no level: both series are absent and
  the GPU's timers reset; it starts again from level 0 when its temperature is known again.
- Unknown clock-event reasons count as no thermal reason active.
- Defaults per GPU: warning 80 and critical 85, or ``slowdown - 5`` and ``slowdown`` when the
  GPU's own slowdown threshold makes them lower. When only one of the two is configured, the
  defaulted one gives way so that warning <= critical.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from exporter.actions.base import Action, ActionType, Context, SnapshotCursor
from exporter.config.options import option, parse_options
from exporter.config.validate import celsius, duration, non_negative, positive, ratio
from exporter.config.yamlconf import Section
from exporter.core.findings import Findings, ThermalLevels
from exporter.core.health import thermal_limits
from exporter.core.snapshot import Gpu, Snapshot
from exporter.exposition.metrics import GPU_LABELS, AnyFamily, gauge

LEVEL_NAMES = ("ok", "warning", "critical")
_BAND_TOLERANCE = 1e-9  # utilizations are whole percents; 0.8 - 0.6 is 0.20000000000000007


@dataclass(frozen=True)
class ThermalConfig:
    """Settings of the thermal action (``actions.thermal`` in the config)."""

    #: None: 80, or slowdown - 5 if that is lower
    warning_celsius: float | None = option(celsius, None)
    #: None: 85, or slowdown if that is lower
    critical_celsius: float | None = option(celsius, None)
    hysteresis_celsius: float = option(non_negative, 5.0)
    for_seconds: float = option(duration, 30.0, key="for")
    outlier_celsius: float = option(positive, 10.0)
    outlier_utilization_band: float = option(ratio, 0.2)
    #: an outlier must also be at least this hot: 50 C among peers idling at 38 C is no hotspot
    outlier_min_celsius: float = option(celsius, 70.0)


def parse_thermal(section: Section) -> ThermalConfig:
    """Read the thermal keys of ``section`` (not enabled/every/cron, and without ``done()``)."""
    config = parse_options(ThermalConfig, section)
    warning, critical = config.warning_celsius, config.critical_celsius
    if warning is not None and critical is not None and critical < warning:
        raise section.error(
            "critical_celsius",
            f"must be at least warning_celsius ({warning:g}), got {critical:g}",
        )
    return config


@dataclass
class _GpuState:
    """What the action remembers of one GPU (by uuid) between Snapshots."""

    index: int
    level: int = 0
    outlier: bool = False
    #: condition name -> monotonic time of the first Snapshot of its current unbroken run.
    since: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Reading:
    """One GPU in one Snapshot, with everything the rules compare."""

    gpu: Gpu
    monotonic: float  # the Snapshot's monotonic clock: what ``for`` is measured on
    temperature: float
    warning: float
    critical: float
    reason: bool
    median: float | None  # of the comparable peers; None with fewer than 2


class ThermalAction(Action):
    """Thermal level and outlier flag per GPU, from the Snapshots' temperatures and reasons."""

    name = "thermal"

    publishes = (ThermalLevels,)

    def __init__(
        self,
        config: ThermalConfig,
        log: logging.Logger | None = None,
        findings: Findings | None = None,
    ) -> None:
        self.config = config
        self.findings = findings if findings is not None else Findings()
        self.log = log or logging.getLogger(__name__)
        self._states: dict[str, _GpuState] = {}
        self._cursor = SnapshotCursor()
        #: (index, uuid, level, outlier) per known GPU, replaced whole at the end of each run so
        #: that other threads (metrics, recommend) read a consistent result; None before a run.
        self._published: tuple[tuple[int, str, int, bool], ...] | None = None

    # -- public ------------------------------------------------------------------------------

    def run(self, snapshots: Sequence[Snapshot], now: float) -> None:
        """Process the Snapshots not yet seen (oldest first); ``now`` is not used (see module)."""
        new, restarted = self._cursor.new(snapshots)
        if restarted:
            self._states.clear()
        for snapshot in new:
            self._process(snapshot)
            self._cursor.processed(snapshot)
        self._published = tuple(
            sorted((st.index, uuid, st.level, st.outlier) for uuid, st in self._states.items())
        )
        self.findings.publish(ThermalLevels(self.levels()))

    def families(self) -> list[AnyFamily]:
        """``gpu_thermal_hotspot`` and ``gpu_thermal_outlier``; none before the first run."""
        published = self._published
        if published is None:
            return []
        hotspot = gauge(
            "gpu_thermal_hotspot",
            "Thermal level of the GPU: 0 ok, 1 warning, 2 critical; absent while the "
            "temperature is unknown.",
            labels=GPU_LABELS,
        )
        outlier = gauge(
            "gpu_thermal_outlier",
            "1 while the GPU runs hotter than GPUs at similar utilization by outlier_celsius or "
            "more, else 0; absent while the temperature is unknown.",
            labels=GPU_LABELS,
        )
        for index, uuid, level, is_outlier in published:
            hotspot.add_metric([str(index), uuid], float(level))
            outlier.add_metric([str(index), uuid], 1.0 if is_outlier else 0.0)
        return [hotspot, outlier]

    def levels(self) -> dict[str, int]:
        """uuid -> current level (0, 1, 2); GPUs whose level is unknown are absent."""
        return {uuid: level for _, uuid, level, _ in self._published or ()}

    def thresholds(self, gpu: Gpu) -> tuple[float, float]:
        """(warning, critical) celsius for ``gpu``: configured, or from its slowdown threshold."""
        warning, critical = thermal_limits(gpu)  # the defaults, shared with the launcher
        configured_warning = self.config.warning_celsius
        configured_critical = self.config.critical_celsius
        if configured_warning is not None:
            warning = configured_warning
            critical = critical if configured_critical is not None else max(critical, warning)
        if configured_critical is not None:
            critical = configured_critical
            warning = warning if configured_warning is not None else min(warning, critical)
        return warning, critical

    # -- one Snapshot --------------------------------------------------------------------------

    def _process(self, snapshot: Snapshot) -> None:
        known = {gpu.uuid: gpu for gpu in snapshot.gpus if _known(gpu)}
        for uuid in [uuid for uuid in self._states if uuid not in known]:
            self._forget(uuid)
        for gpu in known.values():
            self._update(self._reading(gpu, snapshot, list(known.values())))

    def _reading(self, gpu: Gpu, snapshot: Snapshot, known: list[Gpu]) -> _Reading:
        warning, critical = self.thresholds(gpu)
        return _Reading(
            gpu=gpu,
            monotonic=snapshot.monotonic,
            temperature=float(gpu.temperature_celsius or 0.0),  # known: see _known
            warning=warning,
            critical=critical,
            reason=gpu.thermal_throttling(),
            median=_peer_median(gpu, known, self.config.outlier_utilization_band),
        )

    def _conditions(self, r: _Reading) -> dict[str, bool]:
        hysteresis = self.config.hysteresis_celsius
        return {
            "warning": r.temperature >= r.warning,
            "critical": r.temperature >= r.critical,
            "reason": r.reason,
            "below_critical": r.temperature < r.critical - hysteresis and not r.reason,
            "below_warning": r.temperature < r.warning - hysteresis,
            "outlier": r.median is not None
            and r.temperature - r.median >= self.config.outlier_celsius
            and r.temperature >= self.config.outlier_min_celsius,
        }

    def _update(self, r: _Reading) -> None:
        state = self._states.get(r.gpu.uuid)
        if state is None:
            state = self._states[r.gpu.uuid] = _GpuState(index=r.gpu.index)
        state.index = r.gpu.index
        for condition, holds in self._conditions(r).items():
            if holds:
                state.since.setdefault(condition, r.monotonic)
            else:
                state.since.pop(condition, None)
        held = {
            condition
            for condition, since in state.since.items()
            if r.monotonic - since >= self.config.for_seconds
        }
        level = _next_level(state.level, held)
        if level != state.level:
            self._log_level(r, state.level, level)
            state.level = level
        outlier = "outlier" in held
        if outlier != state.outlier:
            self._log_outlier(r, outlier)
            state.outlier = outlier

    def _forget(self, uuid: str) -> None:
        state = self._states.pop(uuid)
        if state.level or state.outlier:
            self.log.info(
                "GPU %d (%s): temperature unknown; thermal level (was %s) and outlier state "
                "are unknown until it is read again",
                state.index,
                uuid,
                LEVEL_NAMES[state.level],
            )

    # -- logging -------------------------------------------------------------------------------

    def _log_level(self, r: _Reading, old: int, new: int) -> None:
        emit = self.log.warning if new > old else self.log.info
        emit(
            "GPU %d (%s) thermal %s -> %s: %g C (warning %g C, critical %g C, hysteresis %g C, "
            "for %gs%s)",
            r.gpu.index,
            r.gpu.uuid,
            LEVEL_NAMES[old],
            LEVEL_NAMES[new],
            r.temperature,
            r.warning,
            r.critical,
            self.config.hysteresis_celsius,
            self.config.for_seconds,
            "; thermal slowdown active" if r.reason else "",
        )

    def _log_outlier(self, r: _Reading, outlier: bool) -> None:
        median = "none" if r.median is None else f"{r.median:g} C"
        if outlier:
            self.log.warning(
                "GPU %d (%s) is a thermal outlier: %g C, median of GPUs at similar utilization "
                "%s (outlier_celsius %g C, for %gs)",
                r.gpu.index,
                r.gpu.uuid,
                r.temperature,
                median,
                self.config.outlier_celsius,
                self.config.for_seconds,
            )
        else:
            self.log.info(
                "GPU %d (%s) is no longer a thermal outlier: %g C, median of GPUs at similar "
                "utilization %s (outlier_celsius %g C)",
                r.gpu.index,
                r.gpu.uuid,
                r.temperature,
                median,
                self.config.outlier_celsius,
            )


def _known(gpu: Gpu) -> bool:
    return gpu.up and gpu.temperature_celsius is not None


def _peer_median(gpu: Gpu, known: list[Gpu], band: float) -> float | None:
    """Median temperature of the other GPUs within ``band`` of ``gpu``'s utilization (2 or more)."""
    if gpu.utilization_ratio is None:
        return None
    peers = [
        other.temperature_celsius
        for other in known
        if other.uuid != gpu.uuid
        and other.temperature_celsius is not None
        and other.utilization_ratio is not None
        and abs(other.utilization_ratio - gpu.utilization_ratio) <= band + _BAND_TOLERANCE
    ]
    return statistics.median(peers) if len(peers) >= 2 else None


def _next_level(level: int, held: set[str]) -> int:
    """The level after one Snapshot, from the conditions that have held for ``for``."""
    if level >= 1 and "below_warning" in held:
        level = 0
    elif level == 2 and "below_critical" in held:
        level = 1
    if "critical" in held or "reason" in held:
        return 2
    if "warning" in held:
        return max(level, 1)
    return level


def _make(settings: ThermalConfig, context: Context) -> ThermalAction:
    return ThermalAction(settings, findings=context.findings)


ACTION = ActionType("thermal", 5.0, ThermalConfig, parse_thermal, _make)
