"""The simulated driver: a pynvml-shaped object that answers from a Scenario.

Hand it to the NVML module as its library (``Nvml(library=driver)``): its ``nvml*`` attributes
are pynvml's functions, by name and arguments, answering with pynvml's own structures and
raising pynvml's own error classes, so ``exporter.core.nvml`` runs the code it runs on a real
GPU. Every other pynvml function that reaches libnvidia-ml raises ``NVMLError_FunctionNotFound``,
like a driver that lacks it; pynvml's constants, structures and error classes are pynvml's own.
Nothing is patched: the ``pynvml`` module stays as it is. The scenario format is documented in
``docs/simulate.md``.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import struct
import threading
import time
import types
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, NoReturn

import pynvml

from exporter.core import fields as readings
from exporter.core.fields import (
    FIELD_READINGS,
    FUNCTION_READINGS,
    GPM_READINGS,
    Function,
    GpmMetric,
    Reading,
)
from exporter.core.nvml import CLOCKS, TEMPERATURE_THRESHOLDS
from exporter.simulate.processes import (
    DeviceHolders,
    ScenarioProcesses,
    make_device_folder,
    remove_device_folder,
    running,
)
from exporter.simulate.scenario import (
    CALL_FIELDS,
    DRIVER_FIELDS,
    FIELD_FUNCTIONS,
    REASON_BITS,
    InjectedError,
    Scenario,
    SimGpu,
    SimMig,
    SimProcess,
    Value,
    load_scenario,
    parse_scenario,
)

__all__ = [
    "DRIVER_FIELDS",
    "FIELD_FUNCTIONS",
    "Scenario",
    "SimulatedDriver",
    "Value",
    "load_scenario",
    "parse_scenario",
    "simulate",
]


def _fields_of() -> dict[str, tuple[str, ...]]:
    """pynvml function -> the scenario fields whose errors and gaps it answers with."""
    out: dict[str, list[str]] = {}
    for name, fns in CALL_FIELDS.items():
        for fn in fns:
            out.setdefault(fn, []).append(name)
    for reading in FUNCTION_READINGS:
        assert isinstance(reading.source, Function)
        out.setdefault(reading.source.name, []).append(reading.key)
    for reading in FIELD_READINGS:
        if reading.fallback is not None:
            out.setdefault(reading.fallback.name, []).append(reading.key)
    return {fn: tuple(names) for fn, names in out.items()}


_FIELD_OF = _fields_of()
#: Field id -> (reading, link) for the readings with a field of their own per link, and
#: field id -> (reading, None) for the others (a per-link one takes its link from ``scopeId``).
_BY_FIELD_ID: dict[int, tuple[Reading, int | None]] = {}
for _reading in FIELD_READINGS:
    if _reading.link_ids:
        _BY_FIELD_ID.update((fid, (_reading, link)) for link, fid in enumerate(_reading.link_ids))
    else:
        _BY_FIELD_ID[_reading.field_id(None) or 0] = (_reading, None)
#: GPM metric id -> its reading.
_GPM_BY_ID = {r.source.id: r for r in GPM_READINGS if isinstance(r.source, GpmMetric)}
#: Points a GPM metric's value is averaged over between its two samples.
_GPM_POINTS = 16
#: The list tail of a function reading's answer after its items (utilization's sampling period).
_ANSWER_TAIL = {
    "nvmlDeviceGetEncoderUtilization": (167_000,),
    "nvmlDeviceGetDecoderUtilization": (167_000,),
}
#: Where a ``c_nvmlFieldValue_t``'s members lie: its size, and the offsets of (fieldId,
#: scopeId), timestamp, (valueType, nvmlReturn) and value.
_FV = pynvml.c_nvmlFieldValue_t
_FIELD_OFFSETS = (
    ctypes.sizeof(_FV),
    _FV.fieldId.offset,
    _FV.timestamp.offset,
    _FV.valueType.offset,
    _FV.value.offset,
)
_TWO_UINTS, _INT64 = struct.Struct("=II"), struct.Struct("=q")
_VALUE_OF = {
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: struct.Struct("=I"),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: struct.Struct("=Q"),
}
#: One entry of a field-value answer: (return code, value type, value), or what makes it.
_EntryAnswer = tuple[int, int, int] | Callable[[], tuple[int, int, int]]


class _FieldPlan(NamedTuple):
    """How the simulated driver answers one list of field-value requests of one GPU."""

    #: the answer's memory: every entry's field id and scope, and the entries that never change
    template: bytes
    #: (offset, what answers it) of each entry that may change between calls
    changing: list[tuple[int, Callable[[], tuple[int, int, int]]]]


def _pack_entry(raw: Any, base: int, code: int, kind: int, number: int) -> None:
    """Write one entry's value type, return code and (when it answered) value at ``base``."""
    _TWO_UINTS.pack_into(raw, base + _FIELD_OFFSETS[3], kind, code)
    if not code:
        _VALUE_OF[kind].pack_into(raw, base + _FIELD_OFFSETS[4], number)


