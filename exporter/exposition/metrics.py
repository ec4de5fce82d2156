"""Snapshot -> Prometheus text exposition (and OpenMetrics).

The exposition is rendered once per sample (by the sampler thread) and served as bytes; a scrape
only appends the few lines that depend on the time of the scrape (the Snapshot's age, the HTTP
server's counters). The process's own ``process_*`` metrics (prometheus_client's process
collector: memory, CPU, file descriptors) are read with each sample too, so that a scrape reads no
file. An :class:`Exposition` also gives its families in OpenMetrics, rendered on first use, once.
A field that is None in the Snapshot has no series; label sets never change shape.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from exporter import __version__
from exporter.core.fieldplan import gatherer
from exporter.core.fields import GPM_READINGS, READINGS
from exporter.core.snapshot import Gpu, GpuProcess, LinkReadings, Readings, Snapshot
from exporter.core.xid import describe_xid
from exporter.exposition.selfprocess import SelfProcess
from exporter.exposition.text import Family as Rows
from exporter.exposition.text import has_samples, render_text
from exporter.sampling.stats import SelfStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
#: The line that ends an OpenMetrics exposition (once, after every part).
OPENMETRICS_EOF = b"# EOF\n"
GPU_LABELS = ["gpu", "uuid"]
INFO_LABELS = [
    "gpu",
    "uuid",
    "name",
    "pci_bus_id",
    "serial",
    "minor_number",
    "driver_version",
    "cuda_version",
]
PROCESS_LABELS = ["gpu", "uuid", "pid", "user", "process", "type"]
#: A family to render: prometheus_client's, or one of rows (exposition/text.py).
AnyFamily = Metric | Rows
#: The families this module fills, a series at a time.
Family = Rows


class _Families:
    """The ``collect()`` interface generate_latest expects, over a fixed list of families."""

    def __init__(self, families: Iterable[AnyFamily]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        # a Family of rows quacks like a Metric (name, documentation, type, unit, samples)
        return iter(self._families)  # type: ignore[arg-type]


class Exposition(bytes):
    """The text exposition of some metric families (leaving out those without samples); the
    same families in OpenMetrics come from :meth:`openmetrics`, rendered on first use, once."""

    _families: tuple[AnyFamily, ...]
    _openmetrics: bytes | None
    _lock: threading.Lock

    def __new__(cls, families: Iterable[AnyFamily]) -> Exposition:
        kept = tuple(f for f in families if has_samples(f))
        self = super().__new__(cls, render_text(kept))
        self._families, self._openmetrics, self._lock = kept, None, threading.Lock()
        return self

    def openmetrics(self) -> bytes:
        """The families in OpenMetrics, without the closing ``# EOF`` (a scrape adds it once,
        after every part)."""
        if self._openmetrics is None:
            with self._lock:
                if self._openmetrics is None:
                    self._openmetrics = _openmetrics(self._families)
        return self._openmetrics


def _openmetrics(families: Iterable[AnyFamily]) -> bytes:
    text = generate_openmetrics(_Families(families))
    return text[: -len(OPENMETRICS_EOF)] if text.endswith(OPENMETRICS_EOF) else text


def openmetrics(exposition: bytes) -> bytes:
    """``exposition`` (text format) in OpenMetrics, without ``# EOF``: an :class:`Exposition`'s
    own, else parsed back from the text (slower: prefer Expositions)."""
    if isinstance(exposition, Exposition):
        return exposition.openmetrics()
    if not exposition:
        return b""
    return _openmetrics(text_string_to_metric_families(exposition.decode()))


def render_families(families: Iterable[AnyFamily]) -> Exposition:
    """Exposition text of ``families``, leaving out those without samples."""
    return Exposition(families)


def gauge(name: str, doc: str, labels: Sequence[str] | None = None) -> Rows:
    """A gauge family to fill with ``add_metric``; its labels are ``gpu`` and ``uuid`` unless
    given."""
    return Rows(name, doc, "gauge", GPU_LABELS if labels is None else labels)


def counter(name: str, doc: str, labels: Sequence[str] | None = None) -> Rows:
    """A counter family (``name`` without ``_total``), as :func:`gauge`."""
    return Rows(name, doc, "counter", GPU_LABELS if labels is None else labels)


def _per_gpu(gpus: Iterable[Gpu], family: Family, value: Callable[[Gpu], float | None]) -> Family:
    """One series per GPU; a GPU whose value is None has none."""
    for gpu in gpus:
        number = value(gpu)
        if number is not None and not math.isnan(number):
            family.add(_gpu_labels(gpu.index, gpu.uuid), number)
    return family


def _per_gpu_by(
    gpus: Iterable[Gpu], family: Family, values: Callable[[Gpu], Iterable[tuple[str, float]]]
) -> Family:
    """One series per GPU and extra label value (clock, threshold, reason, type)."""
    for gpu in gpus:
        for label, value in values(gpu):
            family.add(_gpu_labels(gpu.index, gpu.uuid, label), value)
    return family


def _gpu_labels(index: int, uuid: str, extra: str | None = None) -> tuple[str, ...]:
    """A GPU series' label values: the same tuple sample after sample, so that rows compare
    equal at once (by identity) and the text of unchanged families is reused cheaply."""
    key = (index, uuid, extra)
    found = _GPU_LABELS.get(key)
    if found is None:
        if len(_GPU_LABELS) > 65_536:  # GPUs that came and went
            _GPU_LABELS.clear()
        found = (str(index), uuid) if extra is None else (str(index), uuid, extra)
        _GPU_LABELS[key] = found
    return found


_GPU_LABELS: dict[tuple[int, str, str | None], tuple[str, ...]] = {}


def _static(gpu: Gpu, attr: str) -> float | None:
    return getattr(gpu.info, attr) if gpu.info is not None else None


def _gpm_supported(gpu: Gpu) -> float | None:
    supported = gpu.info.gpm_supported if gpu.info is not None else None
    return None if supported is None else float(supported)


def _thresholds(gpu: Gpu) -> Iterable[tuple[str, float]]:
    return sorted(gpu.info.temperature_thresholds.items()) if gpu.info is not None else ()


def _clock_events(gpu: Gpu) -> Iterable[tuple[str, float]]:
    active = gpu.clock_events_active() or {}
    return ((name, 1.0 if on else 0.0) for name, on in active.items())


def _process_count(gpu: Gpu) -> int | None:
    return len({p.pid for p in gpu.processes}) if gpu.processes is not None else None


def gpu_families(snapshot: Snapshot) -> list[AnyFamily]:
    """Every ``gpu_*`` and ``gpu_process_*`` family of one Snapshot."""
    host = snapshot.host
    info = gauge("gpu_info", "Identity of a GPU; always 1.", INFO_LABELS)
    up = gauge("gpu_up", "1 while the GPU's last sample succeeded, 0 when it failed.")
    for gpu in snapshot.gpus:
        up.add_metric([str(gpu.index), gpu.uuid], 1.0 if gpu.up else 0.0)
        if gpu.info is not None:
            minor = gpu.info.minor_number
            info.add_metric(
                [
                    str(gpu.index),
                    gpu.uuid,
                    gpu.info.name,
                    gpu.info.pci_bus_id,
                    gpu.info.serial,
                    "" if minor is None else str(minor),
                    host.driver_version,
                    host.cuda_version,
                ],
                1.0,
            )
    live = [gpu for gpu in snapshot.gpus if gpu.up]
    return [
        info,
        up,
        _per_gpu(
            live,
            gauge("gpu_memory_total_bytes", "Total GPU memory."),
            lambda g: _static(g, "memory_total_bytes"),
        ),
        _per_gpu(
            live,
            gauge(
                "gpu_memory_used_bytes",
                "GPU memory in use (reserved memory not counted where the driver has v2 info).",
            ),
            lambda g: g.memory_used_bytes,
        ),
        _per_gpu(
            live, gauge("gpu_memory_free_bytes", "Free GPU memory."), lambda g: g.memory_free_bytes
        ),
        _per_gpu(
            live,
            gauge(
                "gpu_memory_reserved_bytes",
                "GPU memory reserved by the driver and firmware (memory info v2).",
            ),
            lambda g: g.memory_reserved_bytes,
        ),
        _per_gpu(
            live,
            gauge(
                "gpu_utilization_ratio", "Fraction of the last sample period a kernel ran (0-1)."
            ),
            lambda g: g.utilization_ratio,
        ),
        _per_gpu(
            live,
            gauge(
                "gpu_memory_utilization_ratio",
                "Fraction of the last sample period device memory was read or written (0-1).",
            ),
            lambda g: g.memory_utilization_ratio,
        ),
        _per_gpu(
            live,
            gauge("gpu_temperature_celsius", "GPU core temperature."),
            lambda g: g.temperature_celsius,
        ),
        _per_gpu_by(
            live,
            gauge(
                "gpu_temperature_threshold_celsius",
                "The GPU's own temperature thresholds (slowdown, shutdown, gpu_max, memory_max).",
                [*GPU_LABELS, "threshold"],
            ),
            _thresholds,
        ),
        _per_gpu(
            live,
            gauge(
                "gpu_gpm_supported",
                "1 when the GPU has GPU Performance Monitoring (the gpu_*_active_ratio metrics), "
                "0 when it does not.",
            ),
            _gpm_supported,
        ),
        _per_gpu(
            live,
            gauge("gpu_power_limit_watts", "Enforced power limit."),
            lambda g: _static(g, "power_limit_watts"),
        ),
        _per_gpu(
            live,
            gauge("gpu_fan_speed_ratio", "Fan speed, fraction of maximum."),
            lambda g: g.fan_speed_ratio,
        ),
        _per_gpu_by(
            live,
            gauge("gpu_clock_hz", "Current clock frequency.", [*GPU_LABELS, "clock"]),
            lambda g: g.clocks_hz.items(),
        ),
        _per_gpu(
            live,
            gauge("gpu_performance_state", "Performance state, 0 (maximum) to 15 (minimum)."),
            lambda g: g.performance_state,
        ),
        _per_gpu_by(
            live,
            gauge(
                "gpu_clock_event_active",
                "1 while this clock-event (throttle) reason holds clocks down, else 0.",
                [*GPU_LABELS, "reason"],
            ),
            _clock_events,
        ),
        _per_gpu(
            live,
            gauge("gpu_processes", "Processes NVML lists on the GPU (compute and graphics)."),
            _process_count,
        ),
        _per_gpu(
            live,
            gauge("gpu_reserved", "1 while a launcher lock holds the GPU for a job, else 0."),
            lambda g: 1.0 if g.reserved_by is not None else 0.0,
        ),
        *reading_families(live),
        *xid_families(snapshot.gpus),
        *mig_families(live),
        _owners(live),
        *_allocations(live),
        *_per_process(
            live,
            (
                gauge(
                    "gpu_process_memory_used_bytes",
                    "GPU memory used by one process on one GPU.",
                    PROCESS_LABELS,
                ),
                attrgetter("used_memory_bytes"),
            ),
            (
                gauge(
                    "gpu_process_sm_utilization_ratio",
                    "Highest SM utilization of one process on one GPU since the previous sample "
                    "(0-1).",
                    PROCESS_LABELS,
                ),
                attrgetter("sm_utilization_ratio"),
            ),
            *(
                (
                    gauge(
                        f"gpu_process_{name}_utilization_ratio",
                        f"Highest {what} utilization of one process on one GPU since the previous "
                        "sample (0-1).",
                        PROCESS_LABELS,
                    ),
                    value,
                )
                for name, what, value in _PROCESS_UTILIZATIONS
            ),
        ),
    ]


#: The per-process utilizations beside the SMs': (metric's word, what, its value).
_PROCESS_UTILIZATIONS: tuple[tuple[str, str, Callable[[GpuProcess], float | None]], ...] = (
    ("memory", "memory (frame buffer) bandwidth", attrgetter("memory_utilization_ratio")),
    ("encoder", "video encoder", attrgetter("encoder_utilization_ratio")),
    ("decoder", "video decoder", attrgetter("decoder_utilization_ratio")),
)


def reading_families(gpus: list[Gpu]) -> list[Rows]:
    """One family per metric of ``core.fields``' table, in its order: each GPU's value of every
    reading of the family (per link for NVLink readings); a reading the GPU lacks has none."""
    families = [Rows(name, doc, kind, labels) for name, doc, kind, labels in _READING_FAMILIES]
    rows = [family.rows for family in families]
    for gpu in gpus:
        static = _columns(gpu.info.fields if gpu.info is not None else {})
        fields, links = _columns(gpu.fields), _columns(gpu.nvlink)
        values = (*static[1], *fields[1], *links[1])
        for family_at, labels, gather in _route(gpu, static[0], fields[0], links[0]):
            rows[family_at].extend(zip(labels, gather(values), strict=True))
    return families


def _reading_routes() -> tuple[
    list[tuple[str, str, str, list[str]]], dict[str, tuple[int, tuple[str, ...]]]
]:
    """The families of ``core.fields``' table, in its order (name, help, kind, label names),
    and each reading's (its family's position, its fixed label values)."""
    families: list[tuple[str, str, str, list[str]]] = []
    at: dict[str, int] = {}
    routes: dict[str, tuple[int, tuple[str, ...]]] = {}
    for reading in READINGS:
        if reading.family not in at:
            labels = [*GPU_LABELS, *(["link"] if reading.per_link else [])]
            labels += [name for name, _ in reading.labels]
            at[reading.family] = len(families)
            families.append((reading.family, reading.help, reading.kind, labels))
        routes[reading.key] = (at[reading.family], tuple(value for _, value in reading.labels))
    return families, routes


_READING_FAMILIES, _READING_ROUTES = _reading_routes()

#: How one GPU's readings go to the families: (family position, the series' label values,
#: the values' positions in the GPU's static, sampled and per-link readings one after the
#: other). Made again when the GPU's keys change.
_Route = list[tuple[int, tuple[tuple[str, ...], ...], Callable[[Sequence[float]], Sequence[float]]]]
#: (GPU index, UUID) -> (the key tuples a route was made for, the route)
_ROUTES: dict[tuple[int, str], tuple[tuple[tuple[Any, ...], ...], _Route]] = {}


def _route(
    gpu: Gpu, static: tuple[str, ...], fields: tuple[str, ...], links: tuple[Any, ...]
) -> _Route:
    """The GPU's route for these keys: the one made last time when they are the same tuples."""
    made = _ROUTES.get((gpu.index, gpu.uuid))
    if made is not None and all(
        a is b for a, b in zip(made[0], (static, fields, links), strict=True)
    ):
        return made[1]
    index, uuid = str(gpu.index), gpu.uuid
    series: dict[int, tuple[list[int], list[tuple[str, ...]]]] = {}
    keys = [(key, None) for key in (*static, *fields)] + [(key, link) for link, key in links]
    for position, (key, link) in enumerate(keys):
        found = _READING_ROUTES.get(key)
        if found is None:
            continue
        family_at, fixed = found
        positions, labels = series.setdefault(family_at, ([], []))
        positions.append(position)
        link_label = () if link is None else (str(link),)
        labels.append((index, uuid, *link_label, *fixed))
    route = [
        (family_at, tuple(labels), gatherer(positions))
        for family_at, (positions, labels) in sorted(series.items())
    ]
    if len(_ROUTES) > 4096:  # GPUs that came and went
        _ROUTES.clear()
    _ROUTES[(gpu.index, gpu.uuid)] = ((static, fields, links), route)
    return route


