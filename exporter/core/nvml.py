"""The only module that talks to NVML (through pynvml, or a library shaped like it).

Every call goes through :meth:`Nvml.call`, which serialises calls (concurrent NVML calls have
crashed drivers) and counts them. Functions the driver lacks and fields a GPU does not support are
remembered, so they are not retried every sample; versioned calls fall back to older versions.
The library is a parameter: pynvml by default, the simulated driver
(``exporter.simulate.driver``) under ``--simulate`` and in tests. That one has pynvml's
functions, structures and error classes, so this is the code that runs on real GPUs and in every
test alike.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import pynvml

from exporter.core import fields as readings
from exporter.core.fieldplan import VALUE_FIELDS, FieldEntry, FieldPlan, field_layout
from exporter.core.fields import (
    FIELD_READINGS,
    FUNCTION_READINGS,
    GPM_READINGS,
    Function,
)
from exporter.core.gpm import GpmState, metric_values, metrics_request
from exporter.core.procfs import in_initial_pid_namespace
from exporter.core.snapshot import (
    Gpu,
    GpuInfo,
    HostInfo,
    LinkReadings,
    MigDevice,
    Readings,
    SampleError,
    frozen_map,
)

log = logging.getLogger(__name__)

#: The GPU does not have this field (or we may not read it): remembered per GPU and field.
_UNSUPPORTED = frozenset({"NotSupported", "NoPermission"})
#: The driver lacks this function or struct version: remembered per call, the next candidate runs.
_MISSING = frozenset({"FunctionNotFound", "ArgumentVersionMismatch", "NVMLLibraryMismatchError"})
#: The GPU as a whole failed this sample.
_GPU_FATAL = frozenset({"GpuIsLost", "ResetRequired", "Unknown", "GpuNotFound", "IrqIssue"})
#: NVML as a whole is gone: shut down and initialise again.
_NVML_FATAL = frozenset(
    {"Uninitialized", "DriverNotLoaded", "LibRmVersionMismatch", "LibraryNotFound"}
)

#: (name, pynvml constant, NVML's number) of each temperature threshold; the simulation answers
#: by these too.
TEMPERATURE_THRESHOLDS = (
    ("shutdown", "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN", 0),
    ("slowdown", "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1),
    ("memory_max", "NVML_TEMPERATURE_THRESHOLD_MEM_MAX", 2),
    ("gpu_max", "NVML_TEMPERATURE_THRESHOLD_GPU_MAX", 3),
)
#: (name, NVML's clock type) of each clock read.
CLOCKS = (("graphics", 0), ("sm", 1), ("memory", 2), ("video", 3))
_PSTATE_UNKNOWN = 32
#: A field's own return code that means "this GPU or driver has no such field": NotSupported,
#: NoPermission, and InvalidArgument (what drivers older than the field answer for its id).
_FIELD_UNSUPPORTED = _UNSUPPORTED | {"InvalidArgument", "FunctionNotFound"}
#: Clocks read on the slow cadence (``core.fields.SLOW_SECONDS``): they move with the
#: performance state or the media engines, not from one second to the next.
_SLOW_CLOCKS = frozenset({"memory", "video"})
#: ``nvmlEventData_t.gpuInstanceId`` when the event is not of one MIG instance.
_NO_INSTANCE = 0xFFFFFFFF
#: What an NVML ``NotFound`` answer is, for calls that do not give it a meaning of their own.
_NOT_FOUND_IS_ERROR: Any = object()
#: Per-process utilization is read last in a GPU's sample, after every other call on the GPU has
#: answered: an ``Unknown`` from it is this call's trouble, not the GPU's.
_PROCESS_UTILIZATION_FATAL = _GPU_FATAL - {"Unknown"}
#: Neither fails the GPU: an ``Unknown`` of GPM alone is GPM's failure.
_GPM_FATAL = _GPU_FATAL - {"Unknown"}
#: How far ahead of the host's clock a remembered sample timestamp may be before it is distrusted.
_CLOCK_SLACK_SECONDS = 1.0
#: How far before a utilization read that found no busy process the next one starts: a driver
#: sample stamped just before the read may be written into its buffer just after it.
_LATE_SAMPLE_SECONDS = 1.0
#: The longest event wait ``wait_event`` allows, seconds (shutdown waits for one to end).
_EVENT_WAIT_MAX = 1.0


def error_name(exc: BaseException) -> str:
    """``GpuIsLost`` for ``NVMLError_GpuIsLost``; the class name for other exceptions."""
    name = type(exc).__name__
    if name.startswith("NVMLError_"):
        return name[len("NVMLError_") :]
    if any(cls.__name__ == "NVMLError" for cls in type(exc).__mro__):  # whichever library's
        return f"Error{getattr(exc, 'value', '')}"
    return name


def describe(exc: BaseException) -> str:
    """A one-line description of an NVML error, for logs and messages."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{error_name(exc)}: {text}" if text and text != error_name(exc) else error_name(exc)


class NvmlUnavailable(Exception):
    """NVML as a whole could not be initialised or stopped answering."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(message)
        self.error = error


class GpuFailed(Exception):
    """One GPU failed (lost, needs a reset, unknown error); the other GPUs are unaffected."""

    def __init__(self, error: str, message: str, uuid: str = "") -> None:
        super().__init__(message)
        self.error = error
        self.uuid = uuid  # when the failure came after the UUID was read


class Call(NamedTuple):
    """One way to read a field: a pynvml function, its arguments, and what to make of the result."""

    function: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None
    convert: Callable[[Any], Any] | None = None
    key: str = ""  # what "the driver lacks this" is remembered under; defaults to function
    #: The answer an NVML ``NotFound`` stands for (for example "no samples"); by default an error.
    not_found: Any = _NOT_FOUND_IS_ERROR
    #: The errors of this call that fail the whole GPU.
    gpu_fatal: frozenset[str] = _GPU_FATAL


class ProcessUtilization(NamedTuple):
    """A process's highest utilization (0-1) of the SMs, the memory interface, the encoder
    and the decoder over one period, as NVML samples it; None: unknown."""

    sm: float | None = None
    memory: float | None = None
    encoder: float | None = None
    decoder: float | None = None


#: What a listed process without a sample had: NVML samples only processes with "some
#: non-zero utilization" in the period.
IDLE = ProcessUtilization(0.0, 0.0, 0.0, 0.0)
UNKNOWN_UTILIZATION = ProcessUtilization()


class NvmlProcess(NamedTuple):
    """A process as NVML lists it on one GPU."""

    pid: int
    used_memory_bytes: int | None
    type: str
    #: Its utilization since the GPU's previous sample (each None when unknown).
    utilization: ProcessUtilization = UNKNOWN_UTILIZATION
    #: The MIG GPU and compute instance it runs on (None: not in MIG mode).
    gpu_instance: int | None = None
    compute_instance: int | None = None


#: The field-value readings with a function to read instead where the field is unsupported.
_FALLBACK_READINGS = tuple(reading for reading in FIELD_READINGS if reading.fallback is not None)


class XidArrival(NamedTuple):
    """One XID event as NVML delivered it."""

    uuid: str  # of the GPU it came from ("" when that could not be told)
    xid: int
    gpu_instance: int | None
    compute_instance: int | None


class EventsUnavailable(Exception):
    """NVML's event API failed (not supported, NVML down, a GPU without a handle)."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(message)
        self.error = error


