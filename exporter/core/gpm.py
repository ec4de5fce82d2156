"""GPU Performance Monitoring (GPM, Hopper and later): what ``core.nvml`` keeps per GPU to read it.

GPM metrics are computed between two samples of the GPU's counters: each sample of the agent
takes one (``nvmlGpmSampleGet``) and asks for every metric of ``core.fields``' GPM readings
between it and the previous one (one ``nvmlGpmMetricsGet``). The first sample after start, after
NVML is initialised again or after a failed one has nothing to compare with: no values, never a
made-up 0.

``nvmlGpmMetricsGet`` takes pynvml's ``c_nvmlGpmMetricsGet_t``, whose array of metrics grew from
98 to 477 entries between nvidia-ml-py 12.535 and 13 without a version change of the structure:
the request is built from the installed pynvml's own structure, asks for at most as many metrics
as its array holds, and never indexes the array by metric id, so both work.

When the counters are busy (``InUse``: another profiler holds them), the agent tries again
after a backoff (:data:`BUSY_FIRST_RETRY`, doubling up to :data:`BUSY_LAST_RETRY`), not at
every sample.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from exporter.core.fields import GpmMetric, Reading

#: Seconds before the first try after the counters were found busy; doubling up to the last.
BUSY_FIRST_RETRY = 30.0
BUSY_LAST_RETRY = 600.0


@dataclass
class GpmState:
    """One GPU's GPM: its two samples (the previous and the one being taken), the request
    that names the metrics to compute, and when the counters may be asked again."""

    samples: list[Any]
    request: Any
    #: The readings the request asks for, in its order (those the GPU lacks left out).
    asked: tuple[Reading, ...]
    have_previous: bool = False
    #: Monotonic time before which the busy counters are not asked; 0: not busy.
    busy_until: float = 0.0
    busy_retry: float = 0.0
    #: Reading keys this GPU's GPM said it does not support.
    unsupported: set[str] = field(default_factory=set)

    def swap(self) -> None:
        """The sample just taken becomes the previous one."""
        self.samples.reverse()
        self.have_previous = True

    def busy(self, now: float) -> float:
        """Note busy counters at ``now``; the seconds until the next try."""
        self.busy_retry = min(self.busy_retry * 2 or BUSY_FIRST_RETRY, BUSY_LAST_RETRY)
        self.busy_until = now + self.busy_retry
        self.have_previous = False
        return self.busy_retry

    def answered(self) -> bool:
        """Note that the counters answered; True when they had been busy."""
        was_busy = self.busy_retry > 0
        self.busy_until = self.busy_retry = 0.0
        return was_busy


def metrics_request(lib: Any, readings: Sequence[Reading]) -> tuple[Any, tuple[Reading, ...]]:
    """pynvml's ``c_nvmlGpmMetricsGet_t`` naming the metrics of ``readings`` (as many as its
    array holds), and the readings asked for, in order."""
    request = lib.c_nvmlGpmMetricsGet_t()
    asked = tuple(readings[: len(request.metrics)])
    request.version = lib.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(asked)
    for slot, reading in zip(request.metrics, asked, strict=False):
        assert isinstance(reading.source, GpmMetric)
        slot.metricId = reading.source.id
    return request, asked


def metric_values(
    request: Any, asked: Sequence[Reading]
) -> tuple[dict[str, float], dict[str, int]]:
    """The values (base units) of a filled request by reading key, and the NVML return code of
    each metric that has none.

    Read from the request's memory at the offsets pynvml's structures declare (each member
    through pynvml's classes is a Python call, a dozen metrics a GPU every sample); a request
    that is not a ctypes structure is read member by member."""
    values: dict[str, float] = {}
    failed: dict[str, int] = {}
    try:
        raw = memoryview(request).cast("B")
    except TypeError:
        pairs = [(int(slot.nvmlReturn), float(slot.value)) for slot in request.metrics]
    else:
        layout = _results_layout(type(request), min(len(asked), len(request.metrics)))
        flat = layout.unpack_from(raw)
        pairs = list(zip(flat[0::2], flat[1::2], strict=True))
    for (code, value), reading in zip(pairs, asked, strict=False):
        if code:
            failed[reading.key] = int(code)
        else:
            values[reading.key] = value * reading.scale
    return values, failed


def _results_layout(cls: Any, count: int) -> struct.Struct:
    """A Struct of the (nvmlReturn, value) pairs of the first ``count`` metrics of a
    ``c_nvmlGpmMetricsGet_t``-like class, from its ctypes layout."""
    made = _LAYOUTS.get((cls, count))
    if made is not None:
        return made
    metrics = cls.metrics  # the ctypes field: its offset
    element = dict(cls._fields_)["metrics"]._type_
    if element.nvmlReturn.size != 4 or element.value.size != 8:
        raise ValueError("unexpected c_nvmlGpmMetric_t layout")
    fmt, at = "=", 0
    for i in range(count):
        start = metrics.offset + i * ctypes.sizeof(element)
        for offset, kind, size in (
            (start + element.nvmlReturn.offset, "I", 4),
            (start + element.value.offset, "d", 8),
        ):
            fmt += f"{offset - at}x{kind}" if offset > at else kind
            at = offset + size
    _LAYOUTS[(cls, count)] = made = struct.Struct(fmt)
    return made


#: (request class, metrics asked) -> the Struct of their results
_LAYOUTS: dict[tuple[Any, int], struct.Struct] = {}