def _columns(values: Mapping[Any, Any]) -> tuple[tuple[Any, ...], Sequence[float]]:
    """(keys, values) of a GPU's readings: Readings' own (shared key tuples), else made."""
    if isinstance(values, (Readings, LinkReadings)):
        return values.columns()
    if values and isinstance(next(iter(values.values())), Mapping):  # per link, as a dict
        pairs = [((link, key), v) for link, inner in values.items() for key, v in inner.items()]
        return tuple(k for k, _ in pairs), [v for _, v in pairs]
    return tuple(values), list(values.values())


def xid_families(gpus: Iterable[Gpu]) -> list[Family]:
    """XIDs per GPU and code (also while a GPU is down: the count must not vanish when the
    XID took the GPU down), and whether the GPU's driver delivers them."""
    errors = counter(
        "gpu_xid_errors",
        "XID errors NVML delivered since the agent started, by code and what NVIDIA's catalog "
        "says the code needs (restart_app, reset_gpu, reboot, check_workflow, ignore, unknown).",
        [*GPU_LABELS, "xid", "resolution"],
    )
    supported = gauge(
        "gpu_xid_events_supported",
        "1 when the GPU's driver delivers XID events to the agent, 0 when it does not.",
    )
    for gpu in gpus:
        if not gpu.uuid:
            continue
        ids = [str(gpu.index), gpu.uuid]
        for code, count in sorted(gpu.xid_counts.items()):
            errors.add_metric([*ids, str(code), describe_xid(code).resolution], count)
        if gpu.xid_events_supported is not None:
            supported.add_metric(ids, 1.0 if gpu.xid_events_supported else 0.0)
    return [errors, supported]