@dataclass
class GpuReading:
    """One GPU's dynamic fields from one sample, before procfs enrichment."""

    gpu: Gpu
    processes: list[NvmlProcess] | None
    errors: list[SampleError] = field(default_factory=list)


def _instance(value: Any) -> int | None:
    """A MIG instance id of a process entry; None for NVML's "none" (0xFFFFFFFF)."""
    if value is None:
        return None
    number = int(value)
    return None if number == _NO_INSTANCE else number


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)


def _cuda_version(value: int) -> str:
    return f"{value // 1000}.{(value % 1000) // 10}"


class Nvml:
    """Serialised, counted access to NVML with memory of what the driver and GPUs lack.

    ``library``: the pynvml-shaped library to call (its functions, constants and ``NVMLError``
    classes); None for pynvml itself. ``initial_pid_namespace``: whether this process runs
    in the host's PID namespace (None: found out), which decides how per-process utilization
    samples are matched to the listed processes (see :meth:`_with_utilization`).
    """

    def __init__(
        self,
        *,
        library: Any = None,
        wall: Callable[[], float] = time.time,
        slow_seconds: float = readings.SLOW_SECONDS,
        initial_pid_namespace: bool | None = None,
    ) -> None:
        self._lib = pynvml if library is None else library
        if initial_pid_namespace is None:
            initial_pid_namespace = in_initial_pid_namespace()
        self._initial_pid_namespace = initial_pid_namespace
        #: How often the slow-cadence readings are read (0: at every sample).
        self.slow_seconds = slow_seconds
        #: The host's clock (seconds since the epoch), which NVML's sample timestamps also use.
        self._wall = wall
        self._lock = threading.Lock()
        self.calls = 0
        #: Event waits (the XID thread's ``nvmlEventSetWait_v2`` calls), counted apart.
        self.event_waits = 0
        self.initialized = False
        self._missing: set[str] = set()
        self._unsupported: set[tuple[int, str]] = set()
        self._handles: dict[int, Any] = {}
        #: Calls, and (GPU, field)s, that answered since initialisation: the driver has them and
        #: the GPU supports them, whatever a later FunctionNotFound or NotSupported says (that
        #: is then a failure of this sample, not something to remember).
        self._answered: set[str] = set()
        self._supported: set[tuple[int, str]] = set()
        #: GPU indices (-1: the host) whose static facts a transient error left incomplete.
        self.incomplete: set[int] = set()
        #: GPU UUID -> the newest per-process utilization sample seen (NVML timestamp, µs).
        self._utilization_seen: dict[str, int] = {}
        #: GPU index -> (monotonic time, wall time, values) of its last slow-cadence read.
        self._slow: dict[int, tuple[float, float, dict[str, float]]] = {}
        #: (GPU index, function) -> when an ``idle_recheck`` function last answered 0.
        self._idle: dict[tuple[int, str], float] = {}
        #: NVML initialisations so far: event sets and handles of an older one are invalid.
        self.generation = 0
        #: Held while a thread waits for an NVML event (never under ``_lock``, which would
        #: stall sampling for the whole wait); shutdown waits for the wait to end.
        self._event_lock = threading.Lock()
        #: Event device address -> GPU UUID (an event names its GPU by handle).
        self._event_devices: dict[int, str] = {}
        #: GPU index -> (its static facts, gaps known, the field values to ask for).
        self._requests: dict[int, tuple[GpuInfo, int, list[FieldEntry], list[Any]]] = {}
        #: GPU index -> how its field-value answers decode (core.fieldplan).
        self._field_plans: dict[int, FieldPlan] = {}
        #: (GPU index, MIG GPU instance or None) -> its GPM samples, request and backoff.
        self._gpm: dict[tuple[int, int | None], GpmState] = {}
        #: (GPU index, MIG device UUID) -> (GPU instance, compute instance, profile).
        self._mig_static: dict[tuple[int, str], tuple[int | None, int | None, str]] = {}

    # -- plumbing ---------------------------------------------------------------------------

    def unsupported(self) -> frozenset[tuple[int, str]]:
        """(GPU index, -1 for the host; field) pairs remembered as NotSupported since init."""
        return frozenset(self._unsupported)

    def missing(self) -> frozenset[str]:
        """The functions (call keys) this driver was found to lack since init."""
        return frozenset(self._missing)

    def call(self, function: str, *args: Any, **kwargs: Any) -> Any:
        """Call one function of the library under the NVML lock."""
        fn = getattr(self._lib, function, None)
        if fn is None:  # an older nvidia-ml-py that does not know this function
            raise self._lib.NVMLError(self._lib.NVML_ERROR_FUNCTION_NOT_FOUND)
        with self._lock:
            self.calls += 1
            return fn(*args, **kwargs)

    def _const(self, name: str, fallback: int) -> int:
        """A constant of the library; ``fallback`` when its version does not define it."""
        return getattr(self._lib, name, fallback)

    def _field_value(self, values: Any) -> float:
        """The one value of an ``nvmlDeviceGetFieldValues`` answer, raising its own error."""
        item = values[0]
        if item.nvmlReturn != 0:
            raise self._lib.NVMLError(item.nvmlReturn)
        return getattr(item.value, VALUE_FIELDS[item.valueType])

    def _read(self, index: int, name: str, errors: list[SampleError], *calls: Call) -> Any:
        """The first of ``calls`` the driver has, converted; None when absent or failed."""
        if (index, name) in self._unsupported:
            return None
        for candidate in calls:
            key = candidate.key or candidate.function
            if key in self._missing:
                continue
            try:
                value = self._answer(candidate)
                self._answered.add(key)
                self._supported.add((index, name))
                return candidate.convert(value) if candidate.convert else value
            except Exception as exc:
                error = error_name(exc)
                if error in _MISSING and key not in self._answered:
                    self._missing.add(key)
                    log.debug("driver lacks %s; trying an older call", key)
                    continue
                if error in _UNSUPPORTED and (index, name) not in self._supported:
                    self._unsupported.add((index, name))
                    log.debug("GPU %d: %s not supported (%s)", index, name, error)
                    return None
                if error in _NVML_FATAL:
                    raise NvmlUnavailable(error, f"{candidate.function}: {describe(exc)}") from exc
                if error in candidate.gpu_fatal and index >= 0:  # host-wide facts: no GPU's
                    raise GpuFailed(error, f"{candidate.function}: {describe(exc)}") from exc
                errors.append(SampleError("field", error, index, name, describe(exc)))
                return None
        self._unsupported.add((index, name))  # no call for it exists in this driver
        return None

    def _answer(self, candidate: Call) -> Any:
        """The answer of one call; ``candidate.not_found`` when it has one and NVML says
        ``NotFound``."""
        try:
            return self.call(candidate.function, *candidate.args, **(candidate.kwargs or {}))
        except self._lib.NVMLError as exc:
            if candidate.not_found is _NOT_FOUND_IS_ERROR or error_name(exc) != "NotFound":
                raise
            return candidate.not_found

    # -- library ----------------------------------------------------------------------------

    def init(self) -> HostInfo:
        """Initialise NVML and read the host's driver facts; raises NvmlUnavailable."""
        self._missing.clear()
        self._unsupported.clear()
        self._handles.clear()
        self._answered.clear()
        self._supported.clear()
        self.incomplete.clear()
        self._utilization_seen.clear()
        self._slow.clear()
        self._idle.clear()
        self._event_devices.clear()
        self._requests.clear()
        self._field_plans.clear()
        self._gpm.clear()  # the samples went with the previous initialisation
        self._mig_static.clear()
        try:
            self.call("nvmlInit")
        except Exception as exc:
            raise NvmlUnavailable(error_name(exc), describe(exc)) from exc
        self.initialized = True
        self.generation += 1
        try:
            return self.read_host()
        except NvmlUnavailable:  # lost again at once: not half initialised
            self.shutdown()
            raise

    def read_host(self) -> HostInfo:
        """The host's driver facts (after :meth:`init`); raises NvmlUnavailable."""
        errors: list[SampleError] = []
        host = -1  # host-wide facts are remembered as unsupported under this pseudo index
        cuda = self._read(
            host,
            "cuda_version",
            errors,
            Call("nvmlSystemGetCudaDriverVersion_v2", convert=_cuda_version),
            Call("nvmlSystemGetCudaDriverVersion", convert=_cuda_version),
        )
        driver = self._read(
            host, "driver_version", errors, Call("nvmlSystemGetDriverVersion", convert=_text)
        )
        nvml = self._read(
            host, "nvml_version", errors, Call("nvmlSystemGetNVMLVersion", convert=_text)
        )
        self._note_incomplete(host, errors)
        return HostInfo(
            hostname=os.uname().nodename,
            driver_version=driver or "",
            cuda_version=cuda or "",
            nvml_version=nvml or "",
        )

    def shutdown(self, timeout: float = 1.0) -> bool:
        """Shut NVML down cleanly; False when a hung call holds the lock past ``timeout``.

        An event wait in progress (at most ``wait_event``'s timeout) ends first: stop the
        thread that waits before, so that this does not wait for it."""
        if not self.initialized:
            return True
        self.initialized = False
        self._handles.clear()
        if not self._event_lock.acquire(timeout=timeout):
            log.warning("an NVML event wait is still running; not calling nvmlShutdown")
            return False
        self._event_lock.release()
        if not self._lock.acquire(timeout=timeout):
            log.warning("an NVML call is still running; not calling nvmlShutdown")
            return False
        try:
            self._free_gpm_samples()
            fn = getattr(self._lib, "nvmlShutdown", None)
            if fn is not None:
                self.calls += 1
                fn()
        except Exception as exc:
            log.debug("nvmlShutdown: %s", describe(exc))
        finally:
            self._lock.release()
        return True

    def device_count(self) -> int:
        """Number of GPUs NVML sees; raises NvmlUnavailable when NVML itself fails."""
        try:
            return int(self.call("nvmlDeviceGetCount"))
        except Exception as exc:
            raise NvmlUnavailable(error_name(exc), f"nvmlDeviceGetCount: {describe(exc)}") from exc

    def _note_incomplete(self, index: int, errors: list[SampleError]) -> None:
        """Remember whether a transient error left static facts out (the collector retries)."""
        for error in errors:
            where = f"GPU {index}" if index >= 0 else "host"
            log.info("%s: reading %s failed: %s", where, error.field, error.message)
        if errors:
            self.incomplete.add(index)
        else:
            self.incomplete.discard(index)

    # -- one GPU ----------------------------------------------------------------------------

    def _required(self, function: str, *args: Any) -> Any:
        try:
            return self.call(function, *args)
        except Exception as exc:
            error = error_name(exc)
            if error in _NVML_FATAL:
                raise NvmlUnavailable(error, f"{function}: {describe(exc)}") from exc
            raise GpuFailed(error, f"{function}: {describe(exc)}") from exc

    def read_info(self, index: int) -> GpuInfo:
        """Static facts of GPU ``index`` (read once per initialisation); raises GpuFailed."""
        self._unsupported = {key for key in self._unsupported if key[0] != index}
        self._supported = {key for key in self._supported if key[0] != index}
        self._slow.pop(index, None)
        self._idle = {key: at for key, at in self._idle.items() if key[0] != index}
        self._drop_gpm(index)
        self._mig_static = {k: v for k, v in self._mig_static.items() if k[0] != index}
        handle = self._required("nvmlDeviceGetHandleByIndex", index)
        self._handles[index] = handle
        uuid = _text(self._required("nvmlDeviceGetUUID", handle))
        try:
            return self._read_static(index, handle, uuid)
        except GpuFailed as exc:
            exc.uuid = uuid
            raise

    def _read_static(self, index: int, handle: Any, uuid: str) -> GpuInfo:
        errors: list[SampleError] = []
        thresholds = {}
        for name, const, fallback in TEMPERATURE_THRESHOLDS:
            value = self._read(
                index,
                f"threshold_{name}",
                errors,
                Call("nvmlDeviceGetTemperatureThreshold", (handle, self._const(const, fallback))),
            )
            if value is not None:
                thresholds[name] = float(value)
        memory = self._read_memory(index, handle, errors)
        ecc = self._read(index, "ecc_mode", errors, Call("nvmlDeviceGetEccMode", (handle,)))
        power_limit = self._read(
            index, "power_limit", errors, Call("nvmlDeviceGetEnforcedPowerLimit", (handle,))
        )
        pci = self._read(index, "pci_info", errors, Call("nvmlDeviceGetPciInfo", (handle,)))
        minor = self._read(
            index, "minor_number", errors, Call("nvmlDeviceGetMinorNumber", (handle,))
        )
        serial = self._read(
            index, "serial", errors, Call("nvmlDeviceGetSerial", (handle,), convert=_text)
        )
        name = _text(self._required("nvmlDeviceGetName", handle))
        mig_uuids, mig_slots = self._read_mig(index, handle, errors)
        gpm = self._read_gpm_support(index, handle, errors)
        static = self._read_functions(index, handle, errors, "static")
        links = self._read(
            index,
            "nvlink_links",
            errors,
            Call(
                "nvmlDeviceGetFieldValues",
                (handle, [readings.NVLINK_LINK_COUNT]),
                convert=self._field_value,
                key="nvmlDeviceGetFieldValues",
            ),
        )
        self._note_incomplete(index, errors)
        return GpuInfo(
            index=index,
            uuid=uuid,
            name=name,
            pci_bus_id=_text(pci.busId) if pci is not None else "",
            serial=serial or "",
            minor_number=int(minor) if minor is not None else None,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            temperature_thresholds=frozen_map(thresholds),
            power_limit_watts=power_limit / 1000.0 if power_limit is not None else None,
            ecc_enabled=bool(ecc[0]) if ecc is not None else None,
            mig_uuids=mig_uuids,
            mig_slots=mig_slots,
            gpm_supported=gpm,
            fields=Readings(static),
            nvlink_links=int(links) if links else 0,
        )

    def _read_mig(
        self, index: int, handle: Any, errors: list[SampleError]
    ) -> tuple[tuple[str, ...], int]:
        """UUIDs of the GPU's MIG devices and its number of MIG device slots; none when MIG is
        off or not supported."""
        mode = self._read(index, "mig_mode", errors, Call("nvmlDeviceGetMigMode", (handle,)))
        if not mode or not mode[0]:
            return (), 0
        count = self._read(
            index, "mig_count", errors, Call("nvmlDeviceGetMaxMigDeviceCount", (handle,))
        )
        found = [uuid for _, uuid in self._mig_handles(index, handle, int(count or 0), errors)]
        return tuple(found), int(count or 0)

    def _mig_handles(
        self, index: int, handle: Any, slots: int, errors: list[SampleError]
    ) -> list[tuple[Any, str]]:
        """(handle, UUID) of each MIG device in the GPU's ``slots`` (2 calls a device, 1 an
        empty slot)."""
        found = []
        for slot in range(slots):
            try:
                mig = self.call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
                found.append((mig, _text(self.call("nvmlDeviceGetUUID", mig))))
            except Exception as exc:
                error = error_name(exc)
                if error in _GPU_FATAL | _NVML_FATAL:
                    raise GpuFailed(error, f"MIG device {slot}: {describe(exc)}") from exc
                if error not in _MISSING | _UNSUPPORTED | {"NotFound"}:  # NotFound: an empty slot
                    errors.append(SampleError("field", error, index, "mig_devices", describe(exc)))
        return found

    def _read_mig_devices(
        self, info: GpuInfo, handle: Any, errors: list[SampleError], now: float | None
    ) -> tuple[MigDevice, ...]:
        """The GPU's MIG devices as they are now (a new layout is seen at the next sample):
        their instances and profile (read once per device), memory, and GPM per GPU instance
        where the GPU has GPM."""
        index = info.index
        devices = []
        seen = set()
        for mig, uuid in self._mig_handles(index, handle, info.mig_slots, errors):
            seen.add(uuid)
            static = self._mig_static.get((index, uuid))
            if static is None:
                static = self._mig_static[(index, uuid)] = self._read_mig_static(index, mig, errors)
            memory = self._read(
                index, f"mig_memory@{uuid}", errors, Call("nvmlDeviceGetMemoryInfo", (mig,))
            )
            devices.append(
                MigDevice(
                    uuid=uuid,
                    gpu_instance=static[0],
                    compute_instance=static[1],
                    profile=static[2],
                    memory_total_bytes=int(memory.total) if memory is not None else None,
                    memory_used_bytes=int(memory.used) if memory is not None else None,
                    memory_free_bytes=int(memory.free) if memory is not None else None,
                )
            )
        self._mig_static = {
            k: v for k, v in self._mig_static.items() if k[0] != index or k[1] in seen
        }
        instances = {d.gpu_instance for d in devices if d.gpu_instance is not None}
        self._drop_gpm(index, keep={None, *instances})  # instances that were re-partitioned
        if not info.gpm_supported:
            return tuple(devices)
        gpm: dict[int | None, dict[str, float]] = {
            gi: self._read_gpm(index, handle, errors, now, gi) for gi in sorted(instances)
        }
        return tuple(
            replace(d, fields=Readings(gpm[d.gpu_instance])) if gpm.get(d.gpu_instance) else d
            for d in devices
        )

    def _read_mig_static(
        self, index: int, mig: Any, errors: list[SampleError]
    ) -> tuple[int | None, int | None, str]:
        """A MIG device's GPU instance, compute instance and profile (``1g.10gb``: its name
        after "MIG", as nvidia-smi shows it)."""
        values: list[int | None] = []
        for function in ("nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId"):
            try:
                values.append(int(self.call(function, mig)))
            except Exception as exc:
                if error_name(exc) in _GPU_FATAL | _NVML_FATAL:
                    raise GpuFailed(error_name(exc), f"{function}: {describe(exc)}") from exc
                values.append(None)
        try:
            name = _text(self.call("nvmlDeviceGetName", mig))
        except Exception as exc:
            errors.append(SampleError("field", error_name(exc), index, "mig_name", describe(exc)))
            name = ""
        return values[0], values[1], name.rpartition(" MIG ")[2] if " MIG " in name else name

    def _read_memory(self, index: int, handle: Any, errors: list[SampleError]) -> Any:
        calls = [Call("nvmlDeviceGetMemoryInfo", (handle,))]
        version = getattr(self._lib, "nvmlMemory_v2", None)
        if version is not None:  # v2 does not count reserved memory as used (R510+)
            calls.insert(
                0,
                Call(
                    "nvmlDeviceGetMemoryInfo",
                    (handle,),
                    {"version": version},
                    key="nvmlDeviceGetMemoryInfo_v2",
                ),
            )
        return self._read(index, "memory", errors, *calls)

    def read_gpu(self, info: GpuInfo, now: float | None = None) -> GpuReading:
        """Dynamic fields and NVML's process list of one GPU; raises GpuFailed/NvmlUnavailable.

        ``now`` (monotonic seconds) decides whether the slow-cadence readings are due."""
        index = info.index
        handle = self._handles.get(index)
        if handle is None:
            raise GpuFailed("NoHandle", f"GPU {index} has no handle; static facts not read")
        errors: list[SampleError] = []

        def read(name: str, *calls: Call) -> Any:
            return self._read(index, name, errors, *calls)

        memory = self._read_memory(index, handle, errors)
        util = read("utilization", Call("nvmlDeviceGetUtilizationRates", (handle,)))
        sensor = self._const("NVML_TEMPERATURE_GPU", 0)
        temperature = read(
            "temperature",
            Call("nvmlDeviceGetTemperatureV", (handle, sensor)),
            Call("nvmlDeviceGetTemperature", (handle, sensor)),
        )
        values, links = self._read_field_values(info, handle, errors)
        at = time.monotonic() if now is None else now
        values.update(self._read_functions(index, handle, errors, "sample", at))
        if info.gpm_supported:
            values.update(self._read_gpm(index, handle, errors, now))
        clocks = {}
        for name, clock_type in CLOCKS:
            if name in _SLOW_CLOCKS:
                continue
            value = read(f"clock_{name}", Call("nvmlDeviceGetClockInfo", (handle, clock_type)))
            if value is not None:
                clocks[name] = float(value) * 1e6
        slow_at, slow = self._read_slow(index, handle, errors, at)
        values.update((k, v) for k, v in slow.items() if k in readings.BY_KEY)
        clocks.update((k[len("clock_") :], v) for k, v in slow.items() if k.startswith("clock_"))
        pstate = read("performance_state", Call("nvmlDeviceGetPerformanceState", (handle,)))
        reasons = read(
            "clock_event_reasons",
            Call("nvmlDeviceGetCurrentClocksEventReasons", (handle,)),
            Call("nvmlDeviceGetCurrentClocksThrottleReasons", (handle,)),
        )
        mig_devices = self._read_mig_devices(info, handle, errors, now) if info.mig_slots else ()
        processes = self._read_processes(index, handle, errors)
        if processes and not info.mig_slots:  # NVML has no per-process utilization in MIG mode
            processes = self._with_utilization(info, handle, processes, errors)
        gpu = Gpu(
            index=index,
            uuid=info.uuid,
            up=True,
            info=info,
            memory_used_bytes=int(memory.used) if memory is not None else None,
            memory_free_bytes=int(memory.free) if memory is not None else None,
            memory_reserved_bytes=int(memory.reserved) if hasattr(memory, "reserved") else None,
            utilization_ratio=util.gpu / 100.0 if util is not None else None,
            memory_utilization_ratio=util.memory / 100.0 if util is not None else None,
            temperature_celsius=float(temperature) if temperature is not None else None,
            fan_speed_ratio=slow.get("fan_speed"),
            clocks_hz=frozen_map({name: clocks[name] for name, _ in CLOCKS if name in clocks}),
            performance_state=(
                int(pstate) if pstate is not None and pstate != _PSTATE_UNKNOWN else None
            ),
            clock_event_reasons=int(reasons) if reasons is not None else None,
            fields=Readings(values),
            nvlink=links if isinstance(links, LinkReadings) else LinkReadings(links),
            slow_read_at=slow_at,
            mig_devices=mig_devices,
        )
        return GpuReading(gpu, processes, errors)

    # -- GPU Performance Monitoring (core.gpm) ---------------------------------------------

    def _read_gpm_support(self, index: int, handle: Any, errors: list[SampleError]) -> bool | None:
        """Whether the GPU has GPM: False where the driver or the GPU says no (or lacks the
        query), None when the query failed."""
        failed_before = len(errors)
        answer = self._read(
            index, "gpm_support", errors, Call("nvmlGpmQueryDeviceSupport", (handle,))
        )
        if answer is None:
            return None if len(errors) > failed_before else False
        return bool(answer.isSupportedDevice)

    def _read_gpm(
        self,
        index: int,
        handle: Any,
        errors: list[SampleError],
        now: float | None,
        gpu_instance: int | None = None,
    ) -> dict[str, float]:
        """The GPM readings between this sample and the previous one (two calls) of the GPU,
        or of one of its MIG GPU instances: none at the first sample, while the counters are
        busy, or when a call failed."""
        now = time.monotonic() if now is None else now
        key = (index, gpu_instance)
        state = self._gpm.get(key) or self._start_gpm(key, errors)
        if state is None:
            return {}
        where = "gpm" if gpu_instance is None else f"gpm@gi{gpu_instance}"
        if now < state.busy_until:
            message = f"GPM counters busy; next try in {state.busy_until - now:.0f}s"
            errors.append(SampleError("field", "InUse", index, where, message))
            return {}
        failed_before = len(errors)
        take = (
            Call("nvmlGpmSampleGet", (handle, state.samples[1]), gpu_fatal=_GPM_FATAL)
            if gpu_instance is None
            else Call(
                "nvmlGpmMigSampleGet",
                (handle, gpu_instance, state.samples[1]),
                gpu_fatal=_GPM_FATAL,
            )
        )
        if self._read(index, where, errors, take) is None:
            self._gpm_failed(state, index, errors[failed_before:], now)
            return {}
        if state.answered():
            log.info("GPU %d: the GPM counters answer again", index)
        if not state.have_previous:  # nothing to compare with yet: no values, not zeros
            state.swap()
            return {}
        request = state.request
        request.sample1, request.sample2 = state.samples[0], state.samples[1]
        state.swap()
        answer = self._read(
            index,
            where,
            errors,
            Call("nvmlGpmMetricsGet", (request,), gpu_fatal=_GPM_FATAL),
        )
        if answer is None:
            self._gpm_failed(state, index, errors[failed_before:], now)
            return {}
        values, failed = metric_values(request, state.asked)
        for reading_key, code in failed.items():
            error = error_name(self._lib.NVMLError(code))
            if error in _UNSUPPORTED:
                state.unsupported.add(reading_key)
                log.debug("GPU %d: GPM metric %s not supported", index, reading_key)
            else:
                errors.append(SampleError("field", error, index, reading_key, f"GPM: {error}"))
        if state.unsupported & {r.key for r in state.asked}:
            state.request, state.asked = metrics_request(
                self._lib, [r for r in GPM_READINGS if r.key not in state.unsupported]
            )
        return values

    def _start_gpm(self, key: tuple[int, int | None], errors: list[SampleError]) -> GpmState | None:
        """The GPM state of a GPU (or of one of its GPU instances) with its two samples; None
        when they cannot be had."""
        index = key[0]
        if (index, "gpm") in self._unsupported:
            return None
        samples: list[Any] = []
        for _ in range(2):
            sample = self._read(index, "gpm_alloc", errors, Call("nvmlGpmSampleAlloc"))
            if sample is None:
                self._free_samples(samples)
                return None
            samples.append(sample)
        try:
            request, asked = metrics_request(self._lib, GPM_READINGS)
        except AttributeError:  # an nvidia-ml-py without GPM's structures
            self._free_samples(samples)
            self._unsupported.add((index, "gpm"))
            return None
        state = self._gpm[key] = GpmState(samples, request, asked)
        return state

    def _gpm_failed(
        self, state: GpmState, index: int, failures: list[SampleError], now: float
    ) -> None:
        """After a failed GPM call: busy counters wait out a backoff; other errors leave the
        previous sample to compare with."""
        if any(failure.error == "InUse" for failure in failures):
            first = state.busy_retry == 0
            wait = state.busy(now)
            if first:
                log.warning(
                    "GPU %d: the GPM counters are busy (another profiler?); GPM metrics are "
                    "absent, next try in %.0fs",
                    index,
                    wait,
                )

    def _drop_gpm(self, index: int, keep: Collection[int | None] | None = None) -> None:
        """Free the GPM states of GPU ``index`` (but those of the GPU instances in ``keep``)."""
        for key in [k for k in self._gpm if k[0] == index]:
            if keep is None or key[1] not in keep:
                self._free_samples(self._gpm.pop(key).samples)

    def _free_samples(self, samples: list[Any], *, locked: bool = False) -> None:
        """Free GPM sample buffers; ``locked``: the caller holds the NVML lock (shutdown)."""
        free = getattr(self._lib, "nvmlGpmSampleFree", None)
        for sample in samples:
            try:
                if not locked:
                    self.call("nvmlGpmSampleFree", sample)
                elif free is not None:
                    self.calls += 1
                    free(sample)
            except Exception as exc:
                log.debug("nvmlGpmSampleFree: %s", describe(exc))

    def _free_gpm_samples(self) -> None:
        """Free every GPM sample, under the NVML lock (held by the caller: shutdown)."""
        for state in self._gpm.values():
            self._free_samples(state.samples, locked=True)
        self._gpm.clear()

    # -- readings declared in core.fields -----------------------------------------------------

    def _read_field_values(
        self, info: GpuInfo, handle: Any, errors: list[SampleError]
    ) -> tuple[dict[str, float], LinkReadings | dict[int, dict[str, float]]]:
        """Every field-value reading of the GPU in one ``nvmlDeviceGetFieldValues`` call, each
        entry with its own return code; then the fallbacks of the unsupported ones."""
        index = info.index
        entries, requests = self._field_requests(info)
        values: dict[str, float] = {}
        linked: dict[int, dict[str, float]] = {}
        links: LinkReadings | dict[int, dict[str, float]] = linked
        answer = None
        if requests:
            answer = self._read(
                index,
                "field_values",
                errors,
                Call("nvmlDeviceGetFieldValues", (handle, requests)),
            )
        planned = self._planned(index, entries, answer) if answer is not None else None
        if planned is not None:
            values, links = planned
        elif answer is not None:
            supported = self._supported
            decoded_entries = self._field_entries(answer)
            for (reading, link, gap), (code, number) in zip(entries, decoded_entries, strict=False):
                if code == 0 and number is not None:  # the common case, inline: 1000s a sample
                    supported.add(gap)
                    value = number
                else:
                    entry = self._field_entry(gap, code, number, errors)
                    if entry is None:
                        continue
                    value = entry
                if reading.equals is not None:
                    value = 1.0 if value == reading.equals else 0.0
                value *= reading.scale
                if link is None:
                    values[reading.key] = value
                else:
                    linked.setdefault(link, {})[reading.key] = value
            self._plan_fields(index, entries, answer, decoded_entries)
        for reading in _FALLBACK_READINGS:
            fallback = reading.fallback
            unsupported = (index, reading.key) in self._unsupported or (
                index,
                "field_values",
            ) in self._unsupported
            if fallback is not None and unsupported:
                value = self._read(index, fallback.name, errors, Call(fallback.name, (handle,)))
                if value is not None:
                    values[reading.key] = _item(value, fallback.item) * reading.scale
        return values, links

    def _planned(
        self, index: int, entries: list[FieldEntry], answer: Any
    ) -> tuple[dict[str, float], LinkReadings] | None:
        """The readings of ``answer`` by the GPU's plan; None: no plan for ``entries`` yet, or
        an answer the plan does not fit (decoded entry by entry then)."""
        plan = self._field_plans.get(index)
        if plan is None or plan.entries is not entries:
            return None
        try:
            raw = memoryview(answer).cast("B")
        except TypeError:  # not a ctypes array
            return None
        return plan.decode(raw)

    def _plan_fields(
        self,
        index: int,
        entries: list[FieldEntry],
        answer: Any,
        decoded: list[tuple[int, float | None]],
    ) -> None:
        """Make the GPU's plan from an answer decoded entry by entry, when it had no error and
        every value of a known type (else the next answer is decoded entry by entry too)."""
        if len(decoded) != len(entries) or any(
            code != 0 or number is None for code, number in decoded
        ):
            return
        try:
            raw = memoryview(answer).cast("B")
        except TypeError:
            return
        self._field_plans[index] = FieldPlan(entries, raw, self._lib.c_nvmlFieldValue_t)

    def _field_requests(self, info: GpuInfo) -> tuple[list[FieldEntry], list[Any]]:
        """The field values to ask the GPU for: (reading, link, its key among the gaps) of
        each, and the request itself (an id, or an (id, link) pair for a field scoped by
        link); remembered gaps left out. Made again only when a gap was found or the static
        facts were read again."""
        cached = self._requests.get(info.index)
        if cached is not None and cached[0] is info and cached[1] == len(self._unsupported):
            return cached[2], cached[3]
        index, gaps = info.index, self._unsupported
        entries: list[FieldEntry] = []
        requests: list[Any] = []
        for reading in FIELD_READINGS:
            if reading.requires_ecc and not info.ecc_enabled:
                continue
            if not reading.per_link:
                if (index, reading.key) not in gaps:
                    entries.append((reading, None, (index, reading.key)))
                    requests.append(reading.field_id(None))
                continue
            for link in range(info.nvlink_links):
                field_id, gap = reading.field_id(link), (index, f"{reading.key}@{link}")
                if field_id is None or gap in gaps:
                    continue
                entries.append((reading, link, gap))
                requests.append(field_id if reading.link_ids else (field_id, link))
        self._requests[info.index] = (info, len(gaps), entries, requests)
        return entries, requests

    def _field_entries(self, answer: Any) -> list[tuple[int, float | None]]:
        """(return code, value) of each entry of a field-value answer: read from the ctypes
        array's memory at the offsets pynvml's ``c_nvmlFieldValue_t`` declares (attribute access
        through pynvml's structure classes costs a Python call per member; an answer holds a
        hundred entries and more). The value is None when its type is unknown."""
        layout = field_layout(self._lib.c_nvmlFieldValue_t)
        try:
            raw = memoryview(answer).cast("B")
        except TypeError:  # not a ctypes array: one entry at a time
            return [_field_item(item) for item in answer]
        size, head_at, head, value_at, decoders = layout
        out = []
        for base in range(0, len(raw), size):
            kind, code = head.unpack_from(raw, base + head_at)
            decoder = decoders.get(kind)
            number = decoder.unpack_from(raw, base + value_at)[0] if decoder else None
            out.append((code, None if number is None else float(number)))
        return out

    def _field_entry(
        self, gap: tuple[int, str], code: int, number: float | None, errors: list[SampleError]
    ) -> float | None:
        """The value of one entry of a field-value answer (``gap``: its GPU and name); None
        (remembered, or counted as an error of this sample) when the entry has an error of its
        own."""
        if code == 0:
            if number is not None:
                self._supported.add(gap)
                return number
            exc: BaseException = ValueError("unknown value type")
        else:
            exc = self._lib.NVMLError(code)
        error = error_name(exc)
        index, name = gap
        if error in _FIELD_UNSUPPORTED and gap not in self._supported:
            self._unsupported.add(gap)
            log.debug("GPU %d: field %s not supported (%s)", index, name, error)
        else:
            errors.append(SampleError("field", error, index, name, describe(exc)))
        return None

    def _read_functions(
        self, index: int, handle: Any, errors: list[SampleError], cadence: str, now: float = 0.0
    ) -> dict[str, float]:
        """The function readings of ``cadence``: each function called once, however many
        readings share its answer. An ``idle_recheck`` one that answered 0 less than
        ``IDLE_RECHECK_SECONDS`` before ``now`` (monotonic) is 0 without a call."""
        values: dict[str, float] = {}
        answers: dict[str, Any] = {}
        for reading in FUNCTION_READINGS:
            if reading.cadence != cadence:
                continue
            source = reading.source
            assert isinstance(source, Function)
            idle_since = self._idle.get((index, source.name)) if reading.idle_recheck else None
            if idle_since is not None and now - idle_since < readings.IDLE_RECHECK_SECONDS:
                values[reading.key] = 0.0
                continue
            if source.name not in answers:
                answers[source.name] = self._read(
                    index, source.name, errors, Call(source.name, (handle,))
                )
            answer = answers[source.name]
            if answer is not None:
                values[reading.key] = _item(answer, source.item) * reading.scale
            if reading.idle_recheck:
                if answer is not None and values[reading.key] == 0:
                    self._idle[(index, source.name)] = now
                else:
                    self._idle.pop((index, source.name), None)
        return values

    def _read_slow(
        self, index: int, handle: Any, errors: list[SampleError], now: float
    ) -> tuple[float | None, dict[str, float]]:
        """The slow-cadence readings (and the fan, memory and video clocks): read again when
        ``slow_seconds`` have passed since the last complete read, else the last values.
        Returns when they were read (wall clock) and the values."""
        last = self._slow.get(index)
        if last is not None and now - last[0] < self.slow_seconds - 1e-6:
            return last[1], last[2]
        failed_before = len(errors)
        values = self._read_functions(index, handle, errors, "slow")
        fan = self._read(index, "fan_speed", errors, Call("nvmlDeviceGetFanSpeed", (handle,)))
        if fan is not None:
            values["fan_speed"] = fan / 100.0
        for name, clock_type in CLOCKS:
            if name in _SLOW_CLOCKS:
                value = self._read(
                    index,
                    f"clock_{name}",
                    errors,
                    Call("nvmlDeviceGetClockInfo", (handle, clock_type)),
                )
                if value is not None:
                    values[f"clock_{name}"] = float(value) * 1e6
        wall = self._wall()
        if len(errors) == failed_before:
            self._slow[index] = (now, wall, values)
        else:  # what failed is absent now, as any failed field, and all is read again next time
            self._slow.pop(index, None)
        return wall, values

    # -- XID events ---------------------------------------------------------------------------

    def create_event_set(self) -> Any:
        """A new NVML event set; raises EventsUnavailable."""
        try:
            return self.call("nvmlEventSetCreate")
        except Exception as exc:
            raise EventsUnavailable(error_name(exc), describe(exc)) from exc

    def register_xid_events(self, event_set: Any, index: int) -> bool:
        """Register GPU ``index`` in ``event_set`` for XID events: True when registered,
        False when its driver does not deliver them; raises EventsUnavailable otherwise."""
        handle = self._handles.get(index)
        if handle is None:
            raise EventsUnavailable("NoHandle", f"GPU {index} has no handle")
        xid = self._const("nvmlEventTypeXidCriticalError", 0x8)
        try:
            self.call("nvmlDeviceRegisterEvents", handle, xid, event_set)
            return True
        except Exception as exc:
            if error_name(exc) in _FIELD_UNSUPPORTED:
                return False
            raise EventsUnavailable(error_name(exc), describe(exc)) from exc

    def wait_event(self, event_set: Any, timeout_ms: int) -> XidArrival | None:
        """The next XID of ``event_set``, waiting at most ``timeout_ms`` (None: none came, or
        the event was of another kind). Waits outside the NVML lock, so sampling goes on;
        raises EventsUnavailable for any other error."""
        timeout_ms = max(0, min(timeout_ms, int(_EVENT_WAIT_MAX * 1000)))
        fn = getattr(self._lib, "nvmlEventSetWait_v2", None)
        if fn is None:
            raise EventsUnavailable("FunctionNotFound", "nvmlEventSetWait_v2 is missing")
        with self._event_lock:
            if not self.initialized:
                raise EventsUnavailable("Uninitialized", "NVML is not initialised")
            try:
                self.event_waits += 1  # not in ``calls``: those are the samples' own
                data = fn(event_set, timeout_ms)
            except Exception as exc:
                if error_name(exc) == "Timeout":
                    return None
                raise EventsUnavailable(error_name(exc), describe(exc)) from exc
        if not int(data.eventType) & self._const("nvmlEventTypeXidCriticalError", 0x8):
            return None
        uuid = self._event_uuid(data.device)
        gpu_instance, compute_instance = int(data.gpuInstanceId), int(data.computeInstanceId)
        return XidArrival(
            uuid,
            int(data.eventData),
            None if gpu_instance == _NO_INSTANCE else gpu_instance,
            None if compute_instance == _NO_INSTANCE else compute_instance,
        )

    def free_event_set(self, event_set: Any) -> None:
        """Free an event set (errors are logged: there is nothing else to do with them)."""
        try:
            self.call("nvmlEventSetFree", event_set)
        except Exception as exc:
            log.debug("nvmlEventSetFree: %s", describe(exc))

    def _event_uuid(self, device: Any) -> str:
        """The UUID of an event's device ("" when it cannot be told): asked once per handle."""
        address = ctypes.cast(device, ctypes.c_void_p).value or 0
        uuid = self._event_devices.get(address)
        if uuid is None:
            try:
                uuid = _text(self.call("nvmlDeviceGetUUID", device))
            except Exception as exc:
                log.warning("an XID came from a GPU whose UUID cannot be read: %s", describe(exc))
                return ""
            self._event_devices[address] = uuid
        return uuid

    def _read_processes(
        self, index: int, handle: Any, errors: list[SampleError]
    ) -> list[NvmlProcess] | None:
        found: list[NvmlProcess] = []
        known = False
        failed_before = len(errors)
        for kind, base in (
            ("compute", "nvmlDeviceGetComputeRunningProcesses"),
            ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
        ):
            listed: Sequence[Any] | None = self._read(
                index,
                f"{kind}_processes",
                errors,
                Call(f"{base}_v3", (handle,)),
                Call(f"{base}_v2", (handle,)),
            )
            if listed is None:
                continue
            known = True
            for proc in listed:
                used = getattr(proc, "usedGpuMemory", None)
                found.append(
                    NvmlProcess(
                        int(proc.pid),
                        int(used) if used is not None else None,
                        kind,
                        UNKNOWN_UTILIZATION,
                        _instance(getattr(proc, "gpuInstanceId", None)),
                        _instance(getattr(proc, "computeInstanceId", None)),
                    )
                )
        if len(errors) > failed_before:  # one list failed: the other alone would be short
            return None
        return found if known else None

    def _with_utilization(
        self, info: GpuInfo, handle: Any, processes: list[NvmlProcess], errors: list[SampleError]
    ) -> list[NvmlProcess]:
        """``processes`` with their utilization since this GPU's previous read (one call:
        ``nvmlDeviceGetProcessesUtilizationInfo``, or ``nvmlDeviceGetProcessUtilization`` on
        drivers without it).

        NVML samples only the processes that had some non-zero utilization in the period, and
        answers ``NotFound`` when none had: a listed process without a sample reads 0 (idle).
        Unsupported, failed or invalid: None.

        Outside the host's PID namespace (a container, a pod's sidecar), drivers list processes
        by their PIDs in the caller's namespace but may stamp utilization samples with host
        PIDs (seen with R560). There, a sample whose PID matches no listed process means the
        two may not be comparable: processes without a sample get None (unknown), not 0,
        which would read as idle.
        """
        since = self._utilization_since(info)
        asked_at = round((self._wall() - _LATE_SAMPLE_SECONDS) * 1e6)
        calls = [
            Call(function, (handle, since), not_found=(), gpu_fatal=_PROCESS_UTILIZATION_FATAL)
            for function in (
                "nvmlDeviceGetProcessesUtilizationInfo",
                "nvmlDeviceGetProcessUtilization",
            )
        ]
        samples: Sequence[Any] | None = self._read(
            info.index, "process_utilization", errors, *calls
        )
        if samples is None:
            return processes
        peaks, newest = utilization_peaks(samples, since)
        # Nothing newer: the next read need not ask for the driver's whole buffer again.
        self._utilization_seen[info.uuid] = newest if newest > since else max(since, asked_at)
        absent = IDLE
        if not self._initial_pid_namespace and set(peaks) - {p.pid for p in processes}:
            absent = UNKNOWN_UTILIZATION
        return [  # made anew, not _replace()d: that costs a microsecond a process
            NvmlProcess(pid, used, kind, peaks.get(pid, absent), gpu_instance, compute_instance)
            for pid, used, kind, _, gpu_instance, compute_instance in processes
        ]

    def _utilization_since(self, info: GpuInfo) -> int:
        """Where the GPU's next utilization read starts (µs): after the newest sample seen, or
        shortly before the previous read when that one found no newer sample; 0 (the driver's
        whole buffer) at first, or when that mark is ahead of the host's clock (the clock was
        set back: nothing newer would come for that long)."""
        seen = self._utilization_seen.get(info.uuid, 0)
        if seen > (self._wall() + _CLOCK_SLACK_SECONDS) * 1e6:
            log.info(
                "GPU %d: process utilization stamped ahead of the clock; reading anew", info.index
            )
            return 0
        return seen


