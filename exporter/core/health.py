"""Is this GPU fit for the next job? A verdict per GPU from a fixed set of checks.

Each check is ok, warning or critical with a one-line reason; the verdict is the worst. A
:class:`HealthTracker` observes Snapshots one after another (it remembers what one Snapshot
cannot show: links that were up, counters growing, XIDs within the window, a GPU that was lost)
and gives the verdicts as of the latest. The agent's ``health`` action runs one over every
Snapshot; the launcher runs one over its own few samples, which know no XID history.

The rules (``docs/actions.md`` quotes them with their sources):

- ``lost``: critical while the GPU does not answer (``up`` false), is gone from NVML's device
  list after it was seen, or NVML itself is unavailable.
- ``xid``: critical for ``xid_window`` after an XID whose catalog resolution is ``reset_gpu`` or
  ``reboot``, or until the GPU is reset (its recovery action, non-none after the XID, returns to
  none; or it is lost and comes back); a warning when one code of any other resolution but
  ``ignore`` is seen ``xid_repeat`` times or more within the window.
- ``memory_repair``: critical for a row remap pending or failed, a bank remap pending, retired
  pages pending, memory marked unrepairable; a warning at ``remapped_rows_warning``
  uncorrectable remapped rows or ``retired_pages_warning`` retired pages (DCGM's limits).
- ``ecc``: critical when the volatile uncorrectable ECC count is above 0 (an uncorrectable
  error since the last reset: DCGM's health watch fails on it).
- ``recovery_action``: critical while the driver's recovery action is not none.
- ``pcie``: a warning while the link runs below its maximum width, or replays more per minute
  (over ``rate_window``) than DCGM's limit, 31 at Gen5 x16, scaled by generation and width.
- ``nvlink``: critical when a link that was up is down, or replay or recovery errors grew within
  ``error_window``, or CRC errors (flit and data) exceed ``nvlink_crc_critical_rate`` per second
  over ``rate_window``; a warning when CRC errors grew within ``error_window`` below that rate.
- ``thermal``: the thermal action's level (2 critical, 1 warning); without it, one Snapshot's
  temperature against the thermal action's default limits.
- ``clocks``: the share of time in hardware slowdown (thermal or power brake) over
  ``clocks_window``: critical at ``clocks_critical_share``, a warning at ``clocks_warning_share``;
  before two readings span some time, a warning while such a reason is active.

A value the GPU does not report gives no evidence: its check stays ok.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from exporter.core.fields import RECOVERY_ACTIONS
from exporter.core.snapshot import Gpu, Snapshot
from exporter.core.units import format_duration
from exporter.core.xid import describe_xid

CHECKS = (
    "lost",
    "xid",
    "memory_repair",
    "ecc",
    "recovery_action",
    "pcie",
    "nvlink",
    "thermal",
    "clocks",
)
LEVELS = ("ok", "warning", "critical")
OK, WARNING, CRITICAL = 0, 1, 2
#: The verdict of a document that could not judge (``gpu-exporter health`` exits 2).
UNKNOWN_VERDICT = "unknown"
#: The version of :func:`health_document`'s shape (``exporter/schemas/health.schema.json``).
DOCUMENT_VERSION = 1
#: XID resolutions that make the ``xid`` check critical.
CRITICAL_RESOLUTIONS = frozenset({"reset_gpu", "reboot"})
#: The thermal action's default limits (celsius) and how far below the GPU's own slowdown
#: threshold the warning sits when that is lower.
DEFAULT_WARNING_CELSIUS = 80.0
DEFAULT_CRITICAL_CELSIUS = 85.0
SLOWDOWN_WARNING_MARGIN = 5.0
_HARDWARE_SLOWDOWN_SECONDS = (
    "clock_event_seconds_hw_thermal_slowdown",
    "clock_event_seconds_hw_power_brake_slowdown",
)
_HARDWARE_SLOWDOWN_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
_RECOVERY_NAMES = {number: name for number, name, _ in RECOVERY_ACTIONS}
_MAX_POINTS = 128  # per counter: points at least keep/128 apart


@dataclass(frozen=True)
class HealthConfig:
    """Thresholds of the checks (``actions.health`` in the config; defaults from the sources
    ``docs/actions.md`` names)."""

    xid_window: float = 86400.0
    xid_repeat: int = 3
    remapped_rows_warning: int = 512
    retired_pages_warning: int = 63
    error_window: float = 600.0
    rate_window: float = 300.0
    nvlink_crc_critical_rate: float = 100.0  # per second
    #: replays a minute allowed at Gen5 x16 (DCGM's PCIe health watch), scaled linearly by the
    #: link's generation and width
    pcie_replay_rate: float = 31.0
    clocks_window: float = 900.0
    clocks_warning_share: float = 0.10
    clocks_critical_share: float = 0.50
    #: checks left out of the verdict (always ok, "ignored by config")
    ignore: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Check:
    """One check's outcome for one GPU."""

    name: str
    level: int
    reason: str = ""

    @property
    def status(self) -> str:
        return LEVELS[self.level]