def _allocations(gpus: Iterable[Gpu]) -> list[Family]:
    """Whom each GPU (or MIG device) is allocated to, to join on the GPU: Kubernetes containers
    and Slurm jobs; and how many of its processes run outside their job's or pod's GPUs."""
    allocated = gauge(
        "gpu_allocation_info",
        "1 for each container or job a GPU (or, with mig_uuid, a MIG device) is allocated to.",
        ["gpu", "uuid", "mig_uuid", "namespace", "pod", "container", "slurm_job"],
    )
    outside = gauge(
        "gpu_processes_outside_allocation",
        "Processes on the GPU whose Slurm job or pod was not given it (only where the kubelet "
        "or the job-mapping directory says what was given).",
        GPU_LABELS,
    )
    for gpu in gpus:
        ids = [str(gpu.index), gpu.uuid]
        for one in gpu.allocations:
            labels = [*ids, one.mig_uuid, one.namespace, one.pod, one.container, one.slurm_job]
            allocated.add_metric(labels, 1.0)
        if gpu.allocations_known and gpu.processes is not None:
            outside.add_metric(ids, sum(p.outside_allocation for p in gpu.processes))
    return [allocated, outside]


def _owners(gpus: Iterable[Gpu]) -> Family:
    """Who each GPU process belongs to, to join on ``pid``: its Kubernetes container (named by
    the kubelet) and its Slurm job (from its cgroup)."""
    owners = gauge(
        "gpu_process_owner_info",
        "1 for each GPU process whose owner is known: its Kubernetes pod or Slurm job.",
        ["gpu", "uuid", "pid", "namespace", "pod", "container", "slurm_job"],
    )
    for gpu in gpus:
        for p in gpu.processes or ():
            if p.slurm_job or p.pod:
                labels = [str(gpu.index), gpu.uuid, str(p.pid), p.namespace, p.pod, p.container]
                owners.add_metric([*labels, p.slurm_job], 1.0)
    return owners


