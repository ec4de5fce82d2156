"""Immutable result of one sample: the host, its GPUs, their processes, and what went wrong.

Everything downstream (metrics, /snapshot, status, actions) reads these objects and nothing else.
A field that the GPU does not support, or that failed this sample, is ``None``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from exporter.core.xid import XidEvent

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D", bound="_FromDict")
_EMPTY: Mapping[Any, Any] = MappingProxyType({})

#: Clock-event (throttle) reason bits, as NVML defines them; names are the metric's ``reason``.
CLOCK_EVENT_REASONS: tuple[tuple[str, int], ...] = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)

#: The clock-event reasons that mean heat.
THERMAL_CLOCK_EVENTS = ("sw_thermal_slowdown", "hw_thermal_slowdown")


def frozen_map(values: Mapping[K, V] | None) -> Mapping[K, V]:
    """A read-only copy of ``values`` (the Snapshot's maps must not change after publication)."""
    return MappingProxyType(dict(values)) if values else _EMPTY


@functools.lru_cache(maxsize=512)
def _layout(keys: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[Any, int]]:
    """One shared key tuple and index for every map with these keys (a GPU reads the same
    keys sample after sample: the history holds one copy of them)."""
    return keys, {key: i for i, key in enumerate(keys)}


class Readings(Mapping[Any, float]):
    """A read-only map of numbers kept compact: the keys are shared between the maps with the
    same keys, the values are one array of doubles (8 bytes each, where a dict of floats costs
    over 100). The sampler's history holds some hundred of these per GPU."""

    __slots__ = ("_index", "_keys", "_values")

    def __init__(self, items: Mapping[Any, float] | Iterable[tuple[Any, float]] = ()) -> None:
        pairs = dict(items)
        self._keys, self._index = _layout(tuple(pairs))
        self._values = array("d", pairs.values())

    @classmethod
    def of(cls, keys: tuple[Any, ...], values: Iterable[float]) -> Readings:
        """The readings of ``keys`` (distinct) and ``values``, in that order, made without a
        dict: the sampler's way, every sample."""
        self = cls.__new__(cls)
        self._keys, self._index = _layout(keys)
        self._values = array("d", values)
        return self

    def __getitem__(self, key: Any) -> float:
        return self._values[self._index[key]]

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[Any]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def pairs(self) -> Iterator[tuple[Any, float]]:
        """(key, value) of each reading, faster than ``items()``."""
        return zip(self._keys, self._values, strict=True)

    def columns(self) -> tuple[tuple[Any, ...], Sequence[float]]:
        """The keys and the values, in the same order (the keys' tuple is the same object for
        every map with these keys: it can key a cache)."""
        return self._keys, self._values

    def __repr__(self) -> str:
        return f"Readings({dict(self)!r})"


class LinkReadings(Mapping[int, Mapping[str, float]]):
    """Per-link readings (link -> key -> value), kept as one :class:`Readings`."""

    __slots__ = ("_flat", "_links")

    def __init__(self, links: Mapping[int, Mapping[str, float]] | None = None) -> None:
        links = links or {}
        self._links = tuple(sorted(link for link, values in links.items() if values))
        self._flat = Readings(
            ((link, key), value) for link in self._links for key, value in links[link].items()
        )

    @classmethod
    def of(
        cls, keys: tuple[tuple[int, str], ...], values: Iterable[float], links: tuple[int, ...]
    ) -> LinkReadings:
        """The readings of ``keys`` ((link, key), link by link in ascending order) and
        ``values``; ``links``: the links of ``keys``, each once, in that order."""
        self = cls.__new__(cls)
        self._links = links
        self._flat = Readings.of(keys, values)
        return self

    def value(self, link: int, key: str) -> float | None:
        """The reading ``key`` of ``link``; None when it has none."""
        return self._flat.get((link, key))

    def __getitem__(self, link: int) -> Mapping[str, float]:
        if link not in self._links:
            raise KeyError(link)
        return {key: value for (at, key), value in self._flat.items() if at == link}

    def __iter__(self) -> Iterator[int]:
        return iter(self._links)

    def __len__(self) -> int:
        return len(self._links)

    def pairs(self) -> Iterator[tuple[tuple[int, str], float]]:
        """((link, key), value) of each reading, link by link."""
        return self._flat.pairs()

    def columns(self) -> tuple[tuple[tuple[int, str], ...], Sequence[float]]:
        """The (link, key) pairs and the values, as :meth:`Readings.columns`."""
        return self._flat.columns()

    def __repr__(self) -> str:
        return f"LinkReadings({dict(self.items())!r})"


class _FromDict:
    """``from_dict``, the inverse of ``to_dict`` (:func:`_jsonable`), for the Snapshot's types."""

    __slots__ = ()

    @classmethod
    def from_dict(cls: type[D], data: Any) -> D:
        """The object ``to_dict`` (or ``/snapshot``) wrote as ``data``: keys it does not know
        (``/snapshot``'s ``health``, ``waste``, ``reaper``; the derived readings) are ignored, a
        key with a default may be missing; ValueError naming the key on anything else."""
        return _from_jsonable(cls, data, "")


@dataclass(frozen=True, slots=True)
class HostInfo(_FromDict):
    """Facts about the host and its driver, read once per NVML initialisation."""

    hostname: str
    driver_version: str = ""
    cuda_version: str = ""
    nvml_version: str = ""


@dataclass(frozen=True, slots=True)
class GpuInfo(_FromDict):
    """Static facts of one GPU, read once per NVML initialisation."""

    index: int
    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    serial: str = ""
    minor_number: int | None = None
    memory_total_bytes: int | None = None
    #: ``slowdown``, ``shutdown``, ``gpu_max``, ``memory_max`` in celsius, where the GPU has them.
    temperature_thresholds: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    power_limit_watts: float | None = None
    ecc_enabled: bool | None = None
    #: UUIDs of the GPU's MIG devices when its static facts were read, when MIG is enabled
    #: (``MIG-...``; ``Gpu.mig_devices`` has the layout of each sample).
    mig_uuids: tuple[str, ...] = ()
    #: MIG device slots the GPU has while MIG is enabled (0: MIG off or unsupported).
    mig_slots: int = 0
    #: Whether the GPU has GPU Performance Monitoring (None: the query failed).
    gpm_supported: bool | None = None
    #: Readings of ``core.fields`` read once (cadence ``static``), by key, in base units.
    fields: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    #: NVLink links the GPU has (0: none, or NVML cannot say).
    nvlink_links: int = 0


@dataclass(frozen=True, slots=True)
class MigDevice(_FromDict):
    """One MIG device of a GPU in MIG mode, as one sample saw it."""

    uuid: str  # MIG-...
    gpu_instance: int | None = None
    compute_instance: int | None = None
    profile: str = ""  # as nvidia-smi names it: 1g.10gb, 3g.40gb, ...
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    #: GPM readings of its GPU instance (``core.fields``' GPM keys), where GPM supports MIG.
    fields: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    #: PID that took its launcher lock, and its user (as ``Gpu.reserved_by``).
    reserved_by: int | None = None
    reserved_by_user: str = ""


@dataclass(frozen=True, slots=True)
class Allocation(_FromDict):
    """Who a GPU (or one of its MIG devices) is allocated to: a Slurm job, or a Kubernetes
    container."""

    slurm_job: str = ""
    mig_uuid: str = ""  # "": the whole GPU
    #: where it is known from: ``job_dir`` (the job-mapping directory), ``kubelet`` (its
    #: pod-resources API) or ``processes`` (all the GPU's processes are in that job's cgroup)
    source: str = "job_dir"
    namespace: str = ""
    pod: str = ""
    container: str = ""


@dataclass(frozen=True, slots=True)
class GpuProcess(_FromDict):
    """A process NVML lists on a GPU, enriched from procfs when the PID is visible here."""

    pid: int
    type: str  # "compute" or "graphics"
    used_memory_bytes: int | None
    visible: bool
    name: str = ""
    user: str = ""
    uid: int | None = None
    cmdline: tuple[str, ...] = ()
    state: str = ""
    ppid: int | None = None
    pgid: int | None = None
    sid: int | None = None
    start_time: float | None = None  # seconds since the epoch
    container_id: str = ""
    pod_uid: str = ""
    #: the Slurm job (and step) its cgroup puts it in; "" outside Slurm
    slurm_job: str = ""
    slurm_step: str = ""
    #: its Kubernetes pod and container, named by the kubelet ("" when not known)
    namespace: str = ""
    pod: str = ""
    container: str = ""
    #: it runs on a GPU (or MIG device) its job or pod was not given (sampling.owners)
    outside_allocation: bool = False
    #: the script a Python process runs (``train.py``; see procfs.python_script), "" otherwise
    script: str = ""
    #: Highest SM utilization (0-1) NVML reported for the process on this GPU since the GPU's
    #: previous sample; 0.0 when none was reported (idle); None when unknown.
    sm_utilization_ratio: float | None = None
    #: The same for the memory interface, the video encoder and the video decoder.
    memory_utilization_ratio: float | None = None
    encoder_utilization_ratio: float | None = None
    decoder_utilization_ratio: float | None = None
    #: The MIG devices it runs on (``MIG-...``; none outside MIG mode).
    mig_uuids: tuple[str, ...] = ()
    #: Seconds the agent has seen no SM activity from the process on this GPU: 0 while active,
    #: counted from the first sample that saw it idle; None when its utilization is unknown.
    gpu_idle_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Gpu(_FromDict):
    """One GPU in one sample. ``up`` is False when the sample of this GPU failed."""

    index: int
    uuid: str
    up: bool
    info: GpuInfo | None = None
    error: str = ""
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    temperature_celsius: float | None = None
    fan_speed_ratio: float | None = None
    #: ``graphics``, ``sm``, ``memory``, ``video`` in Hz, where supported.
    clocks_hz: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    performance_state: int | None = None
    clock_event_reasons: int | None = None
    #: Readings of ``core.fields`` (cadences ``sample`` and ``slow``), by key, in base units;
    #: a reading the GPU does not support, or that failed, is left out.
    fields: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    #: Per-link readings of ``core.fields``: link number -> key -> value.
    nvlink: LinkReadings = field(default_factory=LinkReadings)
    #: When the ``slow`` readings (and the fan and the memory and video clocks) shown were read,
    #: wall clock; None when none was.
    slow_read_at: float | None = None
    #: Whether the driver delivers XID events for this GPU (None: not known, or not watched).
    xid_events_supported: bool | None = None
    #: XIDs seen since the agent started, by code.
    xid_counts: Mapping[int, int] = field(default_factory=lambda: _EMPTY)
    #: The last XIDs seen (at most ``core.xid.KEPT_PER_GPU``), oldest first.
    xids: tuple[XidEvent, ...] = ()
    processes: tuple[GpuProcess, ...] | None = None
    #: Its MIG devices in this sample (MIG mode only; the layout can change between samples).
    mig_devices: tuple[MigDevice, ...] = ()
    #: The Slurm jobs and Kubernetes containers it (or a MIG device of it) is allocated to, as
    #: the node knows them.
    allocations: tuple[Allocation, ...] = ()
    #: A source of allocations (the job-mapping directory, the kubelet) answered in this sample,
    #: so each process's ``outside_allocation`` was judged (False: nothing to judge it by).
    allocations_known: bool = False
    #: PID that took this GPU's launcher lock (None: not reserved, or no lock directory). The
    #: lock lives on in the job that inherited it, so this PID may have exited since.
    reserved_by: int | None = None  # 0: reserved, the taker not visible from this PID namespace
    #: the user of ``reserved_by`` ("" when unknown or not visible here)
    reserved_by_user: str = ""

    def mig_uuids(self) -> tuple[str, ...]:
        """Its MIG devices' UUIDs: this sample's layout, else the one of its static facts."""
        if self.mig_devices:
            return tuple(device.uuid for device in self.mig_devices)
        return self.info.mig_uuids if self.info is not None else ()

    @property
    def power_watts(self) -> float | None:
        """Power draw (the ``power`` reading)."""
        return self.fields.get("power")

    @property
    def energy_joules(self) -> float | None:
        """Energy since the driver was loaded (the ``energy`` reading)."""
        return self.fields.get("energy")

    @property
    def memory_temperature_celsius(self) -> float | None:
        """Memory temperature (the ``memory_temperature`` reading)."""
        return self.fields.get("memory_temperature")

    @property
    def ecc_errors(self) -> Mapping[str, int]:
        """``corrected``, ``uncorrected`` volatile ECC error counts, where ECC is on."""
        return {
            name: int(self.fields[key])
            for name, key in (("corrected", "ecc_corrected"), ("uncorrected", "ecc_uncorrected"))
            if key in self.fields
        }

    def thermal_throttling(self) -> bool:
        """True while a thermal clock-event reason (SW or HW thermal slowdown) is active;
        False when none is, or when the reasons are unknown."""
        active = self.clock_events_active() or {}
        return any(active.get(reason, False) for reason in THERMAL_CLOCK_EVENTS)

    def clock_events_active(self) -> dict[str, bool] | None:
        """Decoded clock-event reason bits, or None when unknown."""
        if self.clock_event_reasons is None:
            return None
        return {name: bool(self.clock_event_reasons & bit) for name, bit in CLOCK_EVENT_REASONS}


@dataclass(frozen=True, slots=True)
class SampleError(_FromDict):
    """Something that failed in a sample: where (``source``), on which GPU, and the error name."""

    source: str  # "nvml" (init or library-wide loss), "gpu" (one GPU failed), "field"
    error: str  # NVML error class name without the NVMLError_ prefix, or an OS error name
    gpu: int | None = None
    field: str = ""
    message: str = ""


@dataclass(frozen=True, slots=True)
class Snapshot(_FromDict):
    """Everything one sample saw. Published by atomic reference; never mutated."""

    seq: int
    timestamp: float  # wall clock, seconds since the epoch, when the sample started
    monotonic: float  # monotonic clock when the sample started (for ages)
    duration_seconds: float
    nvml_up: bool
    host: HostInfo
    gpus: tuple[Gpu, ...] = ()
    errors: tuple[SampleError, ...] = ()
    nvml_error: str = ""
    nvml_calls: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the whole Snapshot."""
        return _jsonable(self)

    def without_processes(self) -> Snapshot:
        """This Snapshot with every GPU's process list dropped (``processes`` None: not kept).

        The sampler's history keeps older Snapshots this way: process lists are most of a
        Snapshot's memory and only the latest one's are read.
        """
        if all(gpu.processes is None for gpu in self.gpus):
            return self
        gpus = tuple(dataclasses.replace(gpu, processes=None) for gpu in self.gpus)
        return dataclasses.replace(self, gpus=gpus)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, Gpu):  # the readings that were attributes before core.fields
            out["clock_events_active"] = value.clock_events_active()
            out["memory_temperature_celsius"] = value.memory_temperature_celsius
            out["power_watts"] = value.power_watts
            out["energy_joules"] = value.energy_joules
            out["ecc_errors"] = dict(value.ecc_errors)
        return out
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


@functools.cache
def _fields_of(cls: Any) -> tuple[tuple[str, Any, bool], ...]:
    """(name, type, required) of each field of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (
            f.name,
            hints[f.name],
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
        if f.init
    )


def _from_jsonable(cls: Any, data: Any, where: str) -> Any:
    """An instance of the dataclass ``cls`` from what :func:`_jsonable` made of one."""
    if not isinstance(data, Mapping):
        raise _wrong(where, "an object", data)
    values = {}
    for name, hint, required in _fields_of(cls):
        if name in data:
            values[name] = _decode(hint, data[name], f"{where}.{name}" if where else name)
        elif required:
            raise ValueError(f"{where + ': ' if where else ''}missing required key {name!r}")
    return cls(**values)


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _decode(hint: Any, value: Any, where: str, nullable: bool = False) -> Any:
    """``value`` (JSON) as the type ``hint`` of a Snapshot's field (the types those fields
    use: scalars, ``X | None``, ``tuple[X, ...]``, ``Mapping[K, V]``, the readings' maps, the
    nested dataclasses)."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        if value is None:
            return None
        (inner,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
        return _decode(inner, value, where, nullable=True)
    kind = _KINDS.get(hint)
    if kind is not None:
        allowed = (int, float) if hint is float else hint
        if isinstance(value, allowed) and isinstance(value, bool) == (hint is bool):
            return value
        raise _wrong(where, kind + (" or null" if nullable else ""), value)
    if hint is LinkReadings:
        if not isinstance(value, Mapping):
            raise _wrong(where, "an object", value)
        readings = Mapping[str, float]
        return LinkReadings(
            {
                _key(int, link, where): _decode(readings, values, f"{where}.{link}")
                for link, values in value.items()
            }
        )
    if origin is tuple:
        if not isinstance(value, list):
            raise _wrong(where, "a list" + (" or null" if nullable else ""), value)
        (item, _) = typing.get_args(hint)  # tuple[X, ...]
        return tuple(_decode(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is Mapping:
        if not isinstance(value, Mapping):
            raise _wrong(where, "an object", value)
        key_type, value_type = typing.get_args(hint)
        decoded = {
            _key(key_type, k, where): _decode(value_type, v, f"{where}.{k}")
            for k, v in value.items()
        }
        return Readings(decoded) if value_type is float else frozen_map(decoded)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _from_jsonable(hint, value, where)
    raise TypeError(f"{where}: no decoder for {hint!r}")  # a field of a type added since


def _key(key_type: type, key: str, where: str) -> Any:
    """A map's key as ``to_dict`` wrote it (``str(key)``) back as ``key_type``."""
    if key_type is str:
        return key
    try:
        number = int(key)
    except ValueError:
        number = None
    if number is None or str(number) != key:  # int() also takes " 1", "1_0", Arabic-Indic digits
        raise ValueError(f"{where}: expected integer keys, got {_shown(key)}")
    return number


def _wrong(where: str, expected: str, value: Any) -> ValueError:
    got = {dict: "an object", list: "a list", type(None): "null"}.get(type(value))
    return ValueError(f"{where or 'the document'}: expected {expected}, got {got or _shown(value)}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


__all__ = [
    "CLOCK_EVENT_REASONS",
    "Gpu",
    "GpuInfo",
    "GpuProcess",
    "HostInfo",
    "SampleError",
    "Snapshot",
    "frozen_map",
]