def _field_item(item: Any) -> tuple[int, float | None]:
    """(return code, value) of one ``c_nvmlFieldValue_t``, member by member."""
    kind = int(item.valueType)
    name = VALUE_FIELDS[kind] if 0 <= kind < len(VALUE_FIELDS) else ""
    value = getattr(item.value, name, None) if name else None
    return int(item.nvmlReturn), None if value is None else float(value)


def _item(answer: Any, item: int | None) -> float:
    """``answer`` as a number, or its element ``item`` when it is a list."""
    return float(answer[item] if item is not None else answer)


def utilization_peaks(
    samples: Sequence[Any], since: int
) -> tuple[dict[int, ProcessUtilization], int]:
    """Per PID, the highest utilization (0-1) of ``samples`` newer than ``since`` of the SMs,
    the memory, the encoder and the decoder, and the newest timestamp among them (``since``
    when none).

    Older samples (and unwritten, zeroed slots) are left out. A sample with a value over 100
    is garbage that some drivers report: left out too (its time stamp is not trusted either),
    and a PID with nothing else is None (unknown).
    """
    peaks: dict[int, list[float | None]] = {}
    newest = since
    for sample in samples:
        stamp, pid = int(sample.timeStamp), int(sample.pid)
        if stamp <= since:
            continue
        known = peaks.setdefault(pid, [None, None, None, None])
        raw = (int(sample.smUtil), int(sample.memUtil), int(sample.encUtil), int(sample.decUtil))
        if any(value > 100 for value in raw):  # garbage: its values and its time stamp
            continue
        newest = max(newest, stamp)
        for slot, value in enumerate(raw):
            previous = known[slot]
            known[slot] = value / 100 if previous is None else max(previous, value / 100)
    return {pid: ProcessUtilization(*values) for pid, values in peaks.items()}, newest
