"""Simulated GPUs: a scenario file becomes fake pynvml functions.

:class:`SimulatedDriver` replaces the functions of the ``pynvml`` module itself, raising pynvml's
own error classes, so the project's NVML module (``exporter.core.nvml``) runs unchanged on top
of it.
Every pynvml function the simulation does not implement raises ``NVMLError_FunctionNotFound``,
like a driver that lacks it. The scenario format is documented in ``docs/simulate.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, NoReturn

import pynvml

from exporter.config.validate import boolean, number, ratio, whole
from exporter.config.yamlconf import ConfigError, Section, load_document, parse_document
from exporter.core.snapshot import CLOCK_EVENT_REASONS
from exporter.core.units import parse_duration, parse_size

#: Fields a scenario can mark unsupported or inject errors into, and the functions behind them.
FIELD_FUNCTIONS: dict[str, tuple[str, ...]] = {
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
    "memory_temperature": ("nvmlDeviceGetFieldValues",),
    "power": ("nvmlDeviceGetPowerUsage",),
    "energy": ("nvmlDeviceGetTotalEnergyConsumption",),
    "fan_speed": ("nvmlDeviceGetFanSpeed",),
    "clocks": ("nvmlDeviceGetClockInfo",),
    "performance_state": ("nvmlDeviceGetPerformanceState",),
    "clock_event_reasons": (
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
    ),
    "ecc": ("nvmlDeviceGetEccMode", "nvmlDeviceGetTotalEccErrors"),
    "processes": tuple(
        f"nvmlDevice{kind}RunningProcesses{version}"
        for kind in ("GetCompute", "GetGraphics")
        for version in ("", "_v2", "_v3")
    ),
    "process_utilization": ("nvmlDeviceGetProcessUtilization",),
}
_FIELD_OF = {fn: name for name, fns in FIELD_FUNCTIONS.items() for fn in fns}
DRIVER_FIELDS = ("init", "count")
_LIFECYCLE = ("nvmlInit", "nvmlInitWithFlags", "nvmlShutdown")
_REASON_BITS = dict(CLOCK_EVENT_REASONS)
_THRESHOLD_CODES = {"shutdown": 0, "slowdown": 1, "memory_max": 2, "gpu_max": 3}
_CLOCK_NAMES = ("graphics", "sm", "memory", "video")
_DEFAULT_THRESHOLDS = {"shutdown": 92.0, "slowdown": 89.0, "gpu_max": 87.0, "memory_max": 95.0}
_DEFAULT_CLOCKS = {"graphics": 1755.0, "sm": 1755.0, "memory": 2619.0, "video": 1545.0}
#: The simulated driver samples per-process utilization every 1/6 s and keeps the last 100.
_UTILIZATION_PERIOD_US = 166_667
_UTILIZATION_KEPT = 100


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


def _mig_uuids(raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(
        isinstance(item, str) and item.startswith("MIG-") for item in raw
    ):
        raise ValueError("expected a list of MIG device UUIDs (MIG-...)")
    return tuple(raw)


def _percent(ratio: float) -> int:
    """A ratio as NVML's whole percent; waves may overshoot 0-1, NVML never does."""
    return round(min(max(ratio, 0.0), 1.0) * 100)


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
    mig_devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Scenario:
    driver_version: str
    cuda_version: int
    nvml_version: str
    missing_functions: frozenset[str]
    call_latency: float
    errors: tuple[InjectedError, ...]
    gpus: tuple[SimGpu, ...]
    #: What a pynvml function the simulation does not implement answers: ``FunctionNotFound``
    #: (a driver without it) or ``NotSupported`` (a driver that has it, for a GPU without the
    #: feature; it then costs ``call_latency`` like any call, which keeps benchmarks fair).
    unimplemented: str = "FunctionNotFound"


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
    )
    if (process.pid is None) == (not process.spawn):
        raise section.error(None, "give exactly one of pid and spawn")
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
        if not isinstance(raw, list) or any(item not in _REASON_BITS for item in raw):
            raise ValueError(f"expected a bitmask or a list from: {', '.join(_REASON_BITS)}")
        return sum(_REASON_BITS[item] for item in set(raw))

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
        mig_devices=section.get("mig_devices", _mig_uuids, ()),
    )
    if gpu.memory_reserved >= gpu.memory_total:
        raise section.error("memory_reserved", "must be less than memory_total")
    section.done()
    return gpu


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
        call_latency=driver.get("call_latency", parse_duration, 0.0),
        unimplemented=driver.get("unimplemented", _unimplemented, "FunctionNotFound"),
        errors=_errors(driver, DRIVER_FIELDS),
        gpus=tuple(_gpu(item, i) for i, item in enumerate(root.sections("gpus"))),
    )
    driver.done()
    root.done()
    return scenario