MIG_LABELS = [*GPU_LABELS, "mig_uuid"]
#: GPM's metrics of a MIG device (its GPU instance): ``gpu_mig_sm_active_ratio``, ...
_MIG_GPM = tuple((r, "gpu_mig_" + r.metric[len("gpu_") :]) for r in GPM_READINGS)


def mig_families(gpus: Iterable[Gpu]) -> list[Family]:
    """The MIG devices of GPUs in MIG mode (every series with the parent's ``gpu`` and
    ``uuid``, and ``mig_uuid``), and which MIG device each process runs on."""
    info = gauge(
        "gpu_mig_info",
        "A MIG device of the GPU; always 1.",
        [*MIG_LABELS, "gpu_instance", "compute_instance", "profile"],
    )
    memory = {
        part: gauge(f"gpu_mig_memory_{part}_bytes", f"{text} of the MIG device.", MIG_LABELS)
        for part, text in (("total", "Memory"), ("used", "Memory in use"), ("free", "Free memory"))
    }
    gpm = {
        name: gauge(
            name,
            reading.help.replace("from GPM", "of the MIG device's GPU instance, from GPM"),
            MIG_LABELS,
        )
        for reading, name in _MIG_GPM
    }
    process = gauge(
        "gpu_process_mig_info",
        "1 for each MIG device a process runs on (join on pid for its other series).",
        ["gpu", "uuid", "pid", "mig_uuid"],
    )
    for gpu in gpus:
        ids = [str(gpu.index), gpu.uuid]
        for device in gpu.mig_devices:
            labels = [*ids, device.uuid]
            instances = [
                "" if device.gpu_instance is None else str(device.gpu_instance),
                "" if device.compute_instance is None else str(device.compute_instance),
            ]
            info.add_metric([*labels, *instances, device.profile], 1.0)
            for part, value in (
                ("total", device.memory_total_bytes),
                ("used", device.memory_used_bytes),
                ("free", device.memory_free_bytes),
            ):
                if value is not None:
                    memory[part].add_metric(labels, value)
            for reading, name in _MIG_GPM:
                if reading.key in device.fields:
                    gpm[name].add_metric(labels, device.fields[reading.key])
        for proc in gpu.processes or ():
            for mig_uuid in proc.mig_uuids:
                process.add_metric([*ids, str(proc.pid), mig_uuid], 1.0)
    return [info, *memory.values(), *gpm.values(), process]