#: How long one pass of a blocking event wait sleeps at most on a test's clock (which is
#: checked between passes, so moving it moves delivery along).
_EVENT_POLL_SECONDS = 0.02
_LIFECYCLE = ("nvmlInit", "nvmlInitWithFlags", "nvmlShutdown")
_THRESHOLD_NAMES = {number: name for name, _, number in TEMPERATURE_THRESHOLDS}
_CLOCK_NAMES = dict((number, name) for name, number in CLOCKS)
#: The simulated driver samples per-process utilization every 1/6 s and keeps the last 100.
_UTILIZATION_PERIOD_US = 166_667
_UTILIZATION_KEPT = 100
#: What pynvml calls to reach libnvidia-ml.
_LIBRARY_ENTRIES = frozenset({"_nvmlGetFunctionPointer", "_LoadNvmlLibrary"})


class _Handle:
    """What the fake nvmlDeviceGetHandleByIndex returns (``mig``: a MIG device's UUID)."""

    __slots__ = ("gpu", "index", "mig")

    def __init__(self, index: int, gpu: SimGpu, mig: str = "") -> None:
        self.index, self.gpu, self.mig = index, gpu, mig


class _EventSet:
    """What the fake nvmlEventSetCreate returns: the GPUs registered (and since when, in
    scenario time) and the XIDs it delivered."""

    def __init__(self) -> None:
        self.registered: dict[int, tuple[float, int]] = {}  # GPU -> (time, sequence number)
        self.delivered: set[int] = set()
        self.freed = False


def _pay(latency: float) -> None:
    """Spend ``latency`` seconds as a driver call would (sleep is too coarse for microseconds)."""
    if latency:
        until = time.perf_counter() + latency
        while time.perf_counter() < until:
            pass


def _filled(out: Any, **members: Any) -> Any:
    """``out`` with ``members`` set as the driver's C sets them: through ctypes' own member
    descriptors (pynvml's structures pass every attribute through a Python ``__setattr__``,
    which would be this process's cost, not a driver's)."""
    cls = type(out)
    for name, value in members.items():
        getattr(cls, name).__set__(out, value)
    return out


def _raise(name: str) -> NoReturn:
    raise getattr(pynvml, f"NVMLError_{name}")()


def _percent(ratio: float) -> int:
    """A ratio as NVML's whole percent; waves may overshoot 0-1, NVML never does."""
    return round(min(max(ratio, 0.0), 1.0) * 100)


@functools.cache
def library_functions() -> frozenset[str]:
    """The names of pynvml's functions that reach libnvidia-ml, themselves or through the
    functions they wrap or call."""
    functions = {n: f for n, f in vars(pynvml).items() if isinstance(f, types.FunctionType)}

    def names(fn: Any) -> set[str]:
        found: set[str] = set()
        while fn is not None:
            code = getattr(fn, "__code__", None)
            found.update(code.co_names if code is not None else ())
            fn = getattr(fn, "__wrapped__", None)
        return found

    uses = {name: names(fn) for name, fn in functions.items()}
    reaching = {name for name, used in uses.items() if used & _LIBRARY_ENTRIES} | _LIBRARY_ENTRIES
    while True:
        more = {name for name, used in uses.items() if used & reaching} - reaching
        if not more:
            return frozenset(reaching)
        reaching |= more