def load_scenario(path: str) -> Scenario:
    """Read a scenario file, or the built-in one for ``builtin``; raises ConfigError."""
    if path == "builtin":
        text = resources.files("exporter").joinpath("scenarios/builtin.yaml").read_text()
        return parse_scenario(parse_document(text, "<builtin scenario>").root())
    return parse_scenario(load_document(path).root())


# -- the fake driver -------------------------------------------------------------------------


class _Handle:
    """What the fake nvmlDeviceGetHandleByIndex returns (``mig``: a MIG device's UUID)."""

    __slots__ = ("gpu", "index", "mig")

    def __init__(self, index: int, gpu: SimGpu, mig: str = "") -> None:
        self.index, self.gpu, self.mig = index, gpu, mig


def _pay(latency: float) -> None:
    """Spend ``latency`` seconds as a driver call would (sleep is too coarse for microseconds)."""
    if latency:
        until = time.perf_counter() + latency
        while time.perf_counter() < until:
            pass


def _unimplemented(raw: Any) -> str:
    if raw not in ("FunctionNotFound", "NotSupported"):
        raise ValueError(f"expected FunctionNotFound or NotSupported, got {raw!r}")
    return str(raw)


def _raise(name: str) -> NoReturn:
    raise getattr(pynvml, f"NVMLError_{name}")()


def _c_symbols(
    fakes: dict[str, Callable[..., Any]], missing: frozenset[str]
) -> dict[str, Callable[..., int]]:
    """C-style stand-ins for the NVML symbols some tools call directly: they fill the ctypes
    out-parameters from the Python fakes and return NVML return codes instead of raising."""

    def c_call(fill: Callable[..., int | None]) -> Callable[..., int]:
        def symbol(*args: Any) -> int:
            try:
                return fill(*args) or pynvml.NVML_SUCCESS
            except pynvml.NVMLError as exc:
                return exc.value

        return symbol

    def processes(name: str) -> Callable[..., int]:
        def fill(handle: Any, count_ref: Any, array: Any) -> int:
            listed = fakes[name](handle)
            count = count_ref._obj
            if array is None or len(array) < len(listed):
                count.value = len(listed)
                return pynvml.NVML_ERROR_INSUFFICIENT_SIZE if listed else pynvml.NVML_SUCCESS
            for item, proc in zip(array, listed, strict=False):
                for key, value in vars(proc).items():
                    if hasattr(item, key):
                        setattr(item, key, value)
            count.value = len(listed)
            return pynvml.NVML_SUCCESS

        return c_call(fill)

    def memory(versioned: bool) -> Callable[..., int]:
        def fill(handle: Any, ref: Any) -> None:
            out = ref._obj
            got = fakes["nvmlDeviceGetMemoryInfo"](
                handle, version=out.version if versioned else None
            )
            for key, _ in got._fields_:
                if key != "version":
                    setattr(out, key, getattr(got, key))

        return c_call(fill)

    def field_values(handle: Any, count: Any, ref: Any) -> None:
        values = ref._obj
        got = fakes["nvmlDeviceGetFieldValues"](
            handle, [values[i].fieldId for i in range(count.value)]
        )
        for i in range(count.value):
            values[i].valueType, values[i].nvmlReturn = got[i].valueType, got[i].nvmlReturn
            values[i].value = got[i].value

    def no_mps(handle: Any, count_ref: Any, array: Any) -> None:
        count_ref._obj.value = 0  # the simulation runs no MPS server

    def temperature_v(handle: Any, ref: Any) -> None:
        ref._obj.temperature = fakes["nvmlDeviceGetTemperatureV"](handle, ref._obj.sensorType)

    def temperature(handle: Any, sensor: Any, ref: Any) -> None:
        ref._obj.value = fakes["nvmlDeviceGetTemperature"](handle, getattr(sensor, "value", sensor))

    shims = {
        "nvmlDeviceGetMemoryInfo": memory(False),
        "nvmlDeviceGetMemoryInfo_v2": memory(True),
        "nvmlDeviceGetFieldValues": c_call(field_values),
        "nvmlDeviceGetTemperatureV": c_call(temperature_v),
        "nvmlDeviceGetTemperature": c_call(temperature),
    }
    for version in ("_v2", "_v3"):
        for kind in ("Compute", "Graphics"):
            name = f"nvmlDeviceGet{kind}RunningProcesses{version}"
            if name in fakes:
                shims[name] = processes(name)
        shims[f"nvmlDeviceGetMPSComputeRunningProcesses{version}"] = c_call(no_mps)
    return {name: shim for name, shim in shims.items() if name not in missing}