def _per_process(
    gpus: list[Gpu], *families: tuple[Family, Callable[[GpuProcess], float | None]]
) -> list[Family]:
    """One series per process (and type) on each GPU in each of ``families`` (a family and the
    process's value in it); a process whose value is None has none. A process's label values
    are one tuple, shared by its series."""
    appends = [(family.rows.append, value) for family, value in families]  # Family.add's rows
    for gpu in gpus:
        index = str(gpu.index)
        for proc in gpu.processes or ():
            labels = (index, gpu.uuid, str(proc.pid), proc.user, proc.name, proc.type)
            for append, value in appends:
                number = value(proc)
                if number is not None:
                    append((labels, number))
    return [family for family, _ in families]


def self_families(snapshot: Snapshot, stats: SelfStats) -> list[AnyFamily]:
    """The agent's own ``gpu_exporter_*`` families as of one Snapshot."""
    build = gauge(
        "gpu_exporter_build_info",
        "Version of gpu-exporter; always 1.",
        ["version", "python_version"],
    )
    build.add_metric([__version__, ".".join(map(str, sys.version_info[:3]))], 1.0)
    nvml_up = gauge("gpu_exporter_nvml_up", "1 while NVML answers, 0 when it is unavailable.", [])
    nvml_up.add_metric([], 1.0 if snapshot.nvml_up else 0.0)
    duration = gauge("gpu_exporter_sample_duration_seconds", "How long the last sample took.", [])
    duration.add_metric([], snapshot.duration_seconds)
    last = gauge(
        "gpu_exporter_last_sample_timestamp_seconds",
        "When the last sample started, seconds since the epoch.",
        [],
    )
    last.add_metric([], snapshot.timestamp)
    interval = gauge("gpu_exporter_sample_interval_seconds", "Configured time between samples.", [])
    interval.add_metric([], stats.interval_seconds)
    calls = gauge("gpu_exporter_sample_nvml_calls", "NVML calls the last sample made.", [])
    calls.add_metric([], snapshot.nvml_calls)
    samples = counter("gpu_exporter_samples", "Samples taken.", [])
    samples.add_metric([], stats.samples_total)
    deadline = counter(
        "gpu_exporter_sample_deadline_exceeded",
        "Samples that took longer than the sample deadline.",
        [],
    )
    deadline.add_metric([], stats.deadline_exceeded_total)
    errors = counter(
        "gpu_exporter_sample_errors",
        "Errors met while sampling, by source (nvml, gpu, field, sampler) and error name.",
        ["source", "error"],
    )
    for (source, error), count in sorted(stats.errors_total.items()):
        errors.add_metric([source, error], count)
    return [build, nvml_up, duration, last, interval, calls, samples, deadline, errors]


