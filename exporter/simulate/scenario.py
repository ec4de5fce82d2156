"""Simulation scenarios: a YAML file becomes a validated, immutable Scenario.

The format is documented in ``docs/simulate.md``. Nothing here runs a process or answers an NVML
call: that is ``exporter.simulate.processes`` and ``exporter.simulate.driver``.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from exporter.config.validate import boolean, number, ratio, whole
from exporter.config.yamlconf import Section, load_document, parse_document
from exporter.core.fields import BY_KEY as READINGS
from exporter.core.fields import FIELD_READINGS, Function, GpmMetric
from exporter.core.snapshot import CLOCK_EVENT_REASONS
from exporter.core.units import parse_duration, parse_size

#: Function-level fields a scenario can mark unsupported or inject errors into, and the
#: functions behind them (the readings of ``core.fields`` are fields too: ``FIELD_FUNCTIONS``).
CALL_FIELDS: dict[str, tuple[str, ...]] = {
    "handle": ("nvmlDeviceGetHandleByIndex",),
    "uuid": ("nvmlDeviceGetUUID",),
    "name": ("nvmlDeviceGetName",),
    "pci_info": ("nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v3"),
    "serial": ("nvmlDeviceGetSerial",),
    "minor_number": ("nvmlDeviceGetMinorNumber",),
    "thresholds": ("nvmlDeviceGetTemperatureThreshold",),
    "power_limit": ("nvmlDeviceGetEnforcedPowerLimit",),
    "memory": ("nvmlDeviceGetMemoryInfo",),
    "utilization": ("nvmlDeviceGetUtilizationRates",),
    "temperature": ("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV"),
    "fan_speed": ("nvmlDeviceGetFanSpeed",),
    "clocks": ("nvmlDeviceGetClockInfo",),
    "performance_state": ("nvmlDeviceGetPerformanceState",),
    "clock_event_reasons": (
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
    ),
    "ecc": ("nvmlDeviceGetEccMode",),
    "processes": tuple(
        f"nvmlDevice{kind}RunningProcesses{version}"
        for kind in ("GetCompute", "GetGraphics")
        for version in ("", "_v2", "_v3")
    ),
    "process_utilization": (
        "nvmlDeviceGetProcessesUtilizationInfo",
        "nvmlDeviceGetProcessUtilization",
    ),
    #: the one call of every field value: an error here fails them all
    "field_values": ("nvmlDeviceGetFieldValues",),
    "xid_events": ("nvmlDeviceRegisterEvents",),
    #: GPU Performance Monitoring's two calls of each sample: ``InUse`` is busy counters
    "gpm": ("nvmlGpmSampleGet", "nvmlGpmMetricsGet"),
}


def _reading_functions(key: str) -> tuple[str, ...]:
    reading = READINGS[key]
    if isinstance(reading.source, Function):
        return (reading.source.name,)
    if isinstance(reading.source, GpmMetric):
        return ("nvmlGpmMetricsGet",)
    fallback = (reading.fallback.name,) if reading.fallback else ()
    return ("nvmlDeviceGetFieldValues", *fallback)


#: Every field a scenario can mark unsupported or inject errors into: the function-level ones
#: and each reading of ``core.fields`` (for a field value, its entry of the one call answers the
#: error; for a function reading, its function), with the functions that can answer it.
FIELD_FUNCTIONS: dict[str, tuple[str, ...]] = {
    **CALL_FIELDS,
    **{key: _reading_functions(key) for key in READINGS},
}
DRIVER_FIELDS = ("init", "count")
#: Readings a scenario gives per NVLink link (``nvlink.per_link``) rather than per GPU.
LINK_READINGS = frozenset(r.key for r in FIELD_READINGS if r.per_link)
REASON_BITS = dict(CLOCK_EVENT_REASONS)
_DEFAULT_THRESHOLDS = {"shutdown": 92.0, "slowdown": 89.0, "gpu_max": 87.0, "memory_max": 95.0}
#: Linux's largest pid_max: an offset this big puts every PID out of any namespace's reach.
_PID_LIMIT = 4194304
_DEFAULT_CLOCKS = {"graphics": 1755.0, "sm": 1755.0, "memory": 2619.0, "video": 1545.0}


# -- values that change over time ---------------------------------------------------------------


@dataclass(frozen=True)
class Value:
    """A number over scenario time: constant, a ramp (``from``/``to``/``over``), a wave, or a
    line through ``points`` ((time, value) pairs, flat before the first and after the last)."""

    base: float
    to: float | None = None
    start: float = 0.0
    over: float = 0.0
    amplitude: float = 0.0
    period: float = 0.0
    points: tuple[tuple[float, float], ...] = ()

    @property
    def constant(self) -> bool:
        """Whether the value is ``base`` at every time."""
        return not self.points and self.to is None and not (self.amplitude and self.period > 0)

    def at(self, t: float) -> float:
        if self.points:
            return _through(self.points, t)
        value = self.base
        if self.to is not None:
            progress = 1.0 if self.over <= 0 else min(1.0, max(0.0, (t - self.start) / self.over))
            value = self.base + (self.to - self.base) * progress if t >= self.start else self.base
        if self.amplitude and self.period > 0:
            value += self.amplitude * math.sin(2 * math.pi * t / self.period)
        return value


def _through(points: tuple[tuple[float, float], ...], t: float) -> float:
    if t <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in itertools.pairwise(points):
        if t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    return points[-1][1]


def _points(number: Callable[[Any], float], raw: Any) -> tuple[tuple[float, float], ...]:
    if not isinstance(raw, list) or not raw:
        raise ValueError("points must be a list of [time, value] pairs, like [[0s, 40], [10s, 90]]")
    out = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 2:
            raise ValueError(f"each point is [time, value], got {item!r}")
        out.append((parse_duration(item[0]), number(item[1])))
    if any(b[0] < a[0] for a, b in itertools.pairwise(out)):
        raise ValueError("points must be in time order")
    return tuple(out)


def _value(number: Callable[[Any], float]) -> Callable[[Any], Value]:
    def parse(raw: Any) -> Value:
        if not isinstance(raw, dict):
            return Value(number(raw))
        unknown = set(raw) - {
            "from",
            "to",
            "start",
            "over",
            "base",
            "amplitude",
            "period",
            "points",
        }
        if unknown:
            raise ValueError(
                f"unknown key {sorted(unknown)[0]!r} in a changing value "
                "(use from/to/start/over for a ramp, base/amplitude/period for a wave, "
                "points for a line through [time, value] pairs)"
            )
        if "points" in raw:
            if len(raw) > 1:
                raise ValueError("points stands alone: no other key beside it")
            line = _points(number, raw["points"])
            return Value(line[0][1], points=line)
        if "from" in raw or "to" in raw:
            if "from" not in raw or "to" not in raw:
                raise ValueError("a ramp needs both 'from' and 'to'")
            if "base" in raw:
                raise ValueError("give 'from'/'to' (a ramp) or 'base' (a wave), not both")
            base = number(raw["from"])
            to: float | None = number(raw["to"])
        else:
            base, to = number(raw.get("base", 0)), None
        return Value(
            base=base,
            to=to,
            start=parse_duration(raw.get("start", 0)),
            over=parse_duration(raw.get("over", 0)),
            amplitude=number(raw.get("amplitude", 0)) if "amplitude" in raw else 0.0,
            period=parse_duration(raw.get("period", 0)),
        )

    return parse


_SIZE_VALUE = _value(lambda raw: float(parse_size(raw)))
_NUMBER_VALUE = _value(number)
_RATIO_VALUE = _value(ratio)


# -- the scenario ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """A span of scenario time, ``from`` inclusive to ``until`` exclusive (None: forever)."""

    start: float = 0.0
    end: float | None = None

    def holds(self, t: float) -> bool:
        return t >= self.start and (self.end is None or t < self.end)


@dataclass(frozen=True)
class InjectedError:
    """Calls behind ``field`` raise ``error`` (or sleep ``hang`` seconds) during ``window``."""

    field: str
    error: str
    window: Window
    hang: float = 0.0


@dataclass(frozen=True)
class SimProcess:
    pid: int | str | None  # a number, "self", "parent", or None with ``spawn``
    spawn: tuple[str, ...]
    memory: Value
    type: str
    window: Window
    where: str = ""  # file:line, for errors while starting it
    holds_device: bool = True  # a spawned process keeps its GPU's device node open
    orphan: bool = False  # spawned by a job leader that holds the GPU, then exits
    orphan_after: float = 2.0  # how long that leader lives, seconds
    churn: float = 0.0  # > 0: a new process (a new PID) every ``churn`` seconds
    sm_utilization: Value = Value(0.0)  # its share of the SMs' time, 0-1
    memory_utilization: Value = Value(0.0)  # of the memory interface's, 0-1
    encoder_utilization: Value = Value(0.0)  # of the video encoder's, 0-1
    decoder_utilization: Value = Value(0.0)  # of the video decoder's, 0-1
    #: Stands for every process outside the simulation that holds the GPU's device stand-in
    #: open (``pid`` is None and ``spawn`` empty), as a driver lists any CUDA process.
    holders: bool = False
    #: The MIG device it runs on ("": the whole GPU).
    mig: str = ""


@dataclass(frozen=True)
class SimXid:
    """An XID the driver delivers at scenario time ``at`` (on a MIG instance, when given)."""

    at: float
    code: int
    gpu_instance: int | None = None
    compute_instance: int | None = None


@dataclass(frozen=True)
class SimMig:
    """A MIG device: its instances, profile and memory, while ``window`` holds (a layout that
    changes over time is devices whose windows follow each other)."""

    uuid: str
    profile: str
    gpu_instance: int
    compute_instance: int
    memory_total: int
    memory_used: Value
    window: Window
    #: GPM readings of its GPU instance, by key.
    fields: dict[str, Value] = field(default_factory=dict)


@dataclass(frozen=True)
class SimGpu:
    name: str
    uuid: str
    pci_bus_id: str
    serial: str
    minor_number: int
    memory_total: int
    memory_reserved: int
    memory_used: Value
    utilization: Value
    memory_utilization: Value
    temperature: Value
    memory_temperature: Value
    thresholds: dict[str, float | None]  # None: the GPU has no such threshold
    power: Value
    power_limit: float
    fan_speed: Value
    clocks: dict[str, Value]
    performance_state: int
    clock_event_reasons: int
    ecc_enabled: bool
    ecc_corrected: Value
    ecc_uncorrected: Value
    unsupported: frozenset[str]
    processes: tuple[SimProcess, ...]
    errors: tuple[InjectedError, ...]
    present: Window
    mig_devices: tuple[SimMig, ...] = ()
    #: MIG device slots (nvmlDeviceGetMaxMigDeviceCount) while MIG is on.
    mig_slots: int = 7
    #: Readings of ``core.fields`` by key, in base units (per-link ones: every link).
    fields: dict[str, Value] = field(default_factory=dict)
    nvlink_links: int = 0
    #: (link, window) while which the link is down.
    nvlink_down: tuple[tuple[int, Window], ...] = ()
    #: Per-link readings of single links: link -> key -> value.
    link_fields: dict[int, dict[str, Value]] = field(default_factory=dict)
    xids: tuple[SimXid, ...] = ()
    #: It has GPU Performance Monitoring (its metrics are readings of ``fields``).
    gpm: bool = False


@dataclass(frozen=True)
class Scenario:
    driver_version: str
    cuda_version: int
    nvml_version: str
    missing_functions: frozenset[str]
    call_latency: float
    errors: tuple[InjectedError, ...]
    gpus: tuple[SimGpu, ...]
    #: Readings whose field this driver does not know (older drivers): their entries answer
    #: ``InvalidArgument`` on every GPU, their functions ``FunctionNotFound``.
    missing_fields: frozenset[str] = frozenset()
    #: What a pynvml function the simulation does not implement answers: ``FunctionNotFound``
    #: (a driver without it) or ``NotSupported`` (a driver that has it, for a GPU without the
    #: feature; it then costs ``call_latency`` like any call, which keeps benchmarks fair).
    unimplemented: str = "FunctionNotFound"
    #: Where the ``nvidiaN`` device stand-ins are made; "" for a new temporary folder.
    device_folder: str = ""
    #: Added to the PID of every per-process utilization sample: a driver that stamps them
    #: with PIDs of another namespace than the process lists' (0: the same PIDs).
    utilization_pid_offset: int = 0


def _window(section: Section) -> Window:
    start = section.get("from", parse_duration, 0.0)
    end = section.get("until", parse_duration, None)
    if end is not None and end <= start:
        raise section.error("until", f"must be later than from ({start:g}s)")
    return Window(start, end)


def _error_name(raw: Any) -> str:
    name = str(raw)
    if not hasattr(pynvml, f"NVMLError_{name}"):
        known = sorted(n[len("NVMLError_") :] for n in dir(pynvml) if n.startswith("NVMLError_"))
        raise ValueError(f"unknown NVML error {name!r}; one of: {', '.join(known)}")
    return name


def _errors(section: Section, allowed: tuple[str, ...]) -> tuple[InjectedError, ...]:
    out = []
    for item in section.sections("errors"):

        def field_name(raw: Any) -> str:
            if raw not in allowed:
                raise ValueError(f"unknown field {raw!r}; one of: {', '.join(allowed)}")
            return str(raw)

        out.append(
            InjectedError(
                field=item.get("field", field_name, "*"),
                error=item.get("error", _error_name, "Unknown"),
                window=_window(item),
                hang=item.get("hang", parse_duration, 0.0),
            )
        )
        item.done()
    return tuple(out)


def _process(section: Section) -> SimProcess:
    def pid(raw: Any) -> int | str:
        if raw in ("self", "parent"):
            return str(raw)
        if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
            raise ValueError(f"expected a positive PID, 'self' or 'parent', got {raw!r}")
        return raw

    def argv(raw: Any) -> tuple[str, ...]:
        if not isinstance(raw, list) or not raw or not all(isinstance(a, str) for a in raw):
            raise ValueError("expected a non-empty list of strings (program and arguments)")
        return tuple(raw)

    def kind(raw: Any) -> str:
        if raw not in ("compute", "graphics"):
            raise ValueError(f"expected compute or graphics, got {raw!r}")
        return str(raw)

    process = SimProcess(
        holders=section.get("holders", boolean, False),
        pid=section.get("pid", pid, None),
        spawn=section.get("spawn", argv, ()),
        memory=section.get("memory", _SIZE_VALUE, Value(0.0)),
        type=section.get("type", kind, "compute"),
        window=_window(section),
        where=section.doc.where(section.keys),
        holds_device=section.get("holds_device", boolean, True),
        orphan=section.get("orphan", boolean, False),
        orphan_after=section.get("orphan_after", parse_duration, 2.0),
        churn=section.get("churn", parse_duration, 0.0),
        sm_utilization=section.get("sm_utilization", _RATIO_VALUE, Value(0.0)),
        mig=section.get("mig", str, ""),
        memory_utilization=section.get("memory_utilization", _RATIO_VALUE, Value(0.0)),
        encoder_utilization=section.get("encoder_utilization", _RATIO_VALUE, Value(0.0)),
        decoder_utilization=section.get("decoder_utilization", _RATIO_VALUE, Value(0.0)),
    )
    if process.holders:
        for key in ("pid", "spawn", "holds_device", "orphan", "orphan_after", "churn"):
            if section.has(key):
                raise section.error(key, "not with holders: true")
    elif (process.pid is None) == (not process.spawn):
        raise section.error(None, "give exactly one of pid, spawn and holders")
    if process.orphan and not process.spawn:
        raise section.error("orphan", "only a spawned process can be made an orphan")
    if section.has("orphan_after") and not process.orphan:
        raise section.error("orphan_after", "only with orphan: true")
    if section.has("churn"):
        if process.churn <= 0:
            raise section.error("churn", "must be longer than 0s")
        if process.orphan:
            raise section.error("churn", "an orphan cannot churn (it is not our child to reap)")
        if isinstance(process.pid, str):
            raise section.error("churn", "needs a numeric pid or spawn, not self or parent")
    section.done()
    return process


def _gpu(section: Section, index: int) -> SimGpu:
    name = section.get("name", str, "NVIDIA H100 80GB HBM3")
    digest = hashlib.sha1(f"{index}:{name}".encode()).hexdigest()
    default_uuid = (
        f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"
    )

    def unsupported(raw: Any) -> frozenset[str]:
        if not isinstance(raw, list) or any(item not in FIELD_FUNCTIONS for item in raw):
            raise ValueError(f"expected a list of fields from: {', '.join(FIELD_FUNCTIONS)}")
        return frozenset(raw)

    def reasons(raw: Any) -> int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if not isinstance(raw, list) or any(item not in REASON_BITS for item in raw):
            raise ValueError(f"expected a bitmask or a list from: {', '.join(REASON_BITS)}")
        return sum(REASON_BITS[item] for item in set(raw))

    thresholds_section = section.section("thresholds")

    def threshold(raw: Any) -> float | None:
        return None if raw is None else number(raw)

    thresholds: dict[str, float | None] = {}
    for key, fallback in _DEFAULT_THRESHOLDS.items():
        default: float | None = fallback
        thresholds[key] = thresholds_section.get(key, threshold, default)
    thresholds_section.done()
    clocks_section = section.section("clocks_mhz")
    clocks = {
        key: clocks_section.get(key, _NUMBER_VALUE, Value(default))
        for key, default in _DEFAULT_CLOCKS.items()
    }
    clocks_section.done()
    ecc_section = section.section("ecc")
    ecc_enabled = ecc_section.get("enabled", boolean, True)
    ecc_corrected = ecc_section.get("corrected", _NUMBER_VALUE, Value(0.0))
    ecc_uncorrected = ecc_section.get("uncorrected", _NUMBER_VALUE, Value(0.0))
    ecc_section.done()
    present_section = section.section("present")
    present = _window(present_section)
    present_section.done()
    fields_section = section.section("fields")
    fields = _fields(fields_section, LINK_READINGS | _GPU_ONLY, "fields")
    fields_section.done()
    links, down, link_fields = _nvlink(section.section("nvlink"))
    gpu = SimGpu(
        name=name,
        uuid=section.get("uuid", str, default_uuid),
        pci_bus_id=section.get("pci_bus_id", str, f"00000000:{0x17 + index * 0x10:02X}:00.0"),
        serial=section.get("serial", str, f"1654{index:09d}"),
        minor_number=section.get("minor_number", whole(0, 1 << 31), index),
        memory_total=section.get("memory_total", parse_size, 80 * 1024**3),
        memory_reserved=section.get("memory_reserved", parse_size, 512 * 1024**2),
        memory_used=section.get("memory_used", _SIZE_VALUE, Value(0.0)),
        utilization=section.get("utilization", _RATIO_VALUE, Value(0.0)),
        memory_utilization=section.get("memory_utilization", _RATIO_VALUE, Value(0.0)),
        temperature=section.get("temperature", _NUMBER_VALUE, Value(35.0)),
        memory_temperature=section.get("memory_temperature", _NUMBER_VALUE, Value(40.0)),
        thresholds=thresholds,
        power=section.get("power", _NUMBER_VALUE, Value(70.0)),
        power_limit=section.get("power_limit", number, 700.0),
        fan_speed=section.get("fan_speed", _RATIO_VALUE, Value(0.3)),
        clocks=clocks,
        performance_state=section.get("performance_state", whole(0, 1 << 31), 0),
        clock_event_reasons=section.get("clock_event_reasons", reasons, 0),
        ecc_enabled=ecc_enabled,
        ecc_corrected=ecc_corrected,
        ecc_uncorrected=ecc_uncorrected,
        unsupported=section.get("unsupported", unsupported, frozenset()),
        processes=tuple(_process(item) for item in section.sections("processes")),
        errors=_errors(section, ("*", *FIELD_FUNCTIONS)),
        present=present,
        mig_devices=_mig_devices(section, default_uuid),
        mig_slots=section.get("mig_slots", whole(1, 64), 7),
        fields=fields,
        nvlink_links=links,
        nvlink_down=down,
        link_fields=link_fields,
        xids=tuple(_xid(item) for item in section.sections("xids")),
        gpm=section.get("gpm", boolean, False),
    )
    if gpu.memory_reserved >= gpu.memory_total:
        raise section.error("memory_reserved", "must be less than memory_total")
    named = {device.uuid for device in gpu.mig_devices}
    for p, process in enumerate(gpu.processes):
        if process.mig and process.mig not in named:
            raise section.error(
                "processes", f"item {p}: mig {process.mig!r} is none of this GPU's mig_devices"
            )
    section.done()
    return gpu


_GPM_KEYS = frozenset(r.key for r in READINGS.values() if isinstance(r.source, GpmMetric))


def _mig_devices(section: Section, parent: str) -> tuple[SimMig, ...]:
    """``mig_devices``: MIG UUIDs (devices with the defaults), or mappings with ``uuid``,
    ``profile``, ``gpu_instance``, ``compute_instance``, ``memory_total``, ``memory_used``,
    ``from``/``until`` and GPM readings under ``fields``."""
    raw = section.data.get("mig_devices")
    if isinstance(raw, list) and all(isinstance(item, str) for item in raw):
        section.get("mig_devices", lambda value: value)
        if not all(item.startswith("MIG-") for item in raw):
            raise section.error("mig_devices", "expected MIG device UUIDs (MIG-...) or mappings")
        raw = [{"uuid": item} for item in raw]
        section.data = {**section.data, "mig_devices": raw}
    out = []
    for n, item in enumerate(section.sections("mig_devices")):
        uuid = item.get("uuid", str, f"MIG-{parent[len('GPU-') :][:-4]}{n:04x}")
        if not uuid.startswith("MIG-"):
            raise item.error("uuid", "a MIG device's UUID starts with MIG-")
        fields_section = item.section("fields")
        out.append(
            SimMig(
                uuid=uuid,
                profile=item.get("profile", str, "1g.10gb"),
                gpu_instance=item.get("gpu_instance", whole(0, 1 << 16), n + 1),
                compute_instance=item.get("compute_instance", whole(0, 1 << 16), 0),
                memory_total=item.get("memory_total", parse_size, 10 * 1024**3),
                memory_used=item.get("memory_used", _SIZE_VALUE, Value(0.0)),
                window=_window(item),
                fields=_fields(fields_section, _GPM_KEYS, "a MIG device's fields"),
            )
        )
        fields_section.done()
        item.done()
    uuids = [device.uuid for device in out]
    if len(set(uuids)) != len(uuids):
        raise section.error("mig_devices", "two MIG devices with one UUID")
    return tuple(out)


#: Readings that have a scenario key of their own already (``power``, ``memory_temperature``,
#: ``ecc``), or that the driver makes up (``energy``, from power over time): not in ``fields``.
_OWN_KEYS = frozenset({"power", "power_instant", "energy", "memory_temperature"}) | {
    "ecc_corrected",
    "ecc_uncorrected",
}
_GPU_ONLY = frozenset(READINGS) - LINK_READINGS - _OWN_KEYS


def _fields(section: Section, allowed: frozenset[str], where: str) -> dict[str, Value]:
    """The readings a ``fields`` (or ``nvlink.per_link``) section sets, by key."""
    out = {}
    for key in list(section.data):
        if key not in allowed:
            hint = (
                "it has a key of its own (power, memory_temperature, ecc)"
                if key in _OWN_KEYS
                else f"one of: {', '.join(sorted(allowed))}"
            )
            raise section.error(key, f"unknown reading {key!r} in {where}; {hint}")
        out[key] = section.get(key, _NUMBER_VALUE)
    return out


def _nvlink(
    section: Section,
) -> tuple[int, tuple[tuple[int, Window], ...], dict[int, dict[str, Value]]]:
    """``nvlink:``: the number of links, links down and when, and per-link readings."""
    links = section.get("links", whole(0, 64), 0)

    def link_number(raw: Any) -> int:
        number = whole(0, 63)(raw)
        if number >= links:
            raise ValueError(
                f"link {number} does not exist: the GPU has {links} links (0-{links - 1})"
            )
        return number

    down = []
    for item in section.sections("down"):
        down.append((item.get("link", link_number), _window(item)))
        item.done()
    per_link: dict[int, dict[str, Value]] = {}
    links_section = section.section("per_link")
    for raw in list(links_section.data):
        try:
            number = link_number(raw)
        except ValueError as exc:
            raise links_section.error(raw, str(exc)) from None
        one = links_section.section(raw)
        per_link[number] = _fields(one, LINK_READINGS, f"nvlink.per_link.{raw}")
        one.done()
    links_section.done()
    section.done()
    return links, tuple(down), per_link


def _xid(section: Section) -> SimXid:
    instance = whole(0, 0xFFFFFFFE)
    xid = SimXid(
        at=section.get("at", parse_duration),
        code=section.get("code", whole(1, 0xFFFFFFFF)),
        gpu_instance=section.get("gpu_instance", instance, None),
        compute_instance=section.get("compute_instance", instance, None),
    )
    section.done()
    return xid


def _unimplemented(raw: Any) -> str:
    if raw not in ("FunctionNotFound", "NotSupported"):
        raise ValueError(f"expected FunctionNotFound or NotSupported, got {raw!r}")
    return str(raw)


def _reading_keys(raw: Any) -> frozenset[str]:
    if not isinstance(raw, list) or any(item not in READINGS for item in raw):
        raise ValueError(f"expected a list of readings from: {', '.join(READINGS)}")
    return frozenset(raw)


def _directory(raw: Any) -> str:
    if not isinstance(raw, str) or not os.path.isabs(raw):
        raise ValueError(f"expected an absolute path, got {raw!r}")
    if not os.path.isdir(raw):
        raise ValueError(f"{raw} is not an existing directory")
    return raw


def _pid_offset(raw: Any) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= _PID_LIMIT:
        raise ValueError(f"expected a whole number from 0 to {_PID_LIMIT}, got {raw!r}")
    return raw


def parse_scenario(root: Section) -> Scenario:
    """A validated Scenario from the root of a scenario document."""
    driver = root.section("driver")

    def functions(raw: Any) -> frozenset[str]:
        if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
            raise ValueError("expected a list of pynvml function names")
        return frozenset(raw)

    def cuda(raw: Any) -> int:
        major, _, minor = str(raw).partition(".")
        if not major.isdigit() or (minor and not minor.isdigit()):
            raise ValueError(f"expected a CUDA version like 12.4, got {raw!r}")
        return int(major) * 1000 + int(minor or 0) * 10

    scenario = Scenario(
        driver_version=driver.get("version", str, "550.54.15"),
        cuda_version=driver.get("cuda_version", cuda, 12040),
        nvml_version=driver.get("nvml_version", str, "12.550.54.15"),
        missing_functions=driver.get("missing_functions", functions, frozenset()),
        missing_fields=driver.get("missing_fields", _reading_keys, frozenset()),
        call_latency=driver.get("call_latency", parse_duration, 0.0),
        unimplemented=driver.get("unimplemented", _unimplemented, "FunctionNotFound"),
        device_folder=driver.get("device_folder", _directory, ""),
        utilization_pid_offset=driver.get("utilization_pid_offset", _pid_offset, 0),
        errors=_errors(driver, DRIVER_FIELDS),
        gpus=tuple(_gpu(item, i) for i, item in enumerate(root.sections("gpus"))),
    )
    driver.done()
    root.done()
    return scenario


_BUILTIN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scenarios", "builtin.yaml")


#: Scenarios read in this process, by path, with the file's identity when read: a command that
#: checks its settings and then simulates reads its scenario once, and a changed file again.
_READ: dict[str, tuple[tuple[int, ...], Scenario]] = {}


def load_scenario(path: str) -> Scenario:
    """Read a scenario file, or the built-in one for ``builtin``; raises ConfigError."""
    try:
        info = os.stat(path) if path != "builtin" else os.stat(_BUILTIN)
    except OSError:
        return _read_scenario(path)  # its error, said by load_document
    identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    known = _READ.get(path)
    if known is not None and known[0] == identity:
        return known[1]
    scenario = _read_scenario(path)
    _READ[path] = (identity, scenario)
    return scenario


def _read_scenario(path: str) -> Scenario:
    if path == "builtin":
        # a file beside the package (package data), read without importlib.resources: its
        # import costs more than the rest of the scenario's code
        with open(_BUILTIN, encoding="utf-8") as handle:
            text = handle.read()
        return parse_scenario(parse_document(text, "<builtin scenario>").root())
    return parse_scenario(load_document(path).root())