class SimulatedDriver:
    """A Scenario as a pynvml-shaped library; :meth:`start` sets scenario time to 0 and starts
    the scenario's processes, :meth:`stop` stops them.

    ``calls`` counts the calls of each function. Its functions are plain attributes: a test may
    replace one on the object (never on pynvml).
    """

    def __init__(self, scenario: Scenario, clock: Callable[[], float] = time.monotonic) -> None:
        self.scenario = scenario
        self.clock = clock
        self.calls: Counter[str] = Counter()
        #: A folder of empty ``nvidiaN`` files standing in for the device nodes; spawned
        #: processes hold theirs open, as CUDA processes hold ``/dev/nvidiaN`` (use it as
        #: ``paths.dev``). Made by :meth:`start`.
        self.dev_root = ""
        self.processes = ScenarioProcesses(scenario, "")
        self._holders: DeviceHolders | None = None  # made by start, for ``holders`` entries
        self._t0 = 0.0
        self._epoch_us = 0  # the host's clock at start, µs: NVML's timestamps count from it
        self._energy: dict[int, tuple[float, float]] = {}
        self._initialized = False
        self._started = False
        #: Each GPU's XIDs: (scenario time, sequence number, XID) in time order; the scenario's
        #: and those :meth:`inject_xid` adds. ``_xid_wakeup`` wakes blocked event waits.
        self._xid_seq = itertools.count()
        self._xids: dict[int, list[tuple[float, int, Any]]] = {
            i: [(x.at, next(self._xid_seq), x) for x in sorted(gpu.xids, key=lambda x: x.at)]
            for i, gpu in enumerate(scenario.gpus)
        }
        self._xid_wakeup = threading.Condition()
        #: GPM samples allocated, by address: [the sample, its GPU's index, scenario time]
        #: (index and time None until ``nvmlGpmSampleGet`` takes it).
        self._gpm_samples: dict[int, list[Any]] = {}
        #: (GPU, requested fields) -> how each entry is answered (see _field_plan).
        self._plans: dict[tuple[int, tuple[Any, ...]], _FieldPlan] = {}
        #: One pynvml device pointer per GPU: what an event names its GPU by (a ctypes handle,
        #: as a real driver's), resolved back to the GPU by any function given it.
        self._devices = [pynvml.struct_c_nvmlDevice_t() for _ in scenario.gpus]
        self._device_index = {ctypes.addressof(d): i for i, d in enumerate(self._devices)}
        # only what this nvidia-ml-py has: an older one lacks the newer functions, as the
        # agent will find on a host with it (nvmlDeviceGetTemperatureV in 12.535, say)
        fakes = {n: f for n, f in self._fakes().items() if callable(getattr(pynvml, n, None))}
        missing = set(scenario.missing_functions)
        for reading in FUNCTION_READINGS:  # a driver without the field lacks its function
            if reading.key in scenario.missing_fields:
                assert isinstance(reading.source, Function)
                missing.add(reading.source.name)
        #: The functions it answers from the scenario (without ``missing_functions``).
        self.implemented = frozenset(fakes) - missing
        functions: dict[str, Callable[..., Any]] = {}
        for name in {n for n in library_functions() if n.startswith("nvml")} | set(fakes):
            if name in self.implemented:
                functions[name] = self._counted(name, fakes[name])
            else:
                functions[name] = self._missing(name)
        #: Every function it has: the implemented ones and those answering FunctionNotFound.
        self.function_names = frozenset(functions)
        vars(self).update(functions)

    def __getattr__(self, name: str) -> Any:
        """pynvml's own constants, structures and error classes (never a function of pynvml
        that would reach libnvidia-ml)."""
        if name.startswith("__") or name in library_functions():
            raise AttributeError(name)
        return getattr(pynvml, name)

    def now(self) -> float:
        """Seconds of scenario time."""
        return self.clock() - self._t0

    def wall(self) -> float:
        """The simulated host's clock, seconds since the epoch: the real one at start plus
        scenario time. NVML's sample timestamps (per-process utilization) are on it."""
        return self._epoch_us / 1e6 + self.now()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> SimulatedDriver:
        """Start scenario time and the scenario's processes; raises ConfigError when a device
        stand-in cannot be made or a program to spawn does not exist."""
        if self._started:
            return self
        self._t0 = self.clock()
        self._epoch_us = round(time.time() * 1e6)
        self.dev_root = make_device_folder(self.scenario.gpus, self.scenario.device_folder)
        self.processes = ScenarioProcesses(self.scenario, self.dev_root)
        try:
            self.processes.start()
        except BaseException:
            self._remove_devices()
            raise
        if any(proc.holders for gpu in self.scenario.gpus for proc in gpu.processes):
            self._holders = DeviceHolders(self.dev_root, self.scenario.gpus)
        self._started = True
        return self

    def stop(self) -> None:
        """Stop the processes the scenario spawned and remove the device stand-ins."""
        self.processes.stop()
        self._remove_devices()
        self._holders = None
        self._started = False

    def _remove_devices(self) -> None:
        if self.dev_root:
            made = not self.scenario.device_folder
            remove_device_folder(self.scenario.gpus, self.dev_root, made)

    def __enter__(self) -> SimulatedDriver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- plumbing -----------------------------------------------------------------------------

    def inject_xid(
        self,
        gpu: int,
        code: int,
        gpu_instance: int | None = None,
        compute_instance: int | None = None,
    ) -> None:
        """Have scenario GPU ``gpu`` (its index in the scenario) raise XID ``code`` now."""
        from exporter.simulate.scenario import SimXid

        with self._xid_wakeup:
            xid = SimXid(self.now(), code, gpu_instance, compute_instance)
            self._xids[gpu].append((xid.at, next(self._xid_seq), xid))
            self._xids[gpu].sort(key=lambda item: item[:2])
            self._xid_wakeup.notify_all()

    def _missing(self, name: str) -> Callable[..., Any]:
        answer = self.scenario.unimplemented
        if name in self.scenario.missing_functions or self._lacks_field_function(name):
            answer = "FunctionNotFound"  # named missing: the driver lacks it, whatever the default

        def missing(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if answer != "FunctionNotFound":
                _pay(self.scenario.call_latency)
            _raise(answer)

        missing.__name__ = name
        missing.__module__ = __name__
        return missing

    def _lacks_field_function(self, name: str) -> bool:
        return any(
            reading.key in self.scenario.missing_fields
            for reading in FUNCTION_READINGS
            if isinstance(reading.source, Function) and reading.source.name == name
        )

    def _handle_of(self, device: Any) -> _Handle:
        """The handle of a device pointer an event named (InvalidArgument for another)."""
        index = self._device_index.get(ctypes.cast(device, ctypes.c_void_p).value or 0)
        if index is None:
            _raise("InvalidArgument")
        return _Handle(index, self.scenario.gpus[index])

    def _counted(self, name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
        latency = self.scenario.call_latency
        field_names = _FIELD_OF.get(name, ())

        def fake(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            _pay(latency)
            t = self.now()
            if not self._initialized and name not in _LIFECYCLE:
                _raise("Uninitialized")
            if args and isinstance(args[0], pynvml.c_nvmlDevice_t):
                args = (self._handle_of(args[0]), *args[1:])
            if args and isinstance(args[0], _Handle):
                gpu = args[0].gpu
                if not gpu.present.holds(t):
                    _raise("GpuIsLost")
                for field_name in field_names:
                    self._inject(gpu.errors, field_name, t)
                if any(field_name in gpu.unsupported for field_name in field_names):
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

    def _entry_error(self, gpu: SimGpu, key: str, t: float) -> int:
        """The return code of a reading's own entry of a field-value answer (0: none)."""
        if key in self.scenario.missing_fields:
            return int(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if key in gpu.unsupported:
            return int(pynvml.NVML_ERROR_NOT_SUPPORTED)
        for error in gpu.errors:  # "*" fails whole calls; an entry fails only by its key
            if error.window.holds(t) and error.field == key:
                if error.hang:  # the whole call hangs, as a driver stuck reading the field
                    time.sleep(error.hang)
                    continue
                return int(getattr(pynvml, f"NVMLError_{error.error}")().value)
        return 0

    def reading_value(self, h: _Handle, reading: Reading, link: int | None) -> float:
        """What the GPU reads for ``reading`` now, in base units (``link``: of that link)."""
        read = self._reader(h, reading, link)
        return read() if callable(read) else read

    def _energy_joules(self, h: _Handle) -> float:
        t = self.now()
        last_t, total = self._energy.get(h.index, (0.0, 0.0))
        total += max(t - last_t, 0.0) * h.gpu.power.at(t)
        self._energy[h.index] = (t, total)
        return total

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
            if h.mig:
                return self._mig_memory(h)
            gpu = h.gpu
            used = at(gpu.memory_used) + sum(m for _, m in self._live_processes(h))
            used = int(min(max(used, 0), gpu.memory_total - gpu.memory_reserved))
            total, free = gpu.memory_total, gpu.memory_total - gpu.memory_reserved - used
            if version:
                return _filled(
                    pynvml.c_nvmlMemory_v2_t(),
                    version=version,
                    reserved=gpu.memory_reserved,
                    used=used,
                    total=total,
                    free=free,
                )
            # v1 counts reserved memory as used
            return _filled(
                pynvml.c_nvmlMemory_t(), used=used + gpu.memory_reserved, total=total, free=free
            )

        def utilization(h: _Handle) -> Any:
            return _filled(
                pynvml.c_nvmlUtilization_t(),
                gpu=_percent(at(h.gpu.utilization)),
                memory=_percent(at(h.gpu.memory_utilization)),
            )

        def temperature(h: _Handle, sensor: int, version: int | None = None) -> int:
            return round(at(h.gpu.temperature))

        def field_values(h: _Handle, ids: list[Any]) -> Any:
            # pynvml's own array of its own structure, its memory filled as the driver fills
            # it (member by member through pynvml's classes would cost this process more
            # than the driver's C does, and the benchmark counts it as the agent's)
            plan = self._field_plan(h, ids)
            values = (pynvml.c_nvmlFieldValue_t * len(ids)).from_buffer_copy(plan.template)
            raw = memoryview(values).cast("B")
            stamp = self._epoch_us + round(self.now() * 1e6)
            size, stamp_at = _FIELD_OFFSETS[0], _FIELD_OFFSETS[2]
            if size % 8 == 0 and stamp_at % 8 == 0:  # every entry's timestamp in one copy
                raw.cast("q")[stamp_at // 8 :: size // 8] = array("q", (stamp,)) * len(ids)
            else:
                for base in range(stamp_at, len(plan.template), size):
                    _INT64.pack_into(raw, base, stamp)
            for base, answer in plan.changing:
                _pack_entry(raw, base, *answer())
            return values

        def power(h: _Handle) -> int:
            return round(at(h.gpu.power) * 1000)

        def function_reading(name: str) -> Callable[[_Handle], Any]:
            mine = [r for r in FUNCTION_READINGS if getattr(r.source, "name", "") == name]

            def answer(h: _Handle) -> Any:
                numbers = [round(self.reading_value(h, r, None) / r.scale) for r in mine]
                if all(getattr(r.source, "item", None) is None for r in mine):
                    return numbers[0]
                return [*numbers, *_ANSWER_TAIL.get(name, ())]

            return answer

        def event_set_create() -> _EventSet:
            return _EventSet()

        def register_events(h: _Handle, types: int, event_set: _EventSet) -> None:
            if not isinstance(event_set, _EventSet) or event_set.freed:
                _raise("InvalidArgument")
            if types & pynvml.nvmlEventTypeXidCriticalError:
                with self._xid_wakeup:  # what happened before, even in the same instant, is
                    # never delivered (the sequence number orders XIDs of one instant)
                    event_set.registered[h.index] = (self.now(), next(self._xid_seq))

        def event_set_free(event_set: _EventSet) -> None:
            event_set.freed = True

        def clock(h: _Handle, clock_type: int) -> int:
            return round(at(h.gpu.clocks[_CLOCK_NAMES[clock_type]]))

        def reasons(h: _Handle) -> int:
            bits = h.gpu.clock_event_reasons
            slowdown = h.gpu.thresholds.get("slowdown")
            if slowdown is not None and temperature(h, 0) >= slowdown:
                bits |= REASON_BITS["sw_thermal_slowdown"]
            return bits

        def threshold(h: _Handle, kind: int) -> int:
            name = _THRESHOLD_NAMES.get(kind)
            value = h.gpu.thresholds.get(name) if name else None
            if value is None:
                _raise("NotSupported")
            return round(value)

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
                            "gpuInstanceId": instances[0],
                            "computeInstanceId": instances[1],
                        }
                    )
                    for pid, proc in self._live(h, kind)
                    for used in (max(proc.memory.at(self.now()), 0.0),)
                    for instances in (self._instances_of(h, proc),)
                ]

            return listed

        def process_utilization(kind: Any) -> Callable[[_Handle, int], list[Any]]:
            def answer(h: _Handle, since: int) -> list[Any]:
                if h.gpu.mig_devices:
                    _raise("NotSupported")  # as the driver: none in MIG mode
                samples = self._utilization_samples(h, int(since), kind)
                if not samples:
                    _raise("NotFound")  # as the driver: no process busy since ``since``
                return samples

            return answer

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
            "nvmlDeviceGetMaxMigDeviceCount": lambda h: h.gpu.mig_slots,
            "nvmlDeviceGetMigDeviceHandleByIndex": self._mig_handle,
            "nvmlDeviceGetGpuInstanceId": lambda h: self._mig_of(h).gpu_instance,
            "nvmlDeviceGetComputeInstanceId": lambda h: self._mig_of(h).compute_instance,
            "nvmlGpmMigSampleGet": self._gpm_mig_sample_get,
            "nvmlDeviceGetName": lambda h: (
                f"{h.gpu.name} MIG {self._mig_of(h).profile}" if h.mig else h.gpu.name
            ),
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
            "nvmlEventSetCreate": event_set_create,
            "nvmlDeviceRegisterEvents": register_events,
            "nvmlEventSetWait_v2": self._event_wait,
            "nvmlEventSetFree": event_set_free,
            "nvmlDeviceGetFanSpeed": lambda h: _percent(at(h.gpu.fan_speed)),
            "nvmlDeviceGetClockInfo": clock,
            "nvmlDeviceGetPerformanceState": lambda h: h.gpu.performance_state,
            "nvmlDeviceGetCurrentClocksEventReasons": reasons,
            "nvmlDeviceGetCurrentClocksThrottleReasons": reasons,
            "nvmlDeviceGetProcessUtilization": process_utilization(
                pynvml.c_nvmlProcessUtilizationSample_t
            ),
            "nvmlGpmQueryDeviceSupport": self._gpm_support,
            # R550 and newer; nvidia-ml-py 12.535 has neither the function nor its structure
            **(
                {
                    "nvmlDeviceGetProcessesUtilizationInfo": process_utilization(
                        pynvml.c_nvmlProcessUtilizationInfo_v1_t
                    )
                }
                if hasattr(pynvml, "c_nvmlProcessUtilizationInfo_v1_t")
                else {}
            ),
            "nvmlGpmSampleAlloc": self._gpm_alloc,
            "nvmlGpmSampleFree": self._gpm_free,
            "nvmlGpmSampleGet": self._gpm_sample_get,
            "nvmlGpmMetricsGet": self._gpm_metrics_get,
        }
        for reading in FUNCTION_READINGS:
            assert isinstance(reading.source, Function)
            fakes.setdefault(reading.source.name, function_reading(reading.source.name))
        for kind, fn in (("compute", "GetCompute"), ("graphics", "GetGraphics")):
            for version in ("", "_v2", "_v3"):
                fakes[f"nvmlDevice{fn}RunningProcesses{version}"] = processes(kind)
        return fakes

    def _field_plan(self, h: _Handle, ids: list[Any]) -> _FieldPlan:
        """How to answer ``ids``, made once per GPU and list of requests (the agent asks for
        the same ones sample after sample): the answer's memory with every entry that never
        changes already written, and what answers each of the others."""
        key = (h.index, tuple(ids))
        plan = self._plans.get(key)
        if plan is None:
            size, ids_at = _FIELD_OFFSETS[:2]
            template = bytearray(size * len(ids))
            changing: list[tuple[int, Callable[[], tuple[int, int, int]]]] = []
            for i, request in enumerate(ids):
                field_id, scope = request if isinstance(request, tuple) else (request, 0)
                _TWO_UINTS.pack_into(template, i * size + ids_at, int(field_id), int(scope))
                answer = self._field_answer(h, field_id, scope)
                if callable(answer):
                    changing.append((i * size, answer))
                else:
                    _pack_entry(template, i * size, *answer)
            plan = _FieldPlan(bytes(template), changing)
            if len(self._plans) > 64:  # a test's odd requests must not pile up
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _field_answer(self, h: _Handle, field_id: int, scope: int) -> _EntryAnswer:
        """What answers one entry of a field-value answer: (return code, value type, value),
        or what makes it at each call when it changes."""
        gpu = h.gpu
        unsigned, ull = (
            pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
            pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
        )
        if field_id == readings.NVLINK_LINK_COUNT:
            return 0, unsigned, gpu.nvlink_links
        found = _BY_FIELD_ID.get(field_id)
        if found is None:
            return pynvml.NVML_ERROR_NOT_SUPPORTED, 0, 0
        reading, link = found
        if reading.per_link and link is None:
            link = scope
        if reading.per_link and (link is None or link >= gpu.nvlink_links):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT, 0, 0
        if reading.requires_ecc and not gpu.ecc_enabled:
            return pynvml.NVML_ERROR_NOT_SUPPORTED, 0, 0
        read = self._reader(h, reading, link)
        erring = reading.key in self.scenario.missing_fields or reading.key in gpu.unsupported
        erring = erring or any(e.field == reading.key for e in gpu.errors)
        equals, scale = reading.equals, reading.scale

        def value(number: float) -> tuple[int, int, int]:
            if equals is not None:
                return 0, ull, equals if number else 0
            return 0, ull, round(max(number, 0.0) / scale)

        if not callable(read) and not erring:
            return value(read)

        def answer() -> tuple[int, int, int]:
            if erring:
                error = self._entry_error(gpu, reading.key, self.now())
                if error:
                    return error, 0, 0
            return value(read() if callable(read) else read)

        return answer

    def _reader(
        self, h: _Handle, reading: Reading, link: int | None
    ) -> Callable[[], float] | float:
        """What reads ``reading`` (of ``link``) now, in base units: the number itself when it
        never changes."""
        gpu, key, now = h.gpu, reading.key, self.now
        if key in ("power", "power_instant"):
            return lambda: gpu.power.at(now())
        if key == "energy":
            return lambda: self._energy_joules(h)
        if key == "memory_temperature":
            return lambda: gpu.memory_temperature.at(now())
        if key in ("ecc_corrected", "ecc_aggregate_corrected") and key not in gpu.fields:
            return lambda: gpu.ecc_corrected.at(now())
        if key in ("ecc_uncorrected", "ecc_aggregate_uncorrected") and key not in gpu.fields:
            return lambda: gpu.ecc_uncorrected.at(now())
        value = gpu.fields.get(key)
        if link is not None:
            value = gpu.link_fields.get(link, {}).get(key) or value
            windows = [window for down, window in gpu.nvlink_down if down == link]
            if key == "nvlink_up" and windows:
                up = value.at if value is not None else lambda t: reading.simulated
                return lambda: 0.0 if any(w.holds(now()) for w in windows) else up(now())
        if value is None:
            return reading.simulated
        if value.constant:
            return value.base
        at = value.at
        return lambda: at(now())

    def _event_wait(self, event_set: _EventSet, timeout_ms: int) -> Any:
        """``nvmlEventSetWait_v2``: the next XID of a registered GPU since it was registered,
        blocking up to ``timeout_ms`` of real time for one (then ``Timeout``)."""
        if not isinstance(event_set, _EventSet) or event_set.freed:
            _raise("InvalidArgument")
        deadline = time.monotonic() + max(int(timeout_ms), 0) / 1000
        with self._xid_wakeup:
            while True:
                due = self._due_xid(event_set)
                if due is not None:
                    index, seq, xid = due
                    event_set.delivered.add(seq)
                    return self._event_data(index, xid)
                left = deadline - time.monotonic()
                if left <= 0:
                    _raise("Timeout")
                if self.clock is time.monotonic:  # scenario time is real time: sleep until the
                    # next XID is due (inject_xid wakes it sooner), as a real wait blocks
                    upcoming = self._next_xid(event_set)
                    if upcoming is not None:
                        left = min(left, max(upcoming - self.now(), 0.0) + 0.001)
                else:  # a test's clock: look at it now and then
                    left = min(left, _EVENT_POLL_SECONDS)
                self._xid_wakeup.wait(left)

    def _next_xid(self, event_set: _EventSet) -> float | None:
        """When (scenario time) the next XID of a registered GPU is due; None: none is."""
        t = self.now()
        upcoming = [
            at for index in event_set.registered for at, _, _ in self._xids[index] if at > t
        ]
        return min(upcoming, default=None)

    def _due_xid(self, event_set: _EventSet) -> tuple[int, int, Any] | None:
        """The earliest undelivered XID of a registered, present GPU that happened since it
        was registered and by now."""
        t = self.now()
        best: tuple[float, int, int, Any] | None = None
        for index, (since, after) in event_set.registered.items():
            if not self.scenario.gpus[index].present.holds(t):
                continue
            for at, seq, xid in self._xids[index]:
                if at > t:
                    break
                later = at > since or (at == since and seq > after)
                if later and seq not in event_set.delivered:
                    if best is None or (at, seq) < best[:2]:
                        best = (at, seq, index, xid)
                    break
        return None if best is None else (best[2], best[1], best[3])

    def _event_data(self, index: int, xid: Any) -> Any:
        data = pynvml.c_nvmlEventData_t()
        data.device = ctypes.pointer(self._devices[index])
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = xid.code
        none = 0xFFFFFFFF
        data.gpuInstanceId = none if xid.gpu_instance is None else xid.gpu_instance
        data.computeInstanceId = none if xid.compute_instance is None else xid.compute_instance
        return data

    # -- MIG --------------------------------------------------------------------------------

    def _mig_present(self, gpu: SimGpu) -> list[SimMig]:
        """The GPU's MIG devices in the layout of now."""
        t = self.now()
        return [device for device in gpu.mig_devices if device.window.holds(t)]

    def _mig_handle(self, h: _Handle, slot: int) -> _Handle:
        """``nvmlDeviceGetMigDeviceHandleByIndex``: the ``slot``-th MIG device of now."""
        if not h.gpu.mig_devices or not 0 <= slot < h.gpu.mig_slots:
            _raise("InvalidArgument")
        present = self._mig_present(h.gpu)
        if slot >= len(present):
            _raise("NotFound")  # an empty slot
        return _Handle(h.index, h.gpu, present[slot].uuid)

    def _mig_of(self, h: _Handle) -> SimMig:
        """The MIG device of a MIG handle (InvalidArgument for a GPU's handle, or a device
        that a new layout removed)."""
        for device in self._mig_present(h.gpu) if h.mig else ():
            if device.uuid == h.mig:
                return device
        _raise("InvalidArgument")
        raise AssertionError  # not reached

    def _mig_memory(self, h: _Handle) -> Any:
        device = self._mig_of(h)
        t = self.now()
        used = device.memory_used.at(t) + sum(
            max(proc.memory.at(t), 0.0) for _, proc in self._live(h) if proc.mig == device.uuid
        )
        out = pynvml.c_nvmlMemory_t()
        out.total = device.memory_total
        out.used = int(min(max(used, 0), device.memory_total))
        out.free = device.memory_total - out.used
        return out

    def _instances_of(self, h: _Handle, proc: SimProcess) -> tuple[int, int]:
        """The (GPU, compute) instance a process entry names; NVML's "none" outside MIG."""
        for device in self._mig_present(h.gpu) if proc.mig else ():
            if device.uuid == proc.mig:
                return device.gpu_instance, device.compute_instance
        return 0xFFFFFFFF, 0xFFFFFFFF

    # -- GPU Performance Monitoring ----------------------------------------------------------

    def _gpm_support(self, h: _Handle) -> Any:
        out = pynvml.c_nvmlGpmSupport_t()
        out.version = pynvml.NVML_GPM_SUPPORT_VERSION
        out.isSupportedDevice = int(h.gpu.gpm and not h.mig)
        return out

    def _gpm_alloc(self) -> Any:
        sample = pynvml.struct_c_nvmlGpmSample_t()
        self._gpm_samples[ctypes.addressof(sample)] = [sample, None, None]
        return ctypes.pointer(sample)

    def _gpm_sample(self, pointer: Any) -> list[Any]:
        """What an allocated sample holds (InvalidArgument for any other pointer)."""
        held = self._gpm_samples.get(ctypes.cast(pointer, ctypes.c_void_p).value or 0)
        if held is None:
            _raise("InvalidArgument")
        return held

    def _gpm_free(self, pointer: Any) -> None:
        self._gpm_sample(pointer)
        del self._gpm_samples[ctypes.cast(pointer, ctypes.c_void_p).value or 0]

    def _gpm_sample_get(self, h: _Handle, pointer: Any) -> Any:
        if not h.gpu.gpm:
            _raise("NotSupported")
        held = self._gpm_sample(pointer)
        held[1], held[2] = (h.index, None), self.now()
        return pointer

    def _gpm_mig_sample_get(self, h: _Handle, gpu_instance: int, pointer: Any) -> Any:
        """``nvmlGpmMigSampleGet``: a sample of one GPU instance of a GPU in MIG mode."""
        if not h.gpu.gpm:
            _raise("NotSupported")
        if not any(d.gpu_instance == gpu_instance for d in self._mig_present(h.gpu)):
            _raise("NotFound")
        held = self._gpm_sample(pointer)
        held[1], held[2] = (h.index, int(gpu_instance)), self.now()
        return pointer

    def _gpm_metrics_get(self, request: Any) -> Any:
        """``nvmlGpmMetricsGet``: pynvml's own structure, filled as the driver fills it: each
        asked metric's mean between the two samples, or its own return code."""
        if request.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            _raise("ArgumentVersionMismatch")
        count = int(request.numMetrics)
        first, second = self._gpm_sample(request.sample1), self._gpm_sample(request.sample2)
        if count > len(request.metrics) or first[1] is None or first[1] != second[1]:
            _raise("InvalidArgument")
        (index, gpu_instance), t1, t2 = second[1], first[2], second[2]
        if t2 <= t1:
            _raise("InvalidArgument")
        gpu = self.scenario.gpus[index]
        values = gpu.fields
        if gpu_instance is not None:  # a MIG GPU instance's readings
            devices = [d for d in gpu.mig_devices if d.gpu_instance == gpu_instance]
            values = devices[0].fields if devices else {}
        now = self.now()
        if not gpu.present.holds(now):
            _raise("GpuIsLost")
        self._inject(gpu.errors, "gpm", now)
        for slot in request.metrics[:count]:
            reading = _GPM_BY_ID.get(int(slot.metricId))
            code = (
                self._entry_error(gpu, reading.key, now)
                if reading is not None
                else int(pynvml.NVML_ERROR_NOT_SUPPORTED)
            )
            mean = 0.0 if code or reading is None else self._gpm_mean(values, reading, t1, t2)
            _filled(slot, nvmlReturn=code, value=mean)
        return request

    def _gpm_mean(
        self, values: Mapping[str, Value], reading: Reading, t1: float, t2: float
    ) -> float:
        """A GPM metric's mean from ``t1`` to ``t2`` (scenario time), in NVML's unit."""
        value = values.get(reading.key)
        if value is None:
            return reading.simulated / reading.scale
        if value.constant:
            return value.base / reading.scale
        points = [t1 + (t2 - t1) * k / _GPM_POINTS for k in range(_GPM_POINTS + 1)]
        return sum(value.at(t) for t in points) / len(points) / reading.scale

    def _live_processes(self, h: _Handle, kind: str | None = None) -> Iterator[tuple[int, float]]:
        t = self.now()
        for pid, proc in self._live(h, kind):
            yield pid, max(proc.memory.at(t), 0.0)

    def _live(self, h: _Handle, kind: str | None = None) -> Iterator[tuple[int, SimProcess]]:
        """The PID and entry of each process listed on ``h`` now."""
        t = self.now()
        for p, proc in enumerate(h.gpu.processes):
            if proc.window.holds(t) and (kind is None or proc.type == kind):
                if proc.holders:
                    yield from ((pid, proc) for pid in self._device_holders(h))
                    continue
                key = (h.index, p)
                pid = self._churn(h, p, proc, t) if proc.churn else self.processes.pids[key]
                leader = self.processes.leader(key)
                if leader is not None:
                    yield leader, proc
                if pid is None or (proc.spawn and not proc.churn and not running(pid)):
                    continue  # a spawned process that ended: the driver frees it, as a real one
                yield pid, proc

    def _device_holders(self, h: _Handle) -> list[int]:
        """The processes the simulation did not start that hold ``h``'s stand-in open."""
        if self._holders is None:
            return []
        ours = self.processes.started() | set(self.processes.pids.values())
        return self._holders.of(h.gpu.minor_number, ours)

    def _utilization_samples(self, h: _Handle, since: int, kind: Any) -> list[Any]:
        """What ``nvmlDeviceGetProcessUtilization(h, since)`` (``kind``: its structure) or
        ``nvmlDeviceGetProcessesUtilizationInfo`` answers: a sample for each listed process
        that was busy at one of the driver's kept sampling moments stamped after ``since``,
        with its highest percents there, stamped with its last busy moment."""
        moments = self._utilization_moments(since)
        busiest: dict[int, tuple[list[int], float]] = {}  # pid -> (percents, last busy)
        for pid, proc in self._live(h):  # a PID in both lists is one process to the driver
            values = (
                proc.sm_utilization,
                proc.memory_utilization,
                proc.encoder_utilization,
                proc.decoder_utilization,
            )
            held = [m for m in moments if proc.window.holds(m)]
            fixed = [_percent(value.base) if value.constant else None for value in values]
            if held and None not in fixed:  # the same at every moment
                held = held[-1:] if any(fixed) else []
            for m in held:
                percents = [
                    _percent(value.at(m)) if known is None else known
                    for value, known in zip(values, fixed, strict=True)
                ]
                if any(percents):
                    top, last = busiest.get(pid, ([0, 0, 0, 0], m))
                    top = [max(a, b) for a, b in zip(top, percents, strict=True)]
                    busiest[pid] = (top, max(last, m))
        samples = []
        for pid, (top, last) in busiest.items():
            sm, memory, encoder, decoder = top
            sample = _filled(
                kind(),
                pid=pid + self.scenario.utilization_pid_offset,
                smUtil=sm,
                memUtil=memory,
                encUtil=encoder,
                decUtil=decoder,
                timeStamp=self._epoch_us + round(last * 1e6),
            )
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
        return self.processes.churn((h.index, p), proc, period)


def simulate(path: str, clock: Callable[[], float] = time.monotonic) -> SimulatedDriver:
    """Load ``path`` (or ``builtin``) and start it; raises ConfigError for a bad scenario."""
    return SimulatedDriver(load_scenario(path), clock).start()