def _calls_library(obj: Any) -> bool:
    """True for the pynvml functions that call into libnvidia-ml (wrappers call those)."""
    code = getattr(obj, "__code__", None)
    return code is not None and (
        "_nvmlGetFunctionPointer" in code.co_names or "_LoadNvmlLibrary" in code.co_names
    )


#: A job leader in its own session and process group: it holds the GPU's device node (NVML lists
#: it, as a CUDA process), starts the worker, and exits after ``orphan_after`` seconds. The worker
#: is left an orphan, as when a training process dies and leaves a DataLoader worker behind.
_ORPHAN_LEADER = (
    "import subprocess, sys, time\n"
    "held = tuple(int(fd) for fd in sys.argv[2].split(',') if fd)\n"
    "worker = subprocess.Popen(sys.argv[3:], stdin=subprocess.DEVNULL,"
    " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=held)\n"
    "print(worker.pid, flush=True)\n"
    "time.sleep(float(sys.argv[1]))\n"
)


def _running(pid: int) -> bool:
    """True while ``pid`` lives (not exited, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _set_parent_death_signal() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class SimulatedDriver:
    """Installs a Scenario as pynvml's functions; ``uninstall`` puts the real ones back."""

    scenario: Scenario
    clock: Callable[[], float] = time.monotonic
    calls: Counter[str] = field(default_factory=Counter)
    _t0: float = 0.0
    _epoch_us: int = 0  # the host's clock at install, µs: NVML's timestamps count from it
    _saved: dict[str, Any] = field(default_factory=dict)
    _children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _pids: dict[tuple[int, int], int] = field(default_factory=dict)
    _energy: dict[int, tuple[float, float]] = field(default_factory=dict)
    _orphans: list[int] = field(default_factory=list)
    #: (gpu, entry) -> the leader of an orphan's job, listed on the GPU while it lives
    _leaders: dict[tuple[int, int], subprocess.Popen[bytes]] = field(default_factory=dict)
    _periods: dict[tuple[int, int], int] = field(default_factory=dict)  # churn: period started
    _initialized: bool = False
    #: A folder of empty ``nvidiaN`` files standing in for the device nodes; spawned processes
    #: hold theirs open, as CUDA processes hold ``/dev/nvidiaN`` (use it as ``paths.dev``).
    dev_root: str = ""

    def now(self) -> float:
        """Seconds of scenario time."""
        return self.clock() - self._t0

    def wall(self) -> float:
        """The simulated host's clock, seconds since the epoch: the real one at install plus
        scenario time. NVML's sample timestamps (per-process utilization) are on it."""
        return self._epoch_us / 1e6 + self.now()

    # -- installation ---------------------------------------------------------------------

    def install(self) -> SimulatedDriver:
        """Replace every ``nvml*`` function of pynvml; start the scenario's processes."""
        if self._saved:
            return self
        self._t0 = self.clock()
        self._epoch_us = round(time.time() * 1e6)
        try:
            self.dev_root = tempfile.mkdtemp(prefix="gpu-exporter-sim-dev-")
            for gpu in self.scenario.gpus:
                with open(os.path.join(self.dev_root, f"nvidia{gpu.minor_number}"), "w"):
                    pass
        except OSError as exc:
            raise ConfigError(
                "simulation",
                "",
                f"cannot make the simulated device nodes in {tempfile.gettempdir()}: "
                f"{exc.strerror} (set TMPDIR to a writable folder)",
            ) from None
        fakes = self._fakes()
        for name in dir(pynvml):
            if _calls_library(getattr(pynvml, name)) or name in fakes:
                self._saved[name] = getattr(pynvml, name)
        installed = {}
        for name in set(self._saved) | set(fakes):
            if name in self.scenario.missing_functions or name not in fakes:
                fake = self._missing(name)
            else:
                fake = installed[name] = self._counted(name, fakes[name])
            setattr(pynvml, name, fake)
        # Tools that call the C symbols themselves (nvitop does, for the process and memory
        # structs) get them from here, on top of the same fakes.
        shims = _c_symbols(installed, self.scenario.missing_functions)
        self._saved["_nvmlGetFunctionPointer"] = pynvml._nvmlGetFunctionPointer

        def function_pointer(symbol: str) -> Callable[..., int]:
            if symbol not in shims:
                _raise("FunctionNotFound")
            return shims[symbol]

        function_pointer.__module__ = __name__
        pynvml._nvmlGetFunctionPointer = function_pointer
        self._spawn()
        return self

    def uninstall(self) -> None:
        """Restore pynvml and stop the processes the scenario spawned."""
        for name, original in self._saved.items():
            setattr(pynvml, name, original)
        for name in [n for n in dir(pynvml) if n.startswith("nvml") and n not in self._saved]:
            if getattr(getattr(pynvml, name), "__module__", "") == __name__:
                delattr(pynvml, name)
        self._saved.clear()
        for child in self._children:
            with contextlib.suppress(OSError):
                child.terminate()
        for pid in self._orphans:  # not our children: signal them, init reaps them
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self._orphans.clear()
        for leader in self._leaders.values():
            with contextlib.suppress(OSError):
                leader.kill()
            leader.wait()
        self._leaders.clear()
        for child in self._children:
            try:
                child.wait(timeout=2)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self._children.clear()
        if self.dev_root:
            shutil.rmtree(self.dev_root, ignore_errors=True)

    def __enter__(self) -> SimulatedDriver:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _spawn(self) -> None:
        for g, gpu in enumerate(self.scenario.gpus):
            for p, proc in enumerate(gpu.processes):
                if proc.spawn:
                    device = os.path.join(self.dev_root, f"nvidia{gpu.minor_number}")
                    key = f"gpus[{g}].processes[{p}].spawn"
                    self._pids[(g, p)] = self._start(proc, key, device, (g, p))
                elif proc.pid == "self":
                    self._pids[(g, p)] = os.getpid()
                elif proc.pid == "parent":
                    self._pids[(g, p)] = os.getppid()
                else:
                    self._pids[(g, p)] = int(proc.pid)  # type: ignore[arg-type]

    def _start(self, proc: SimProcess, key: str, device: str, entry: tuple[int, int]) -> int:
        argv = list(proc.spawn)
        if argv[0] in ("python", "python3"):  # the interpreter running the agent
            argv[0] = sys.executable
        if shutil.which(argv[0]) is None:
            self.uninstall()  # put pynvml back and stop what already started
            raise ConfigError(
                proc.where or "scenario", key, f"cannot start {argv[0]!r}: no such program"
            )
        # The device stays open in the process, as a CUDA context keeps /dev/nvidiaN open.
        fd = os.open(device, os.O_RDONLY) if proc.holds_device else None
        held = (fd,) if fd is not None else ()
        try:
            if proc.orphan:
                lives = str(proc.orphan_after)
                leader = subprocess.Popen(
                    [sys.executable, "-c", _ORPHAN_LEADER, lives, ",".join(map(str, held)), *argv],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    pass_fds=held,
                )
                assert leader.stdout is not None
                with leader.stdout:
                    pid = int(leader.stdout.readline())
                self._leaders[entry] = leader
                self._orphans.append(pid)
                return pid
            child = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=held,
                preexec_fn=_set_parent_death_signal if sys.platform == "linux" else None,
            )
        finally:
            if fd is not None:
                os.close(fd)
        self._children.append(child)
        return child.pid

    def _missing(self, name: str) -> Callable[..., Any]:
        answer = self.scenario.unimplemented
        if name in self.scenario.missing_functions:
            answer = "FunctionNotFound"  # named missing: the driver lacks it, whatever the default

        def missing(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if answer != "FunctionNotFound":
                _pay(self.scenario.call_latency)
            _raise(answer)

        missing.__module__ = __name__
        return missing

    def _counted(self, name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
        latency = self.scenario.call_latency
        field_name = _FIELD_OF.get(name)

        def fake(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            _pay(latency)
            t = self.now()
            if not self._initialized and name not in _LIFECYCLE:
                _raise("Uninitialized")
            if args and isinstance(args[0], _Handle):
                gpu = args[0].gpu
                if not gpu.present.holds(t):
                    _raise("GpuIsLost")
                self._inject(gpu.errors, field_name, t)
                if field_name in gpu.unsupported:
                    _raise("NotSupported")
            return impl(*args, **kwargs)

        fake.__name__ = name
        fake.__module__ = __name__
        return fake

    def _inject(self, errors: tuple[InjectedError, ...], field_name: str | None, t: float) -> None:
        for error in errors:
            if error.window.holds(t) and error.field in ("*", field_name):
                if error.hang:
                    time.sleep(error.hang)
                    continue
                _raise(error.error)

    def _present(self) -> list[SimGpu]:
        t = self.now()
        return [gpu for gpu in self.scenario.gpus if gpu.present.holds(t)]

    # -- the functions ----------------------------------------------------------------------

    def _fakes(self) -> dict[str, Callable[..., Any]]:
        s = self.scenario

        def init(*_: Any) -> None:
            self._inject(s.errors, "init", self.now())
            self._initialized = True

        def shutdown() -> None:
            self._initialized = False

        def count() -> int:
            self._inject(s.errors, "count", self.now())
            return len(self._present())

        def handle(index: int) -> _Handle:
            present = self._present()
            if not 0 <= index < len(present):
                _raise("InvalidArgument")
            gpu = present[index]
            self._inject(gpu.errors, "handle", self.now())
            return _Handle(next(i for i, g in enumerate(s.gpus) if g is gpu), gpu)

        def at(v: Value) -> float:
            return v.at(self.now())

        def memory(h: _Handle, version: int | None = None) -> Any:
            if version and "nvmlDeviceGetMemoryInfo_v2" in s.missing_functions:
                _raise("FunctionNotFound")
            gpu = h.gpu
            used = at(gpu.memory_used) + sum(m for _, m in self._live_processes(h))
            used = int(min(max(used, 0), gpu.memory_total - gpu.memory_reserved))
            if version:
                out = pynvml.c_nvmlMemory_v2_t()
                out.version, out.reserved = version, gpu.memory_reserved
                out.used = used
            else:  # v1 counts reserved memory as used
                out = pynvml.c_nvmlMemory_t()
                out.used = used + gpu.memory_reserved
            out.total = gpu.memory_total
            out.free = gpu.memory_total - gpu.memory_reserved - used
            return out

        def utilization(h: _Handle) -> Any:
            out = pynvml.c_nvmlUtilization_t()
            out.gpu = _percent(at(h.gpu.utilization))
            out.memory = _percent(at(h.gpu.memory_utilization))
            return out

        def temperature(h: _Handle, sensor: int, version: int | None = None) -> int:
            return round(at(h.gpu.temperature))

        def field_values(h: _Handle, ids: list[int]) -> Any:
            values = (pynvml.c_nvmlFieldValue_t * len(ids))()
            for i, field_id in enumerate(ids):
                values[i].fieldId = field_id
                if field_id == 82:  # NVML_FI_DEV_MEMORY_TEMP
                    values[i].valueType = 1
                    values[i].value.uiVal = round(at(h.gpu.memory_temperature))
                else:
                    values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            return values

        def power(h: _Handle) -> int:
            return round(at(h.gpu.power) * 1000)

        def energy(h: _Handle) -> int:
            t = self.now()
            last_t, total = self._energy.get(h.index, (0.0, 0.0))
            total += max(t - last_t, 0.0) * at(h.gpu.power) * 1000
            self._energy[h.index] = (t, total)
            return int(total)

        def clock(h: _Handle, clock_type: int) -> int:
            return round(at(h.gpu.clocks[_CLOCK_NAMES[clock_type]]))

        def reasons(h: _Handle) -> int:
            bits = h.gpu.clock_event_reasons
            slowdown = h.gpu.thresholds.get("slowdown")
            if slowdown is not None and temperature(h, 0) >= slowdown:
                bits |= _REASON_BITS["sw_thermal_slowdown"]
            return bits

        def threshold(h: _Handle, kind: int) -> int:
            name = next((k for k, v in _THRESHOLD_CODES.items() if v == kind), None)
            value = h.gpu.thresholds.get(name) if name else None
            if value is None:
                _raise("NotSupported")
            return round(value)

        def ecc_errors(h: _Handle, error_type: int, counter: int) -> int:
            return int(at(h.gpu.ecc_uncorrected if error_type else h.gpu.ecc_corrected))

        def pci(h: _Handle) -> Any:
            out = pynvml.nvmlPciInfo_t()
            out.busId = h.gpu.pci_bus_id.encode()
            return out

        def processes(kind: str) -> Callable[[_Handle], list[Any]]:
            def listed(h: _Handle) -> list[Any]:
                return [
                    pynvml.nvmlFriendlyObject(
                        {
                            "pid": pid,
                            "usedGpuMemory": int(used),
                            "gpuInstanceId": 0xFFFFFFFF,
                            "computeInstanceId": 0xFFFFFFFF,
                        }
                    )
                    for pid, used in self._live_processes(h, kind)
                ]

            return listed

        def process_utilization(h: _Handle, since: int) -> list[Any]:
            samples = self._utilization_samples(h, int(since))
            if not samples:
                _raise("NotFound")  # as the driver: no process busy since ``since``
            return samples

        fakes: dict[str, Callable[..., Any]] = {
            "nvmlInit": init,
            "nvmlInitWithFlags": init,
            "nvmlShutdown": shutdown,
            "nvmlSystemGetDriverVersion": lambda: s.driver_version,
            "nvmlSystemGetNVMLVersion": lambda: s.nvml_version,
            "nvmlSystemGetCudaDriverVersion": lambda: s.cuda_version,
            "nvmlSystemGetCudaDriverVersion_v2": lambda: s.cuda_version,
            "nvmlDeviceGetCount": count,
            "nvmlDeviceGetHandleByIndex": handle,
            "nvmlDeviceGetUUID": lambda h: h.mig or h.gpu.uuid,
            "nvmlDeviceGetMigMode": lambda h: [int(bool(h.gpu.mig_devices))] * 2,
            "nvmlDeviceGetMaxMigDeviceCount": lambda h: len(h.gpu.mig_devices),
            "nvmlDeviceGetMigDeviceHandleByIndex": lambda h, i: _Handle(
                h.index, h.gpu, h.gpu.mig_devices[i]
            ),
            "nvmlDeviceGetName": lambda h: h.gpu.name,
            "nvmlDeviceGetPciInfo": pci,
            "nvmlDeviceGetPciInfo_v3": pci,
            "nvmlDeviceGetSerial": lambda h: h.gpu.serial,
            "nvmlDeviceGetMinorNumber": lambda h: h.gpu.minor_number,
            "nvmlDeviceGetTemperatureThreshold": threshold,
            "nvmlDeviceGetEnforcedPowerLimit": lambda h: round(h.gpu.power_limit * 1000),
            "nvmlDeviceGetEccMode": lambda h: [int(h.gpu.ecc_enabled), int(h.gpu.ecc_enabled)],
            "nvmlDeviceGetMemoryInfo": memory,
            "nvmlDeviceGetUtilizationRates": utilization,
            "nvmlDeviceGetTemperature": temperature,
            "nvmlDeviceGetTemperatureV": temperature,
            "nvmlDeviceGetFieldValues": field_values,
            "nvmlDeviceGetPowerUsage": power,
            "nvmlDeviceGetTotalEnergyConsumption": energy,
            "nvmlDeviceGetFanSpeed": lambda h: _percent(at(h.gpu.fan_speed)),
            "nvmlDeviceGetClockInfo": clock,
            "nvmlDeviceGetPerformanceState": lambda h: h.gpu.performance_state,
            "nvmlDeviceGetCurrentClocksEventReasons": reasons,
            "nvmlDeviceGetCurrentClocksThrottleReasons": reasons,
            "nvmlDeviceGetTotalEccErrors": ecc_errors,
            "nvmlDeviceGetProcessUtilization": process_utilization,
        }
        for kind, fn in (("compute", "GetCompute"), ("graphics", "GetGraphics")):
            for version in ("", "_v2", "_v3"):
                fakes[f"nvmlDevice{fn}RunningProcesses{version}"] = processes(kind)
        return fakes

    def _live_processes(self, h: _Handle, kind: str | None = None) -> Iterator[tuple[int, float]]:
        t = self.now()
        for pid, proc in self._live(h, kind):
            yield pid, max(proc.memory.at(t), 0.0)

    def _live(self, h: _Handle, kind: str | None = None) -> Iterator[tuple[int, SimProcess]]:
        """The PID and entry of each process listed on ``h`` now."""
        t = self.now()
        for p, proc in enumerate(h.gpu.processes):
            if proc.window.holds(t) and (kind is None or proc.type == kind):
                pid = self._churn(h, p, proc, t) if proc.churn else self._pids[(h.index, p)]
                leader = self._leaders.get((h.index, p))
                if leader is not None and leader.poll() is None:  # poll() reaps it once it ends
                    yield leader.pid, proc
                if pid is None or (proc.spawn and not proc.churn and not _running(pid)):
                    continue  # a spawned process that ended: the driver frees it, as a real one
                yield pid, proc

    def _utilization_samples(self, h: _Handle, since: int) -> list[Any]:
        """What ``nvmlDeviceGetProcessUtilization(h, since)`` answers: a sample for each listed
        process that was busy at one of the driver's kept sampling moments stamped after
        ``since``, with its highest SM percent there, stamped with its last busy moment."""
        moments = self._utilization_moments(since)
        busiest: dict[int, tuple[int, float]] = {}  # pid -> (percent, last busy moment)
        for pid, proc in self._live(h):  # a PID in both lists is one process to the driver
            for m in moments:
                sm = _percent(proc.sm_utilization.at(m)) if proc.window.holds(m) else 0
                if sm > 0:
                    top, last = busiest.get(pid, (0, m))
                    busiest[pid] = (max(top, sm), max(last, m))
        samples = []
        for pid, (sm, last) in busiest.items():
            sample = pynvml.c_nvmlProcessUtilizationSample_t()
            sample.pid, sample.smUtil = pid, sm
            sample.timeStamp = self._epoch_us + round(last * 1e6)
            samples.append(sample)
        return samples

    def _utilization_moments(self, since: int) -> list[float]:
        """The driver's kept sampling moments (scenario seconds) stamped after ``since`` (µs)."""
        last = round(self.now() * 1e6) // _UTILIZATION_PERIOD_US
        after = (since - self._epoch_us) // _UTILIZATION_PERIOD_US  # stamped at or before since
        first = max(0, last - _UTILIZATION_KEPT + 1, after + 1)
        return [k * _UTILIZATION_PERIOD_US / 1e6 for k in range(first, last + 1)]

    def _churn(self, h: _Handle, p: int, proc: SimProcess, t: float) -> int | None:
        """The PID a churning entry lists at ``t``: a new one every ``proc.churn`` seconds.

        A ``pid`` entry counts up from its PID. A ``spawn`` entry's process is killed and reaped
        and the program started again when its period ends, or at once when it has exited by
        itself; None when the new one could not be started (tried again at the next listing).
        """
        period = int((t - proc.window.start) // proc.churn)
        if not proc.spawn:
            return int(proc.pid) + period  # type: ignore[arg-type]
        key = (h.index, p)
        pid = self._pids.get(key)
        child = next((c for c in self._children if c.pid == pid), None)
        if child is not None and self._periods.get(key, 0) == period and child.poll() is None:
            return pid
        if child is not None:
            self._children.remove(child)
            with contextlib.suppress(OSError):
                child.kill()
            child.wait()
        self._pids.pop(key, None)
        device = os.path.join(self.dev_root, f"nvidia{h.gpu.minor_number}")
        try:
            pid = self._start(proc, f"gpus[{h.index}].processes[{p}].spawn", device, key)
        except OSError:  # no fork now (EAGAIN, ENOMEM): list none until it can start
            return None
        self._pids[key], self._periods[key] = pid, period
        return pid


def simulate(path: str, clock: Callable[[], float] = time.monotonic) -> SimulatedDriver:
    """Load ``path`` (or ``builtin``) and install it; raises ConfigError for a bad scenario."""
    return SimulatedDriver(load_scenario(path), clock).install()