@dataclass(frozen=True)
class Verdict:
    """Every check of one GPU, in the order of :data:`CHECKS`."""

    index: int
    uuid: str
    checks: tuple[Check, ...]

    @property
    def level(self) -> int:
        """The worst check: 0 ok, 1 warning, 2 critical."""
        return max(check.level for check in self.checks)

    @property
    def status(self) -> str:
        return LEVELS[self.level]

    def reasons(self, at_least: int = WARNING) -> list[str]:
        """``check: reason`` of every check at ``at_least`` or worse, worst first."""
        failing = sorted(
            (c for c in self.checks if c.level >= at_least), key=lambda c: -c.level
        )  # sorted() is stable: CHECKS order within a level
        return [f"{c.name}: {c.reason}" for c in failing]

    def check(self, name: str) -> Check:
        return self.checks[CHECKS.index(name)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: index, uuid, verdict, level, reasons, checks (name -> status, reason)."""
        return {
            "index": self.index,
            "uuid": self.uuid,
            "verdict": self.status,
            "level": self.level,
            "reasons": self.reasons(),
            "checks": {c.name: {"status": c.status, "reason": c.reason} for c in self.checks},
        }


def thermal_limits(gpu: Gpu) -> tuple[float, float]:
    """The thermal action's default (warning, critical) celsius for ``gpu``: 80 and 85, or
    ``slowdown - 5`` and ``slowdown`` when the GPU's own slowdown threshold makes them lower."""
    slowdown = gpu.info.temperature_thresholds.get("slowdown") if gpu.info else None
    warning, critical = DEFAULT_WARNING_CELSIUS, DEFAULT_CRITICAL_CELSIUS
    if slowdown is not None:
        warning = min(warning, slowdown - SLOWDOWN_WARNING_MARGIN)
        critical = min(critical, slowdown)
    return warning, critical


@dataclass(frozen=True)
class XidMark:
    """XIDs of one code seen on a GPU at one time (wall clock)."""

    timestamp: float
    xid: int
    count: int = 1

    @property
    def resolution(self) -> str:
        return describe_xid(self.xid).resolution

    def to_dict(self) -> dict[str, Any]:
        return {"timestamp": self.timestamp, "xid": self.xid, "count": self.count}


class _Counter:
    """Points (monotonic time, value) of one counter, spaced so that ``keep`` seconds fit in
    about :data:`_MAX_POINTS`; a value that goes down (a reset) starts it afresh."""

    __slots__ = ("points",)

    def __init__(self) -> None:
        self.points: deque[tuple[float, float]] = deque()

    def add(self, at: float, value: float, keep: float) -> None:
        points = self.points
        if points and value < points[-1][1]:
            points.clear()
        if len(points) >= 2 and at - points[-2][0] < keep / _MAX_POINTS:
            points[-1] = (at, value)
        else:
            points.append((at, value))
        while len(points) > 2 and points[1][0] <= at - keep:
            points.popleft()  # the first point at or before the window's start stays

    def _base(self, since: float) -> tuple[float, float]:
        base = self.points[0]
        for point in self.points:
            if point[0] > since:
                break
            base = point
        return base

    def grew(self, since: float) -> float:
        """How much it grew after ``since`` (0 when unknown)."""
        if len(self.points) < 2:
            return 0.0
        return self.points[-1][1] - self._base(since)[1]

    def rate(self, since: float) -> float | None:
        """Per second from ``since`` (or the oldest point after it) to the latest; None before
        two points span some time."""
        if len(self.points) < 2:
            return None
        start, first = self._base(since)
        end, last = self.points[-1]
        return (last - first) / (end - start) if end > start else None


@dataclass
class _Track:
    """What the tracker remembers of one GPU (by uuid)."""

    index: int
    gpu: Gpu | None = None
    lost: str = ""  # why it is lost, while it is
    links_up: set[int] = field(default_factory=set)
    counters: dict[str, _Counter] = field(default_factory=dict)
    xid_counts: dict[int, int] = field(default_factory=dict)
    xids: list[XidMark] = field(default_factory=list)
    recovery_pending: bool = False  # a recovery action was asked for since the last XIDs
    at: float = 0.0  # monotonic time of the latest Snapshot observed
    wall: float = 0.0


class HealthTracker:
    """Observes Snapshots in order and gives each GPU's verdict as of the latest."""

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.config = config or HealthConfig()
        self._tracks: dict[str, _Track] = {}
        self._last_seq: int | None = None
        self._last_time: float | None = None

    # -- observing -------------------------------------------------------------------------

    def observe_all(self, snapshots: Sequence[Snapshot]) -> None:
        """Observe the Snapshots (oldest first) not observed yet."""
        for snapshot in snapshots:
            if self._last_time is not None and (
                snapshot.seq == self._last_seq or snapshot.monotonic <= self._last_time
            ):
                continue
            self.observe(snapshot)

    def observe(self, snapshot: Snapshot) -> None:
        """Take one Snapshot, newer than those observed before."""
        self._last_seq, self._last_time = snapshot.seq, snapshot.monotonic
        seen = set()
        for gpu in snapshot.gpus:
            if not gpu.uuid:
                continue  # never identified: nothing to name it by
            seen.add(gpu.uuid)
            track = self._tracks.get(gpu.uuid)
            if track is None:
                track = self._tracks[gpu.uuid] = _Track(gpu.index)
            track.index, track.at, track.wall = gpu.index, snapshot.monotonic, snapshot.timestamp
            if not gpu.up:
                track.lost = f"not answering ({gpu.error})" if gpu.error else "not answering"
                continue
            if track.lost:
                self._reset(track)  # lost and back: it was reset, its counters start anew
            track.gpu = gpu
            self._take(track, gpu, snapshot)
        for uuid, track in self._tracks.items():
            if uuid in seen:
                continue
            track.at, track.wall = snapshot.monotonic, snapshot.timestamp
            track.lost = (
                f"NVML unavailable ({snapshot.nvml_error})"
                if not snapshot.nvml_up
                else "gone from NVML's device list"
            )

    def _reset(self, track: _Track) -> None:
        track.lost = ""
        track.links_up.clear()
        track.counters.clear()
        self._clear_critical_xids(track)

    @staticmethod
    def _clear_critical_xids(track: _Track) -> None:
        track.xids = [m for m in track.xids if m.resolution not in CRITICAL_RESOLUTIONS]
        track.recovery_pending = False

    def _take(self, track: _Track, gpu: Gpu, snapshot: Snapshot) -> None:
        config = self.config
        for code, count in gpu.xid_counts.items():
            new = count - track.xid_counts.get(code, 0)
            if new < 0:
                new = count  # the agent's counts started again
            if new > 0:
                times = [event.timestamp for event in gpu.xids if event.xid == code]
                track.xids.append(XidMark(times[-1] if times else snapshot.timestamp, code, new))
                track.recovery_pending = False
            track.xid_counts[code] = count
        track.xids = [m for m in track.xids if m.timestamp > snapshot.timestamp - config.xid_window]
        action = gpu.fields.get("recovery_action")
        if action is not None:
            if action != 0:
                track.recovery_pending = True
            elif track.recovery_pending:
                self._clear_critical_xids(track)  # the reset the driver asked for was done
        for link in gpu.nvlink:
            if gpu.nvlink.value(link, "nvlink_up") == 1:
                track.links_up.add(link)
        keep = max(config.error_window, config.rate_window, config.clocks_window)
        for key, value in _counted(gpu):
            counter = track.counters.get(key)
            if counter is None:
                counter = track.counters[key] = _Counter()
            counter.add(snapshot.monotonic, value, keep)

    def restore_xids(self, uuid: str, index: int, marks: Iterable[XidMark]) -> None:
        """Remember XIDs seen before (the agent's state file) for ``uuid``."""
        track = self._tracks.get(uuid)
        if track is None:
            track = self._tracks[uuid] = _Track(index)
        track.xids = sorted([*track.xids, *marks], key=lambda m: m.timestamp)

    def critical_xids(self) -> dict[str, tuple[int, list[XidMark]]]:
        """uuid -> (index, XIDs that keep the ``xid`` check critical) for every GPU with any."""
        out = {}
        for uuid, track in self._tracks.items():
            marks = [m for m in track.xids if m.resolution in CRITICAL_RESOLUTIONS]
            if marks:
                out[uuid] = (track.index, marks)
        return out

    # -- judging ---------------------------------------------------------------------------

    def verdicts(self, hotspots: Mapping[str, int] | None = None) -> dict[str, Verdict]:
        """uuid -> verdict of every GPU observed (lost ones included). ``hotspots``: the
        thermal action's levels by uuid, None when it is off (then one Snapshot's temperature
        is judged against its default limits)."""
        out = {}
        for uuid, track in self._tracks.items():
            checks = tuple(
                Check(name, OK, "ignored by config")
                if name in self.config.ignore
                else Check(name, *_JUDGES[name](self, track, hotspots))
                for name in CHECKS
            )
            out[uuid] = Verdict(track.index, uuid, checks)
        return out

    def _lost(self, track: _Track, hotspots: Any) -> tuple[int, str]:
        return (CRITICAL, track.lost) if track.lost else (OK, "")

    def _xid(self, track: _Track, hotspots: Any) -> tuple[int, str]:
        critical = [m for m in track.xids if m.resolution in CRITICAL_RESOLUTIONS]
        if critical:
            last = critical[-1]
            more = sum(m.count for m in critical) - 1
            also = f" and {more} more" if more else ""
            return CRITICAL, f"XID {last.xid} ({last.resolution}) at {_utc(last.timestamp)}{also}"
        repeated: dict[int, int] = {}
        for mark in track.xids:
            if mark.resolution != "ignore":
                repeated[mark.xid] = repeated.get(mark.xid, 0) + mark.count
        worst = max(repeated.items(), key=lambda item: (item[1], -item[0]), default=None)
        if worst is not None and worst[1] >= self.config.xid_repeat:
            code, count = worst
            window = format_duration(self.config.xid_window)
            return WARNING, (
                f"XID {code} ({describe_xid(code).resolution}) {count} times in {window}"
            )
        return OK, ""

    def _memory_repair(self, track: _Track, hotspots: Any) -> tuple[int, str]:
        fields = track.gpu.fields if track.gpu else {}
        critical = [
            text
            for key, text in (
                ("row_remap_failed", "row remap failed"),
                ("row_remap_pending", "row remap pending"),
                ("bank_remap_pending", "bank remap pending"),
                ("retired_pages_pending", "page retirement pending"),
                ("memory_unrepairable", "memory marked unrepairable"),
            )
            if fields.get(key, 0) > 0
        ]
        if critical:
            return CRITICAL, ", ".join(critical)
        warnings = []
        rows = fields.get("remapped_rows_uncorrectable")
        if rows is not None and rows >= self.config.remapped_rows_warning:
            warnings.append(f"{rows:.0f} rows remapped for uncorrectable errors")
        pages = fields.get("retired_pages_single_bit", 0) + fields.get(
            "retired_pages_double_bit", 0
        )
        if pages >= self.config.retired_pages_warning:
            warnings.append(f"{pages:.0f} pages retired")
        return (WARNING, ", ".join(warnings)) if warnings else (OK, "")

    def _ecc(self, track: _Track, hotspots: Any) -> tuple[int, str]:
        errors = track.gpu.fields.get("ecc_uncorrected") if track.gpu else None
        if errors:
            return CRITICAL, f"{errors:.0f} uncorrectable ECC errors since the last reset"
        return OK, ""

    def _recovery_action(self, track: _Track, hotspots: Any) -> tuple[int, str]:
        action = track.gpu.fields.get("recovery_action") if track.gpu else None
        if action:
            name = _RECOVERY_NAMES.get(int(action), f"action {action:.0f}")
            return CRITICAL, f"the driver asks for {name}"
        return OK, ""

    def _pcie(self, track: _Track, hotspots: Any) -> tuple[int, str]:
        if track.gpu is None:
            return OK, ""
        fields = track.gpu.fields
        info = track.gpu.info.fields if track.gpu.info else {}
        warnings = []
        width, widest = fields.get("pcie_link_width"), info.get("pcie_link_width_max")
        if width and widest and width < widest:
            warnings.append(f"link x{width:.0f} of x{widest:.0f}")
        generation = fields.get("pcie_link_generation")
        counter = track.counters.get("pcie_replays")
        rate = counter.rate(track.at - self.config.rate_window) if counter else None
        if rate is not None and width and generation:
            per_minute = rate * 60
            limit = self.config.pcie_replay_rate / (5 * 16) * generation * width
            if per_minute > limit:
                warnings.append(
                    f"{per_minute:.0f} replays a minute above {limit:.1f} "
                    f"(Gen{generation:.0f} x{width:.0f})"
                )
        return (WARNING, ", ".join(warnings)) if warnings else (OK, "")

    def _nvlink(self, track: _Track, hotspots: Any) -> tuple[int, str]:
        gpu = track.gpu
        if gpu is None:
            return OK, ""
        critical = []
        down = sorted(link for link in track.links_up if gpu.nvlink.value(link, "nvlink_up") == 0)
        if down:
            critical.append(f"link{'s' if len(down) > 1 else ''} {_links(down)} down (was up)")
        since = track.at - self.config.error_window
        window = format_duration(self.config.error_window)
        errors = track.counters.get("nvlink_replay_recovery")
        grew = errors.grew(since) if errors else 0.0
        if grew > 0:
            critical.append(f"{grew:.0f} replay/recovery errors in {window}")
        crc = track.counters.get("nvlink_crc")
        rate = crc.rate(track.at - self.config.rate_window) if crc else None
        if rate is not None and rate > self.config.nvlink_crc_critical_rate:
            critical.append(f"{rate:.0f} CRC errors a second")
        if critical:
            return CRITICAL, ", ".join(critical)
        crc_grew = crc.grew(since) if crc else 0.0
        if crc_grew > 0:
            return WARNING, f"{crc_grew:.0f} CRC errors in {window}"
        return OK, ""

    def _thermal(self, track: _Track, hotspots: Mapping[str, int] | None) -> tuple[int, str]:
        gpu = track.gpu
        if gpu is None or track.lost:
            return OK, ""
        temperature = gpu.temperature_celsius
        shown = f" ({temperature:.0f} °C)" if temperature is not None else ""
        if hotspots is not None:
            level = hotspots.get(gpu.uuid, 0)
            return level, (f"thermal hotspot {LEVELS[level]}{shown}" if level else "")
        if temperature is None:
            return OK, ""
        warning, critical = thermal_limits(gpu)
        if temperature >= critical:
            return CRITICAL, f"{temperature:.0f} °C, at or above {critical:.0f} °C"
        if temperature >= warning:
            return WARNING, f"{temperature:.0f} °C, at or above {warning:.0f} °C"
        return OK, ""

    def _clocks(self, track: _Track, hotspots: Any) -> tuple[int, str]:
        gpu = track.gpu
        if gpu is None:
            return OK, ""
        config = self.config
        counter = track.counters.get("hardware_slowdown_seconds")
        share = counter.rate(track.at - config.clocks_window) if counter else None
        if share is not None:
            share = min(max(share, 0.0), 1.0)
            window = format_duration(config.clocks_window)
            text = f"{share:.0%} of the last {window} in hardware slowdown"
            if share >= config.clocks_critical_share:
                return CRITICAL, text
            if share >= config.clocks_warning_share:
                return WARNING, text
            return OK, ""
        active = gpu.clock_events_active() or {}
        now = [reason for reason in _HARDWARE_SLOWDOWN_REASONS if active.get(reason)]
        if now:
            return WARNING, f"{', '.join(now)} active"
        return OK, ""


_JUDGES = {
    "lost": HealthTracker._lost,
    "xid": HealthTracker._xid,
    "memory_repair": HealthTracker._memory_repair,
    "ecc": HealthTracker._ecc,
    "recovery_action": HealthTracker._recovery_action,
    "pcie": HealthTracker._pcie,
    "nvlink": HealthTracker._nvlink,
    "thermal": HealthTracker._thermal,
    "clocks": HealthTracker._clocks,
}
assert tuple(_JUDGES) == CHECKS


def _counted(gpu: Gpu) -> Iterable[tuple[str, float]]:
    """The counters whose growth the checks judge, summed where a check reads several."""
    fields = gpu.fields
    if "pcie_replays" in fields:
        yield "pcie_replays", fields["pcie_replays"]
    slowdown = [fields[key] for key in _HARDWARE_SLOWDOWN_SECONDS if key in fields]
    if slowdown:
        yield "hardware_slowdown_seconds", math.fsum(slowdown)
    crc, errors = [], []
    for (_, key), value in gpu.nvlink.pairs():
        if key in ("nvlink_errors_crc_flit", "nvlink_errors_crc_data"):
            crc.append(value)
        elif key in ("nvlink_errors_replay", "nvlink_errors_recovery"):
            errors.append(value)
    if crc:
        yield "nvlink_crc", math.fsum(crc)
    if errors:
        yield "nvlink_replay_recovery", math.fsum(errors)


def assess(snapshots: Sequence[Snapshot], config: HealthConfig | None = None) -> dict[str, Verdict]:
    """The verdicts that ``snapshots`` alone (oldest first) support: what a launcher without an
    agent can know (no XID history, no thermal action)."""
    tracker = HealthTracker(config)
    tracker.observe_all(snapshots)
    return tracker.verdicts()


def health_document(
    verdicts: Sequence[Verdict | Mapping[str, Any]],
    timestamp: float | None,
    *,
    source: str,
    error: str | None = None,
) -> dict[str, Any]:
    """The JSON of ``/health/gpus`` and ``gpu-exporter health --json``: the worst verdict, when
    the Snapshot judged was taken, where the verdicts come from (``agent`` or ``nvml``), and each
    GPU's verdict (:meth:`Verdict.to_dict`); ``error`` (verdict ``unknown``) when there is none."""
    gpus = [v.to_dict() if isinstance(v, Verdict) else dict(v) for v in verdicts]
    worst = max((gpu["level"] for gpu in gpus), default=OK)
    return {
        "version": DOCUMENT_VERSION,
        "verdict": UNKNOWN_VERDICT if error is not None else LEVELS[worst],
        "source": source,
        "timestamp": timestamp,
        "error": error,
        "gpus": gpus,
    }


def _links(links: Sequence[int]) -> str:
    return ", ".join(str(link) for link in links)


def _utc(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(timestamp))
