"""GPU Performance Monitoring (exporter/core/gpm.py, core/nvml.py): SM and tensor activity between
two samples, on the simulated driver that fills pynvml's own ``c_nvmlGpmMetricsGet_t``.

Covered: the first-sample rule (no values, never a 0), the values as the means between the two
samples, two calls per GPU per sample, ``gpu_gpm_supported``, GPUs without GPM (no GPM call at
all), busy counters (absent, counted, retried after a doubling backoff, never at every sample),
other failures (the next sample covers both intervals), a lost GPU, a new NVML initialisation,
and the request built within the installed pynvml's array (98 entries in nvidia-ml-py 12.535,
477 in 13: test.sh runs this file on both).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import types

import pynvml
import pytest

from exporter.core.fields import GPM_READINGS, GpmMetric
from exporter.core.gpm import BUSY_FIRST_RETRY, metric_values, metrics_request
from exporter.exposition.metrics import render
from exporter.sampling.stats import SelfStats
from tests.helpers import one, samples

BUSY = """
gpus:
  - gpm: true
    fields: {sm_active: 0.5}
    errors: [{field: gpm, error: InUse, from: 2s, until: 100s}]
"""


def _values(snap) -> dict[str, float]:
    fields = snap.gpus[0].fields
    return {r.key: fields[r.key] for r in GPM_READINGS if r.key in fields}


def _found(snap):
    return samples(render(snap, SelfStats(interval_seconds=1)))


def test_the_first_sample_has_no_values_the_second_the_means_between_them(
    simulated, collector, clock
):
    driver = simulated(
        """
        gpus:
          - gpm: true
            fields:
              sm_active: {from: 0.2, to: 0.6, over: 10s}
              tensor_active: 0.35
              pcie_transmit_rate: 2097152000
        """
    )
    first = collector.sample()
    assert _values(first) == {}  # nothing to compare with: absent, not 0
    assert "gpu_sm_active_ratio" not in _found(first)
    clock.advance(10)
    second = collector.sample()
    values = _values(second)
    assert values["sm_active"] == pytest.approx(0.4)  # the ramp's mean over 0-10 s
    assert values["tensor_active"] == pytest.approx(0.35)
    assert values["pcie_transmit_rate"] == pytest.approx(2097152000)
    assert values["fp64_active"] == 0  # the scenario's default, asked and answered
    found = _found(second)
    assert one(found, "gpu_sm_active_ratio", gpu="0") == pytest.approx(0.4)
    assert one(found, "gpu_gpm_supported", gpu="0") == 1
    clock.advance(10)
    assert _values(collector.sample())["sm_active"] == pytest.approx(0.6)  # 10-20 s: flat
    # one sample and one computation per GPU and sample; the two buffers allocated once
    assert driver.calls["nvmlGpmSampleGet"] == 3
    assert driver.calls["nvmlGpmMetricsGet"] == 2
    assert driver.calls["nvmlGpmSampleAlloc"] == 2


def test_a_gpu_without_gpm_is_never_asked(simulated, collector, clock):
    driver = simulated("gpus: [{fields: {sm_active: 0.5}}, {name: NVIDIA A100-SXM4-80GB}]\n")
    for _ in range(3):
        snap = collector.sample()
        clock.advance(1)
    assert _values(snap) == {}
    found = _found(snap)
    assert {s.labels["gpu"]: s.value for s in found["gpu_gpm_supported"]} == {"0": 0, "1": 0}
    assert driver.calls["nvmlGpmQueryDeviceSupport"] == 2  # with the static facts, once
    assert not any(driver.calls[f] for f in ("nvmlGpmSampleGet", "nvmlGpmSampleAlloc"))


def test_busy_counters_are_absent_counted_and_retried_with_a_doubling_backoff(
    simulated, collector, clock, caplog
):
    driver = simulated(BUSY)
    caplog.set_level(logging.INFO, logger="exporter.core.nvml")
    collector.sample()
    clock.advance(1)
    assert _values(collector.sample())["sm_active"] == pytest.approx(0.5)
    clock.advance(1)  # 2 s: busy
    snap = collector.sample()
    assert _values(snap) == {}
    assert [(e.field, e.error) for e in snap.errors] == [("gpm", "InUse")]
    assert snap.gpus[0].up
    tries = [driver.calls["nvmlGpmSampleGet"]]
    for _ in range(int(BUSY_FIRST_RETRY) - 1):  # 3 s to 31 s: waiting, not asking
        clock.advance(1)
        snap = collector.sample()
        assert [(e.field, e.error) for e in snap.errors] == [("gpm", "InUse")]
        assert "next try in" in snap.errors[0].message
    tries.append(driver.calls["nvmlGpmSampleGet"])
    clock.advance(1)  # 32 s: tried again, still busy: the next wait is 60 s
    collector.sample()
    tries.append(driver.calls["nvmlGpmSampleGet"])
    clock.advance(59)
    collector.sample()
    tries.append(driver.calls["nvmlGpmSampleGet"])
    assert [b - a for a, b in itertools.pairwise(tries)] == [0, 1, 0]
    clock.advance(1)  # 92 s: still busy, 120 s now
    collector.sample()
    clock.advance(120)  # 212 s: free again: a new first sample, then values
    snap = collector.sample()
    assert _values(snap) == {} and snap.errors == ()
    clock.advance(1)
    assert _values(collector.sample())["sm_active"] == pytest.approx(0.5)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "busy" in warnings[0].getMessage()
    assert any("answer again" in r.getMessage() for r in caplog.records)


def test_a_failed_sample_leaves_the_gpu_up_and_the_next_covers_both(simulated, collector, clock):
    simulated(
        """
        gpus:
          - gpm: true
            fields: {sm_active: {points: [[0s, 0], [10s, 0], [10s, 1], [30s, 1]]}}
            errors: [{field: gpm, error: Unknown, from: 10s, until: 11s}]
        """
    )
    collector.sample()
    clock.advance(10)
    snap = collector.sample()  # 10 s: the sample fails
    assert snap.gpus[0].up and _values(snap) == {}
    assert [(e.field, e.error) for e in snap.errors] == [("gpm", "Unknown")]
    clock.advance(10)
    # 20 s: compared with the sample at 0 s: ten seconds idle, ten busy
    assert _values(collector.sample())["sm_active"] == pytest.approx(0.5, abs=0.05)


def test_a_lost_gpu_in_gpm_fails_the_gpu(simulated, collector, clock):
    simulated("gpus: [{gpm: true, errors: [{field: gpm, error: GpuIsLost, from: 1s}]}, {}]\n")
    collector.sample()
    clock.advance(1)
    snap = collector.sample()
    assert [g.up for g in snap.gpus] == [False, True]


def test_a_new_initialisation_starts_a_new_pair_and_frees_the_old_samples(
    simulated, collector, clock
):
    driver = simulated(
        """
        driver: {errors: [{field: count, error: Uninitialized, from: 2s, until: 3s}]}
        gpus: [{gpm: true, fields: {sm_active: 0.25}}]
        """
    )
    collector.sample()
    clock.advance(1)
    assert _values(collector.sample()) == {"sm_active": 0.25, **_zeros()}
    clock.advance(1)  # 2 s: NVML is gone; the agent shuts it down, freeing both samples
    assert not collector.sample().gpus
    assert driver.calls["nvmlGpmSampleFree"] == 2
    clock.advance(1)  # 3 s: initialised again: a first sample
    assert _values(collector.sample()) == {}
    clock.advance(1)
    assert _values(collector.sample())["sm_active"] == pytest.approx(0.25)
    assert driver.calls["nvmlGpmSampleAlloc"] == 4


def _zeros() -> dict[str, float]:
    return {r.key: 0.0 for r in GPM_READINGS if r.key != "sm_active"}


# -- the request: pynvml's own structure ----------------------------------------------------------


def test_the_request_is_pynvmls_structure_within_its_array():
    request, asked = metrics_request(pynvml, GPM_READINGS)
    assert isinstance(request, pynvml.c_nvmlGpmMetricsGet_t)
    assert request.version == pynvml.NVML_GPM_METRICS_GET_VERSION
    assert request.numMetrics == len(asked) == len(GPM_READINGS) <= len(request.metrics)
    ids = [request.metrics[i].metricId for i in range(request.numMetrics)]
    assert ids == [r.source.id for r in GPM_READINGS if isinstance(r.source, GpmMetric)]
    for reading in GPM_READINGS:  # the ids are pynvml's, where it names them
        assert isinstance(reading.source, GpmMetric)
        assert getattr(pynvml, reading.source.constant, reading.source.id) == reading.source.id


def test_results_are_read_from_pynvmls_own_structure():
    request, asked = metrics_request(pynvml, GPM_READINGS)
    for i in range(len(asked)):
        request.metrics[i].value = 10.0 + i
    last = len(asked) - 1
    request.metrics[last].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
    values, failed = metric_values(request, asked)
    assert failed == {asked[last].key: pynvml.NVML_ERROR_NOT_SUPPORTED}
    assert values == {
        reading.key: pytest.approx((10.0 + i) * reading.scale)
        for i, reading in enumerate(asked[:last])
    }


def test_a_smaller_array_asks_only_what_it_holds():
    class Metric(ctypes.Structure):
        _fields_ = pynvml.c_nvmlGpmMetric_t._fields_

    class Small(ctypes.Structure):
        _fields_ = [
            ("version", ctypes.c_uint),
            ("numMetrics", ctypes.c_uint),
            ("sample1", pynvml.c_nvmlGpmSample_t),
            ("sample2", pynvml.c_nvmlGpmSample_t),
            ("metrics", Metric * 3),
        ]

    lib = types.SimpleNamespace(c_nvmlGpmMetricsGet_t=Small, NVML_GPM_METRICS_GET_VERSION=1)
    request, asked = metrics_request(lib, GPM_READINGS)
    assert request.numMetrics == len(asked) == 3
    request.metrics[0].value, request.metrics[1].nvmlReturn = 42.0, pynvml.NVML_ERROR_NOT_SUPPORTED
    values, failed = metric_values(request, asked)
    assert values == {asked[0].key: pytest.approx(0.42), asked[2].key: 0.0}
    assert failed == {asked[1].key: pynvml.NVML_ERROR_NOT_SUPPORTED}


def test_the_simulation_checks_the_request_as_a_driver_would(simulated):
    driver = simulated("gpus: [{gpm: true}, {gpm: true}]\n")
    driver.nvmlInit()
    first, second = (driver.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
    a, b = driver.nvmlGpmSampleAlloc(), driver.nvmlGpmSampleAlloc()
    request, _ = metrics_request(driver, GPM_READINGS)
    request.sample1, request.sample2 = a, b
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # samples not taken
        driver.nvmlGpmMetricsGet(request)
    driver.nvmlGpmSampleGet(first, a)
    driver.nvmlGpmSampleGet(second, b)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # of two GPUs
        driver.nvmlGpmMetricsGet(request)
    request.version = 7
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        driver.nvmlGpmMetricsGet(request)
    driver.nvmlGpmSampleFree(a)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # freed
        driver.nvmlGpmSampleGet(first, a)