#: The ``process_*`` families of this process (from /proc/self; none elsewhere).
_PROCESS = SelfProcess()


def process_families() -> list[Rows]:
    """``process_resident_memory_bytes``, ``process_cpu_seconds_total``, ``process_open_fds``
    and the rest of prometheus_client's process collector's families, read now."""
    return _PROCESS.families()


def render(snapshot: Snapshot, stats: SelfStats) -> Exposition:
    """The exposition of one Snapshot and the agent's counters."""
    return render_families([*gpu_families(snapshot), *self_families(snapshot, stats)])


def render_with_process(snapshot: Snapshot, stats: SelfStats) -> Exposition:
    """:func:`render` and the process's own ``process_*`` metrics, read now: what the agent
    serves (the sampler calls it once per sample, so a scrape reads no file)."""
    return render_families(
        [*gpu_families(snapshot), *self_families(snapshot, stats), *process_families()]
    )


_AGE_HEAD = (
    b"# HELP gpu_exporter_snapshot_age_seconds Seconds since the served Snapshot was taken.\n"
    b"# TYPE gpu_exporter_snapshot_age_seconds gauge\n"
)
_STALE_HEAD = (
    b"# HELP gpu_exporter_snapshot_stale 1 when the served Snapshot is older than allowed.\n"
    b"# TYPE gpu_exporter_snapshot_stale gauge\n"
)


def render_liveness(age_seconds: float | None, stale: bool) -> bytes:
    """The lines that depend on when the scrape happens (the Snapshot's age)."""
    age = b"" if age_seconds is None else b"gpu_exporter_snapshot_age_seconds %.6f\n" % age_seconds
    return b"%s%s%sgpu_exporter_snapshot_stale %d\n" % (_AGE_HEAD, age, _STALE_HEAD, stale)


_HTTP_HELP = (
    (
        "gpu_exporter_http_connections",
        "gauge",
        "HTTP connections open now (idle keep-alive ones included).",
    ),
    (
        "gpu_exporter_http_rejected_connections",
        "counter",
        "Connections refused at the connection cap or dropped for a bad or slow request head.",
    ),
    (
        "gpu_exporter_http_requests",
        "counter",
        "HTTP requests answered, by path (a known route, else other) and status code.",
    ),
)


def _http_heads(
    openmetrics: bool, families: tuple[tuple[str, str, str], ...] = _HTTP_HELP
) -> tuple[tuple[str, str], ...]:
    """Per family of ``families``: its HELP and TYPE lines, and its samples' name."""
    heads = []
    for name, kind, doc in families:
        sample = name + "_total" if kind == "counter" else name
        family = name if openmetrics else sample
        heads.append((f"# HELP {family} {doc}\n# TYPE {family} {kind}\n", sample))
    return tuple(heads)


#: Made once: render_http runs for every scrape. By OpenMetrics or not.
_HTTP_HEADS = {False: _http_heads(False), True: _http_heads(True)}


def render_http(
    connections: int,
    rejected: int,
    requests: Iterable[tuple[str, int, int]],
    openmetrics: bool = False,
) -> bytes:
    """The HTTP server's ``gpu_exporter_http_*`` lines, as of the scrape: ``requests`` are
    (path, status code, count). Text format, or OpenMetrics (counters' HELP and TYPE name the
    family without ``_total``)."""
    (open_head, open_name), (rejected_head, rejected_name), (requests_head, requests_name) = (
        _HTTP_HEADS[openmetrics]
    )
    lines = [
        f"{open_head}{open_name} {connections}\n{rejected_head}{rejected_name} {rejected}\n",
        requests_head,
    ]
    lines += [
        f'{requests_name}{{code="{code}",path="{_label(path)}"}} {n}\n'
        for path, code, n in requests
    ]
    return "".join(lines).encode()


_WEB_CONFIG_HELP = (
    (
        "gpu_exporter_web_config_reloads",
        "counter",
        "Reloads of the web config file (a change to it or its TLS files, or SIGHUP), by result; "
        "a failure keeps the running configuration.",
    ),
    (
        "gpu_exporter_web_config_last_reload_successful",
        "gauge",
        "1 when the last reload of the web config succeeded (or none was tried), 0 when it failed.",
    ),
    (
        "gpu_exporter_web_config_last_reload_success_timestamp_seconds",
        "gauge",
        "When the running web config was loaded: at start, or by the last successful reload.",
    ),
)
_WEB_CONFIG_HEADS = {
    False: _http_heads(False, _WEB_CONFIG_HELP),
    True: _http_heads(True, _WEB_CONFIG_HELP),
}


def render_web_config(
    successes: int,
    failures: int,
    last_successful: bool,
    last_success: float,
    openmetrics: bool = False,
) -> bytes:
    """The web config's ``gpu_exporter_web_config_*`` lines, as of the scrape (served only
    with a web config)."""
    (reloads_head, reloads), (ok_head, ok), (when_head, when) = _WEB_CONFIG_HEADS[openmetrics]
    return (
        f'{reloads_head}{reloads}{{result="success"}} {successes}\n'
        f'{reloads}{{result="failure"}} {failures}\n'
        f"{ok_head}{ok} {int(last_successful)}\n{when_head}{when} {last_success:.3f}\n"
    ).encode()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
