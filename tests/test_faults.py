"""Fault injection: hung and failing NVML, GPUs that come and go, procfs races, failing actions.

Every test here makes something break on purpose and asserts what the agent promises then: it
never crashes, never exports a wrong value (a failed field is absent, a failed GPU is
``gpu_up 0``), reports what went wrong, and recovers once the fault is gone.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import itertools
import json
import logging
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pynvml
import pytest

from exporter.actions.engine import ActionBusy, ActionEngine, parse_actions
from exporter.config.yamlconf import parse_document
from exporter.core.fields import BY_KEY, FieldValue
from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.core.selection import Policy, recommend
from exporter.core.snapshot import Gpu, Snapshot
from exporter.exposition.metrics import render
from exporter.sampling.collect import Collector
from exporter.sampling.sampler import Sampler
from exporter.sampling.stats import SelfStats
from exporter.simulate.driver import FIELD_FUNCTIONS, SimulatedDriver
from tests.agent import healthz_until, http_get, serve, stderr_of
from tests.helpers import one, samples, write
from tests.test_procfs import FakeProc
from tests.test_reaper import (
    BASE,
    Job,
    alive,
    scenario,
    start_job,
    wait_exited,
)


def _now_only(gpus: tuple[Gpu, ...]) -> tuple[Gpu, ...]:
    """The GPUs without what depends on the samples before (how long a process has been idle)
    or on the host's clock (when the slow readings were read)."""
    return tuple(
        replace(
            g,
            slow_read_at=None,
            processes=tuple(replace(p, gpu_idle_seconds=None) for p in g.processes)
            if g.processes is not None
            else None,
        )
        for g in gpus
    )


# -- a hung NVML call, end to end --------------------------------------------------------------


def _scrape(port: int) -> dict[str, list[Any]]:
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200, body
    return samples(body.encode())


def test_hung_nvml_call_serves_the_last_snapshot_reports_staleness_and_recovers(tmp_path):
    scenario_file = write(
        tmp_path,
        """
        gpus:
          - temperature: {from: 40, to: 80, over: 60s}
            errors: [{field: power, hang: 5s, from: 3.5s, until: 4.5s}]
        """,
        "hang.yaml",
    )
    args = ("--simulate", scenario_file, "--interval", "0.2", "--deadline", "1")
    with serve(tmp_path, *args) as (agent, port):
        assert healthz_until(agent, port, "ok") == 200
        assert healthz_until(agent, port, "stale") == 503  # the hang has begun
        during = [_scrape(port)]
        first_age = one(during[0], "gpu_exporter_snapshot_age_seconds")
        deadline = time.monotonic() + 10
        while one(later := _scrape(port), "gpu_exporter_snapshot_age_seconds") < first_age + 0.4:
            assert time.monotonic() < deadline, "the served Snapshot did not age"
        during.append(later)  # still hung, a while later
        for found in during:  # answered from the last Snapshot, its values still there
            assert one(found, "gpu_exporter_snapshot_stale") == 1
            assert one(found, "gpu_up", gpu="0") == 1
            assert one(found, "gpu_power_watts", gpu="0") == 70
        stamps = [one(f, "gpu_exporter_last_sample_timestamp_seconds") for f in during]
        temperatures = [one(f, "gpu_temperature_celsius", gpu="0") for f in during]
        ages = [one(f, "gpu_exporter_snapshot_age_seconds") for f in during]
        assert stamps[0] == stamps[1] and temperatures[0] == temperatures[1]
        assert 1.2 < ages[0] < ages[1]
        assert healthz_until(agent, port, "ok", timeout=15) == 200  # the call returned
        after = _scrape(port)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=5) == 0
        stderr = stderr_of(agent)
    assert one(after, "gpu_exporter_snapshot_stale") == 0
    assert one(after, "gpu_exporter_last_sample_timestamp_seconds") > stamps[0]
    assert one(after, "gpu_temperature_celsius", gpu="0") > temperatures[0]
    assert one(after, "gpu_exporter_sample_deadline_exceeded_total") == 1
    assert stderr.count("past its 1.0s deadline") == 1, stderr
    assert "Traceback" not in stderr


# -- random NVML errors of every class ---------------------------------------------------------

ERROR_CLASSES = [getattr(pynvml, n) for n in sorted(dir(pynvml)) if n.startswith("NVMLError_")]

CHANGING = """
gpus:
  - name: GPU A
    memory_used: {from: 1GiB, to: 60GiB, over: 2000s}
    utilization: {from: 0.01, to: 0.99, over: 2000s}
    memory_utilization: {from: 0.02, to: 0.9, over: 2000s}
    temperature: {from: 30, to: 88, over: 2000s}
    memory_temperature: {from: 35, to: 90, over: 2000s}
    power: {from: 100, to: 600, over: 2000s}
    fan_speed: {from: 0.2, to: 0.9, over: 2000s}
    clocks_mhz:
      graphics: {from: 300, to: 1900, over: 2000s}
      sm: {from: 310, to: 1800, over: 2000s}
    ecc: {corrected: {from: 1, to: 900, over: 2000s}, uncorrected: {from: 1, to: 50, over: 2000s}}
    performance_state: 2
    fields:
      pcie_transmit_bytes: {from: 0, to: 9e12, over: 2000s}
      clock_event_seconds_sw_power_cap: {from: 0, to: 900, over: 2000s}
      remapped_rows_correctable: {from: 0, to: 3, over: 2000s}
    nvlink:
      links: 4
      down: [{link: 2, from: 100s, until: 200s}]
      per_link: {1: {nvlink_errors_replay: {from: 0, to: 400, over: 2000s}}}
    processes:
      - {pid: self, memory: {from: 1MiB, to: 5GiB, over: 2000s}}
      - {pid: self, memory: 3MiB, type: graphics}
  - name: GPU B
    temperature: {from: 40, to: 80, over: 2000s}
    power: {from: 50, to: 250, over: 2000s}
    memory_used: {from: 5GiB, to: 7GiB, over: 2000s}
  - name: GPU C
    memory_total: 40GiB
    utilization: {from: 0.9, to: 0.1, over: 2000s}
    ecc: {enabled: false}
"""


#: The return codes a field-value entry of its own gets from Chaos.
ENTRY_ERRORS = (
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_NO_PERMISSION,
    pynvml.NVML_ERROR_TIMEOUT,
    pynvml.NVML_ERROR_GPU_IS_LOST,
    pynvml.NVML_ERROR_INVALID_ARGUMENT,
    pynvml.NVML_ERROR_UNKNOWN,
)


class Chaos:
    """Wraps every simulated pynvml function: while ``on``, a call fails with probability
    ``rate``, raising the next of all pynvml's error classes in turn."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self.on = False
        self.rng = random.Random(seed)
        self.classes = itertools.cycle(ERROR_CLASSES)
        self.raised: Counter[str] = Counter()
        self.failed: list[tuple[str, int | None, str]] = []  # (function, GPU index, error)
        self.called: list[str] = []
        #: function ("*": any) -> the error its next call raises, whatever the rate
        self.forced: dict[str, str] = {}
        self.entry_errors: Counter[str] = Counter()

    def install(self, driver: SimulatedDriver) -> None:
        for name in driver.function_names:
            setattr(driver, name, self._wrap(name, getattr(driver, name)))

    def _spoil_entries(self, gpu: Any, values: Any) -> Any:
        """Give some entries of a field-value answer an error of their own (the call itself
        succeeded, as NVML's does when only some fields fail)."""
        for item in values:
            if self.rng.random() < self.rate:
                code = self.rng.choice(ENTRY_ERRORS)
                item.nvmlReturn = code
                name = type(pynvml.NVMLError(code)).__name__
                self.failed.append((f"entry:{item.fieldId}@{item.scopeId}", gpu, name))
                self.entry_errors[name] += 1
        return values

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.called.append(name)
                forced = self.forced.pop(name, None) or self.forced.pop("*", None)
                if forced or self.rng.random() < self.rate:
                    error = getattr(pynvml, f"NVMLError_{forced}") if forced else next(self.classes)
                    gpu = getattr(args[0], "index", args[0]) if args else None
                    self.failed.append(
                        (name, gpu if isinstance(gpu, int) else None, error.__name__)
                    )
                    self.raised[error.__name__] += 1
                    raise error()
            answer = fn(*args, **kwargs)
            if self.on and name == "nvmlDeviceGetFieldValues":
                return self._spoil_entries(getattr(args[0], "index", None), answer)
            return answer

        call.__module__ = fn.__module__
        return call

    def sample(self, collector: Collector) -> Snapshot:
        """One sample of ``collector`` with faults on; what failed is in ``failed``."""
        self.failed, self.called, self.on = [], [], True
        try:
            return collector.sample()
        finally:
            self.on = False


#: Gpu attribute -> the scenario field (simulate.FIELD_FUNCTIONS) and Nvml field names behind it
#: (the readings of core.fields, power and energy among them: _check_readings).
DYNAMIC: dict[str, tuple[str, tuple[str, ...]]] = {
    "memory_used_bytes": ("memory", ("memory",)),
    "memory_free_bytes": ("memory", ("memory",)),
    "memory_reserved_bytes": ("memory", ("memory",)),
    "utilization_ratio": ("utilization", ("utilization",)),
    "memory_utilization_ratio": ("utilization", ("utilization",)),
    "temperature_celsius": ("temperature", ("temperature",)),
    "fan_speed_ratio": ("fan_speed", ("fan_speed",)),
    "performance_state": ("performance_state", ("performance_state",)),
    "clock_event_reasons": ("clock_event_reasons", ("clock_event_reasons",)),
    "processes": ("processes", ("compute_processes", "graphics_processes")),
}
#: GpuInfo attribute -> the scenario field and Nvml field names behind it.
STATIC: dict[str, tuple[str, tuple[str, ...]]] = {
    "serial": ("serial", ("serial",)),
    "minor_number": ("minor_number", ("minor_number",)),
    "memory_total_bytes": ("memory", ("memory",)),
    "power_limit_watts": ("power_limit", ("power_limit",)),
    "ecc_enabled": ("ecc", ("ecc_mode",)),
    "pci_bus_id": ("pci_info", ("pci_info",)),
}


def _remembered(nvml: Nvml, index: int, field: str, names: tuple[str, ...]) -> bool:
    """Whether the Nvml module remembers the field as unsupported or its calls as missing."""
    functions = FIELD_FUNCTIONS.get(field, ())
    return any((index, name) in nvml.unsupported() for name in names) or any(
        key.startswith(fn) for key in nvml.missing() for fn in functions
    )


def _failed_now(chaos: Chaos, index: int, field: str) -> bool:
    functions = FIELD_FUNCTIONS[field]
    return any(fn in functions and gpu == index for fn, gpu, _ in chaos.failed)


def _check_gpu(chaos: Chaos, nvml: Nvml, got: Gpu, want: Gpu) -> None:
    """``got`` (sampled under faults) against ``want`` (the same moment without): every value
    right or absent, every absence explained by a failure now or one the agent remembers."""
    i = got.index
    assert got.uuid in (want.uuid, ""), "a GPU never takes another's UUID"
    if not got.up:
        assert any(gpu == i for _, gpu, _ in chaos.failed), f"GPU {i} down for no reason"
        assert all(getattr(got, attr) is None for attr in DYNAMIC), got
        assert not got.clocks_hz and not got.ecc_errors
        return
    # a driver without memory info v2 (as NVML said on the first call): v1's answer, reserved
    # memory counted as used
    v1 = "nvmlDeviceGetMemoryInfo_v2" in nvml.missing() and got.memory_reserved_bytes is None
    for attr, (field, names) in DYNAMIC.items():
        value, expected = getattr(got, attr), getattr(want, attr)
        if attr == "processes" and value is not None:  # kinds of list the GPU lacks are left out
            lacks = {
                kind
                for kind in ("compute", "graphics")
                if (i, f"{kind}_processes") in nvml.unsupported()
            }
            value = sorted((p.pid, p.type, p.used_memory_bytes) for p in value)
            expected = sorted(
                (p.pid, p.type, p.used_memory_bytes) for p in expected if p.type not in lacks
            )
        if v1 and attr == "memory_used_bytes" and value is not None:
            expected += want.memory_reserved_bytes  # type: ignore[operator]
        if v1 and attr == "memory_reserved_bytes":
            expected = None
        if value is None and expected is not None:
            assert _failed_now(chaos, i, field) or _remembered(nvml, i, field, names), (i, attr)
        else:
            assert value == expected, (i, attr, value, expected, chaos.failed)
    value, expected = dict(got.clocks_hz), dict(want.clocks_hz)
    for key in expected.keys() - value.keys():
        explained = _failed_now(chaos, i, "clocks")
        assert explained or _remembered(nvml, i, "clocks", (f"clock_{key}",)), (i, key)
    assert {k: expected[k] for k in value} == value, (i, value, expected)
    _check_readings(chaos, nvml, got, want)
    for attr, (field, names) in STATIC.items():
        value, expected = getattr(got.info, attr), getattr(want.info, attr)
        if value != expected:
            assert value in (None, ""), (i, attr, value, expected)
            assert i in nvml.incomplete or _remembered(nvml, i, field, names), (i, attr)
    value, expected = dict(got.info.temperature_thresholds), want.info.temperature_thresholds
    assert {k: expected[k] for k in value} == value
    for key in expected.keys() - value.keys():
        assert i in nvml.incomplete or _remembered(nvml, i, "thresholds", (f"threshold_{key}",))
    assert (got.info.uuid, got.info.name) == (want.info.uuid, want.info.name)


def _reading_failed(chaos: Chaos, nvml: Nvml, gpu: Gpu, key: str, link: int | None) -> bool:
    """Whether a reading of ``core.fields`` that ``gpu`` lacks is explained: its function (or
    the one field-value call) failed now, its own entry did, or a gap is remembered."""
    reading = BY_KEY[key]
    i = gpu.index
    name = key if link is None else f"{key}@{link}"
    if reading.requires_ecc and not gpu.info.ecc_enabled:
        return True
    if link is not None and link >= gpu.info.nvlink_links:  # the link count failed to read
        return i in nvml.incomplete or _remembered(nvml, i, "field_values", ("nvlink_links",))
    names = (name, "field_values", *FIELD_FUNCTIONS[key])  # a function reading: by function
    if _failed_now(chaos, i, key) or _remembered(nvml, i, key, names):
        return True
    ids = {reading.field_id(link)} if isinstance(reading.source, FieldValue) else set()
    return any(
        fn.startswith("entry:") and int(fn[6:].partition("@")[0]) in ids and g == i
        for fn, g, _ in chaos.failed
    )


def _check_readings(chaos: Chaos, nvml: Nvml, got: Gpu, want: Gpu) -> None:
    """Every reading of ``core.fields`` (per GPU and per link) right or explained absent."""
    for key, expected in want.fields.items():
        if key not in got.fields:
            assert _reading_failed(chaos, nvml, got, key, None), (got.index, key)
        else:
            assert got.fields[key] == expected, (got.index, key, got.fields[key], expected)
    for link, values in want.nvlink.items():
        for key, expected in values.items():
            value = got.nvlink.get(link, {}).get(key)
            if value is None:
                assert _reading_failed(chaos, nvml, got, key, link), (got.index, link, key)
            else:
                assert value == expected, (got.index, link, key, value, expected)
    assert got.fields.keys() <= want.fields.keys()


def _check_exposition(got: Snapshot, want: Snapshot) -> None:
    """Every per-GPU series exported under faults is one the faultless sample exports too,
    with the same labels and value (identity labels may be empty)."""
    stats = SelfStats(interval_seconds=1)
    faulty, right = samples(render(got, stats)), samples(render(want, stats))
    truth = {(n, tuple(sorted(s.labels.items()))): s.value for n, ss in right.items() for s in ss}
    v1_gpus = {
        str(g.index)
        for g, w in zip(got.gpus, want.gpus, strict=False)
        if g.up and g.memory_reserved_bytes is None and w.memory_reserved_bytes is not None
    }
    for name, found in faulty.items():
        for sample in found:
            gpu = sample.labels.get("gpu")
            if gpu is None:
                continue
            state = got.gpus[int(gpu)]
            if name == "gpu_up":
                assert sample.value == (1 if state.up else 0)
                continue
            if name == "gpu_info":
                wanted = next(s.labels for s in right["gpu_info"] if s.labels["gpu"] == gpu)
                assert all(v in ("", wanted[k]) for k, v in sample.labels.items()), sample
                continue
            assert state.up, f"a series other than gpu_up and gpu_info for failed GPU {gpu}"
            if gpu in v1_gpus and name.startswith("gpu_memory_"):
                continue
            key = (name, tuple(sorted(sample.labels.items())))
            assert truth.get(key) == sample.value, (sample, truth.get(key))


def test_random_errors_of_every_class_never_crash_nor_export_a_wrong_value(simulated, clock):
    driver = simulated(CHANGING)
    chaos = Chaos(rate=0.03, seed=7)
    chaos.install(driver)
    # slow readings at every sample: a faulty read retried later would compare with another
    # moment's clean one (the slow cadence has tests of its own, in test_fields.py)
    faulty = Collector(
        Nvml(library=driver, slow_seconds=0), ProcFs(), monotonic=clock, clock=lambda: clock.now
    )
    clean = Collector(
        Nvml(library=driver, slow_seconds=0), ProcFs(), monotonic=clock, clock=lambda: clock.now
    )
    seen = Counter()
    try:
        for _ in range(400):
            clock.advance(1)
            driver.nvmlInit()  # the faulty collector may have shut the simulated driver down
            want = clean.sample()
            got = chaos.sample(faulty)
            assert want.nvml_up and all(g.up for g in want.gpus)
            _check_exposition(got, want)
            if not got.nvml_up:
                assert got.gpus == ()
                assert "nvmlInit" not in chaos.called or chaos.failed  # backoff, or a failure
                seen["nvml down"] += 1
                continue
            assert len(got.gpus) == len(want.gpus)
            for g, w in zip(got.gpus, want.gpus, strict=True):
                _check_gpu(chaos, faulty.nvml, g, w)
                seen["gpu down" if not g.up else "gpu up"] += 1
            for attr in ("driver_version", "cuda_version", "nvml_version"):
                value = getattr(got.host, attr)
                assert value in ("", getattr(want.host, attr)), (attr, value)
                if not value:
                    assert (
                        -1 in faulty.nvml.incomplete
                        or any(key[0] == -1 for key in faulty.nvml.unsupported())
                        or any(key.startswith("nvmlSystem") for key in faulty.nvml.missing())
                    )
        assert set(chaos.raised) == {cls.__name__ for cls in ERROR_CLASSES}  # every class
        assert len(chaos.entry_errors) == len(ENTRY_ERRORS)  # and every entry error
        assert seen["nvml down"] and seen["gpu down"] and seen["gpu up"] > 600
        # The faults end; NVML is lost once more (what forgets remembered gaps): all comes back.
        chaos.rate = 0
        clock.advance(100)  # past any backoff
        chaos.sample(faulty)
        chaos.forced = {"*": "Uninitialized"}
        assert not chaos.sample(faulty).nvml_up and not chaos.forced
        clock.advance(100)
        driver.nvmlInit()
        want = clean.sample()
        got = chaos.sample(faulty)
        assert chaos.failed == []
        assert _now_only(got.gpus) == _now_only(want.gpus) and got.host == want.host
    finally:
        faulty.close()
        clean.close()


def test_a_host_fact_failing_with_a_gpu_error_is_not_a_crash(simulated, collector, clock):
    driver = simulated("gpus: [{}]\n")
    real = driver.nvmlSystemGetNVMLVersion

    def lost() -> str:
        raise pynvml.NVMLError_Unknown()

    driver.nvmlSystemGetNVMLVersion = lost
    snap = collector.sample()  # used to raise GpuFailed out of the sample
    assert snap.nvml_up and snap.gpus[0].up
    assert snap.host.nvml_version == "" and snap.host.driver_version == "550.54.15"
    driver.nvmlSystemGetNVMLVersion = real
    clock.advance(1)
    assert collector.sample().host.nvml_version == "12.550.54.15"  # read again, not for good


def test_static_facts_a_transient_error_left_out_are_read_again_with_backoff(
    simulated, collector, clock
):
    driver = simulated(
        "gpus: [{errors: [{field: minor_number, error: Timeout}], power_limit: 300}]\n"
    )
    first = collector.sample().gpus[0]
    assert first.up and first.info.minor_number is None and first.info.power_limit_watts == 300
    reads = []
    for _ in range(8):  # 8 s: tried again after 1, 2 and 4 s (then 8 s), not every sample
        clock.advance(1)
        before = driver.calls["nvmlDeviceGetMinorNumber"]
        assert collector.sample().gpus[0].info.minor_number is None
        reads.append(driver.calls["nvmlDeviceGetMinorNumber"] - before)
    assert reads == [1, 0, 1, 0, 0, 0, 1, 0]
    # dynamic fields: every sample; the NVLink link count with each read of the static facts
    assert driver.calls["nvmlDeviceGetFieldValues"] == 9 + 1 + 3


def test_a_mig_device_that_failed_to_read_is_read_again(simulated, collector, clock):
    driver = simulated("gpus: [{mig_devices: [MIG-1111, MIG-2222]}]\n")
    chaos = Chaos(rate=0, seed=0)
    chaos.install(driver)
    chaos.forced = {"nvmlDeviceGetMigDeviceHandleByIndex": "Timeout"}  # the first slot
    assert chaos.sample(collector).gpus[0].info.mig_uuids == ("MIG-2222",)
    clock.advance(1)
    assert collector.sample().gpus[0].info.mig_uuids == ("MIG-1111", "MIG-2222")


def test_a_failed_process_list_is_absent_not_short(simulated, collector):
    driver = simulated(
        """
        gpus:
          - processes: [{pid: self, memory: 1GiB}, {pid: self, memory: 1MiB, type: graphics}]
        """
    )
    chaos = Chaos(rate=0, seed=0)
    chaos.install(driver)
    chaos.forced = {"nvmlDeviceGetComputeRunningProcesses_v3": "Timeout"}  # graphics answers
    snap = chaos.sample(collector)
    gpu = snap.gpus[0]
    assert gpu.up and gpu.processes is None  # not a list without the compute process
    found = samples(render(snap, SelfStats(1)))
    assert "gpu_processes" not in found and "gpu_process_memory_used_bytes" not in found
    assert [(e.source, e.field, e.error) for e in snap.errors] == [
        ("field", "compute_processes", "Timeout")
    ]
    assert len(collector.sample().gpus[0].processes) == 2


@pytest.mark.parametrize(
    ("function", "error"),
    [
        ("nvmlDeviceGetMemoryInfo", "FunctionNotFound"),
        ("nvmlDeviceGetFieldValues", "NotSupported"),
    ],
)
def test_a_call_that_answered_is_not_remembered_missing_or_unsupported(
    simulated, collector, clock, function, error
):
    driver = simulated("gpus: [{memory_used: 10GiB, memory_reserved: 1GiB, power: 300}]\n")
    chaos = Chaos(rate=0, seed=0)
    chaos.install(driver)
    first = collector.sample().gpus[0]
    clock.advance(1)
    chaos.forced = {function: error}  # it answered a moment ago
    failed = chaos.sample(collector)
    assert [(e.source, e.error) for e in failed.errors] == [("field", error)]
    assert (failed.gpus[0].memory_used_bytes, failed.gpus[0].power_watts).count(None) == 1
    clock.advance(1)
    again = collector.sample().gpus[0]  # asked again, and the same call: v2 memory, reserved
    assert again.memory_used_bytes == first.memory_used_bytes == 10 * 1024**3  # not counted
    assert again.memory_reserved_bytes == 1024**3 and again.power_watts == 300


def test_nvml_lost_while_the_host_facts_are_read_is_nvml_down_not_half_up(
    simulated, collector, clock
):
    driver = simulated("gpus: [{}]\n")
    chaos = Chaos(rate=0, seed=0)
    chaos.install(driver)
    chaos.forced = {"nvmlSystemGetDriverVersion": "LibraryNotFound"}  # just after nvmlInit
    down = chaos.sample(collector)
    assert not down.nvml_up and down.gpus == () and "LibraryNotFound" in down.nvml_error
    assert not collector.nvml.initialized
    clock.advance(1)
    up = collector.sample()
    assert up.nvml_up and up.gpus[0].up and up.host.driver_version == "550.54.15"


# -- GPUs that go, come back, change places; a driver that changes ----------------------------


def test_a_gpu_replaced_at_its_index_is_not_shown_twice_and_actions_follow_uuids(
    simulated, collector, clock
):
    simulated(
        """
        gpus:
          - {name: GPU A, memory_used: 40GiB, present: {until: 10s}}
          - {name: GPU B, memory_used: 70GiB}
          - {name: GPU C, memory_used: 10GiB, present: {from: 10s}}
        """
    )
    sampler = Sampler(collector, interval=5, deadline=5, monotonic=clock, render=render)
    uuids = {}
    for _ in range(6):  # A leaves and C arrives at once: two GPUs all along
        snap = sampler.sample_once().snapshot
        uuids.update({g.info.name: g.uuid for g in snap.gpus if g.info and g.up})
        clock.advance(5)
    latest = sampler.latest.snapshot
    assert [(g.index, g.info.name, g.uuid, g.up) for g in latest.gpus] == [
        (0, "GPU B", uuids["GPU B"], True),
        (1, "GPU C", uuids["GPU C"], True),
    ]
    assert latest.gpus[1].memory_used_bytes == 10 * 1024**3
    found = samples(sampler.latest.exposition)
    assert one(found, "gpu_memory_used_bytes", gpu="1", uuid=uuids["GPU C"]) == 10 * 1024**3
    assert len(found["gpu_up"]) == 2
    # windowed means follow the UUID across the move: B's history at index 1 still counts
    rec = recommend(Policy("default", window=6), sampler.history())
    assert [(c.index, c.uuid) for c in rec.chosen] == [(1, uuids["GPU C"])]
    assert rec.indexes == {uuids["GPU B"]: 0, uuids["GPU C"]: 1}


def test_a_failing_gpu_after_a_reinit_never_borrows_the_uuid_of_one_that_moved(
    simulated, collector, clock
):
    simulated(
        """
        driver: {errors: [{field: count, error: DriverNotLoaded, from: 8s, until: 12s}]}
        gpus:
          - {name: GPU A, present: {until: 10s}}
          - {name: GPU B}
          - {name: GPU C, present: {from: 10s}, errors: [{error: GpuIsLost, from: 10s}]}
        """
    )
    before = collector.sample()
    uuid_b = before.gpus[1].uuid
    for _ in range(4):
        clock.advance(5)
        snap = collector.sample()
    assert snap.nvml_up
    b, c = snap.gpus
    assert (b.index, b.uuid, b.up) == (0, uuid_b, True)
    assert (c.index, c.up) == (1, False)
    assert c.uuid == "" and c.info is None  # unknown, never "GPU B, down"
    ups = samples(render(snap, SelfStats(1)))["gpu_up"]
    assert sorted((s.labels["gpu"], s.labels["uuid"], s.value) for s in ups) == [
        ("0", uuid_b, 1.0),
        ("1", "", 0.0),
    ]


def test_driver_version_changes_across_a_reinit(simulated, collector, clock):
    driver = simulated(
        """
        gpus:
          - errors: [{field: memory, error: DriverNotLoaded, from: 10s, until: 11s}]
          - {}
        """
    )
    version = ["550.54.15"]
    driver.nvmlSystemGetDriverVersion = lambda: version[0]

    def infos() -> list[tuple[str, str]]:
        found = samples(render(collector.sample(), SelfStats(1)))
        return sorted(
            (s.labels["gpu"], s.labels["driver_version"]) for s in found.get("gpu_info", [])
        )

    assert infos() == [("0", "550.54.15"), ("1", "550.54.15")]
    clock.advance(10)
    version[0] = "560.35.03"  # the driver is upgraded while NVML is down
    assert infos() == []
    clock.advance(1)
    assert infos() == [("0", "560.35.03"), ("1", "560.35.03")]
    assert collector.sample().host.driver_version == "560.35.03"


# -- procfs races, denied reads, hostile names ----------------------------------------------------


OLD = {"comm": b"trainer", "cmdline": b"python3\0train.py\0", "uid": 4242, "starttime": 1000}
NEW = {"comm": b"intruder", "cmdline": b"evil\0--steal\0", "uid": 4343, "starttime": 2000}


def _make(fake: FakeProc, pid: int, what: dict[str, Any]) -> None:
    piddir = fake.add(pid, what["comm"], cmdline=what["cmdline"], starttime=what["starttime"])
    if os.geteuid() == 0:  # only root can give it another owner
        os.chown(piddir, what["uid"], -1)


def _who(info: Any) -> tuple[Any, ...]:
    return (info.name, info.cmdline, info.start_ticks, info.uid)


def _expected(what: dict[str, Any]) -> tuple[Any, ...]:
    args = tuple(part.decode() for part in what["cmdline"].split(b"\0") if part)
    uid = what["uid"] if os.geteuid() == 0 else os.geteuid()
    return (what["comm"].decode(), args, what["starttime"], uid)


def _end(fake: FakeProc, pid: int, reused: bool) -> None:
    """The process exits and is reaped; when ``reused``, a new process gets its PID."""
    shutil.rmtree(fake.root / str(pid))
    if reused:
        _make(fake, pid, NEW)


class Interrupt:
    """Runs ``event`` at the ``at``-th file access under ``root`` (open, os.open, stat), the
    way a process ends, or its PID is reused, between two reads of procfs."""

    def __init__(self, root: Path, at: int, event: Callable[[], None]) -> None:
        self.root, self.at, self.event, self.count = str(root), at, event, 0

    def __enter__(self) -> Interrupt:
        self.saved = builtins.open, os.open, os.stat, os.lstat

        def hook(real: Callable[..., Any]) -> Callable[..., Any]:
            def call(path: Any, *args: Any, **kwargs: Any) -> Any:
                under = "dir_fd" in kwargs or str(path).startswith(self.root)
                if under and not isinstance(path, int):
                    self.count += 1
                    if self.count - 1 == self.at:
                        self.event()  # its own file accesses count past ``at``
                return real(path, *args, **kwargs)

            return call

        builtins.open, os.open, os.stat, os.lstat = (hook(f) for f in self.saved)
        return self

    def __exit__(self, *exc: object) -> None:
        builtins.open, os.open, os.stat, os.lstat = self.saved


@pytest.mark.parametrize("warm", [False, True], ids=["first-sight", "known"])
@pytest.mark.parametrize("event", ["exits", "pid-reused"])
def test_a_process_that_ends_between_any_two_reads_is_whole_or_not_visible(tmp_path, event, warm):
    old, new = _expected(OLD), _expected(NEW)
    outcomes = set()
    for at in itertools.count():  # the end comes before the first read, the second, ...
        (tmp_path / f"proc{at}").mkdir()
        fake = FakeProc(tmp_path / f"proc{at}")
        _make(fake, 77, OLD)
        procfs = fake.procfs()
        if warm:  # its command line is already known
            assert _who(procfs.process(77)) == old
        end = functools.partial(_end, fake, 77, event == "pid-reused")
        with Interrupt(fake.root, at, end) as interrupt:
            info = procfs.process(77)  # never raises
        outcome = None if info is None else _who(info)
        assert outcome in (None, old, new), (at, outcome)  # whole, never half or mixed
        outcomes.add(outcome)
        if interrupt.count <= at:  # every read has had its turn
            break
    assert at >= 2 and None in outcomes
    end()  # and once it has happened, the PID is what is there now
    now = procfs.process(77)
    assert (now and _who(now)) == (new if event == "pid-reused" else None)


@contextlib.contextmanager
def _denied(name: str) -> Iterator[None]:
    """Opening a file called ``name`` (in any procfs tree) fails with EACCES, as for a process
    of another user under a hardened kernel."""
    real_open, real_os_open = builtins.open, os.open

    def check(path: Any) -> None:
        if not isinstance(path, int) and os.path.basename(str(path)) == name:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

    def fake_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        check(path)
        return real_open(path, *args, **kwargs)

    def fake_os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        check(path)
        return real_os_open(path, *args, **kwargs)

    builtins.open, os.open = fake_open, fake_os_open
    try:
        yield
    finally:
        builtins.open, os.open = real_open, real_os_open


@pytest.mark.parametrize("name", ["stat", "cmdline", "cgroup"])
def test_permission_denied_on_a_procfs_file(tmp_path, name):
    fake = FakeProc(tmp_path)
    fake.add(88, b"secretjob", cgroup=b"0::/docker/" + b"ab" * 32 + b"\n")
    with _denied(name):
        info = fake.procfs().process(88)
    if name == "stat":
        assert info is None  # nothing known: not visible
        return
    assert info is not None and info.name == "secretjob" and info.uid == os.geteuid()
    assert info.cmdline == (() if name == "cmdline" else ("python3", "train.py"))
    assert info.container_id == ("" if name == "cgroup" else "ab" * 32)


def test_huge_procfs_files_are_read_bounded(tmp_path):
    fake = FakeProc(tmp_path)
    container = b"cd" * 32
    fake.add(
        99,
        b"a" * 15,  # the kernel's cut of a long program name
        cmdline=b"/opt/" + b"a" * 3_000_000 + b"\0--flag\0",
        cgroup=b"0::/" + b"x" * 2_000_000 + b"/docker/" + container + b"\n",
    )
    info = fake.procfs().process(99)
    assert info is not None
    assert info.name.startswith("aaa") and len(info.name.encode()) <= 4096  # the process label
    assert len(info.cmdline) == 1 and len(info.cmdline[0]) == 4096  # "--flag" is past the cut
    assert info.container_id == ""  # past what is read of the file (1 MiB)


_UNPRIVILEGED_READER = """
import json, os, sys
from exporter.core.procfs import ProcFs, file_identity, scan_fd_holders
pid, device = int(sys.argv[1]), sys.argv[2]
identity = file_identity(device)
os.setgroups([]); os.setgid(65534); os.setuid(65534)
info = ProcFs().process(pid)
holders, unreadable = scan_fd_holders("/proc", {identity: "gpu0"})
print(json.dumps({"user": info.user, "cmdline": info.cmdline, "holders": sorted(holders),
                  "unreadable": pid in unreadable}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_real_proc_of_another_user_read_without_privileges(tmp_path):
    device = tmp_path / "nvidia0"
    device.write_text("")
    holder = subprocess.Popen(
        [sys.executable, "-c", f"f = open({str(device)!r}); import time; time.sleep(30)"]
    )
    try:
        reader = subprocess.run(
            [sys.executable, "-c", _UNPRIVILEGED_READER, str(holder.pid), str(device)],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=Path(__file__).parent.parent,
        )
    finally:
        holder.kill()
        holder.wait()
    assert reader.returncode == 0, reader.stderr
    seen = json.loads(reader.stdout)
    assert seen["user"] == "root" and seen["cmdline"][0] == sys.executable
    assert seen["holders"] == [] and seen["unreadable"]  # unknown, said so: not "holds nothing"


def test_a_user_name_that_is_not_utf8_is_escaped_not_a_failed_scrape(
    simulated, collector, monkeypatch
):
    real = pwd.getpwuid

    class Entry:
        pw_name = b"caf\xe9-\xff".decode("utf-8", "surrogateescape")  # what pwd gives for it

    monkeypatch.setattr(pwd, "getpwuid", lambda uid: Entry() if uid == os.geteuid() else real(uid))
    simulated("gpus: [{processes: [{pid: self, memory: 1GiB}]}]\n")
    snap = collector.sample()
    assert snap.gpus[0].processes[0].user == "caf\\xe9-\\xff"
    found = samples(render(snap, SelfStats(1)))  # used to raise UnicodeEncodeError
    (series,) = found["gpu_process_memory_used_bytes"]
    assert series.labels["user"] == "caf\\xe9-\\xff"
    json.dumps(snap.to_dict(), ensure_ascii=False).encode()


# -- actions: a run that raises, a reload mid-run, a full disk -----------------------------------


def _device(tmp_path: Path) -> str:
    """A stand-in for /dev/nvidia0 (its folder is the engine's ``paths.dev``)."""
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").touch()
    return str(tmp_path / "dev" / "nvidia0")


def _engine(simulated, collector, clock, tmp_path: Path, audit: Path, job: Job) -> ActionEngine:
    """An engine whose reaper kills (dry_run off), over a GPU that ``job`` holds."""
    dev = tmp_path / "dev"
    simulated(scenario(job.listed()))
    config = parse_actions(
        parse_document(
            "actions:\n  zombie_reaper:\n"
            f"    {{dry_run: false, audit_log: {audit}, protect_users: [nobody]}}\n",
            "c.yaml",
        )
        .root()
        .section("actions")
    )
    sampler = Sampler(collector, interval=5, deadline=5, monotonic=clock, render=render)
    return ActionEngine(
        sampler, config, ProcFs(), str(dev), clock=lambda: BASE + clock.now, monotonic=clock
    )


def _run(engine: ActionEngine, clock, seconds: float = 60) -> bool:
    clock.advance(seconds)
    engine.sampler.sample_once()
    return engine.run("zombie_reaper")


def _records(audit: Path) -> list[dict[str, Any]]:
    """Every line of the audit log, each of which must be a whole JSON object."""
    lines = audit.read_text().splitlines() if audit.exists() else []
    return [json.loads(line) for line in lines]


def _watch_signals(monkeypatch, audit: Path) -> list[int]:
    """Record the pids signalled through pidfds, checking the audit log recorded each first."""
    real = signal.pidfd_send_signal
    sent: list[int] = []

    def send(pidfd: int, sig: int, *args: Any) -> None:
        last = _records(audit)[-1]
        assert last["event"] == "signalling" and last["signal"] == signal.Signals(sig).name
        sent.append(last["pid"])
        real(pidfd, sig, *args)

    monkeypatch.setattr(signal, "pidfd_send_signal", send)
    return sent


def _pidfds() -> int:
    """How many pidfds this process holds."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return links.count("anon_inode:[pidfd]")


@pytest.mark.parametrize("step", ["signal", "fd-scan"])
def test_a_reaper_run_that_raises_halfway_leaves_the_audit_log_consistent(
    simulated, collector, clock, tmp_path, subreaper, monkeypatch, step
):
    audit = tmp_path / "audit.jsonl"
    job = start_job(subreaper, _device(tmp_path))
    pid = job.worker
    engine = _engine(simulated, collector, clock, tmp_path, audit, job)
    assert _run(engine, clock, 0)  # the job's leader is seen on the GPU
    job.end()
    assert _run(engine, clock, 1)  # and its exit
    pidfds = _pidfds()
    if step == "signal":  # fails after the audit record was written, before the kill
        monkeypatch.setattr(signal, "pidfd_send_signal", lambda *a: 1 / 0)
    else:  # the descriptor scan fails midway
        monkeypatch.setattr(os, "readlink", lambda path, *a, **k: 1 / 0)
    assert not _run(engine, clock)  # the run raised: counted, the engine goes on
    monkeypatch.undo()
    assert engine.stats("zombie_reaper").failures == 1
    assert alive(pid)
    assert _pidfds() == pidfds  # no pidfd left behind
    records = _records(audit)
    if step == "signal":
        assert [r["event"] for r in records] == ["found", "signalling", "signal_failed"]
        assert "ZeroDivisionError" in records[-1]["error"] and records[-1]["pid"] == pid
    else:
        assert records == []
    sent = _watch_signals(monkeypatch, audit)
    assert _run(engine, clock, 1)  # the next run carries on: recorded, then signalled
    wait_exited(pid)
    assert sent == [pid]
    assert [r["event"] for r in _records(audit)][-1:] == ["signalling"]
    engine.stop()


def test_a_reload_in_the_middle_of_a_run_waits_for_it_and_applies_whole(
    simulated, collector, clock, tmp_path
):
    simulated("gpus: [{name: GPU A}, {name: GPU B}]\n")
    sampler = Sampler(collector, interval=5, deadline=5, monotonic=clock, render=render)
    sampler.sample_once()
    engine = ActionEngine(
        sampler,
        parse_actions(parse_document("{}", "c.yaml").root().section("actions")),
        ProcFs(),
        str(tmp_path),
        clock=lambda: BASE,
    )
    thermal, reaper = engine.action("thermal"), engine.action("zombie_reaper")
    entered, release = threading.Event(), threading.Event()
    real_run = thermal.run

    def blocking_run(snapshots: Any, now: float) -> None:
        entered.set()
        assert release.wait(10)
        real_run(snapshots, now)

    thermal.run = blocking_run  # type: ignore[method-assign]
    results: list[bool] = []
    running = threading.Thread(target=lambda: results.append(engine.run("thermal")))
    running.start()
    assert entered.wait(5)
    new = parse_actions(
        parse_document(
            "actions:\n  zombie_reaper: {min_age: 5s}\n  thermal: {warning_celsius: 70}\n"
            "  recommend: {enabled: false}\n",
            "c.yaml",
        )
        .root()
        .section("actions")
    )
    with pytest.raises(ActionBusy, match="thermal"):  # the agent's main loop waits no longer
        engine.reload(new, timeout=0.2)
    assert reaper.config.min_age == 60 and engine.action("recommend") is not None  # nothing applied
    reloading = threading.Thread(target=engine.reload, args=(new,))
    reloading.start()
    reloading.join(0.5)
    try:  # while the run goes on, no action is configured anew: not one of them
        assert reloading.is_alive()
        assert reaper.config.min_age == 60 and engine.action("recommend") is not None
        assert engine.action("thermal") is thermal
    finally:
        release.set()
        running.join(10)
        reloading.join(10)
    assert results == [True]  # the run was not lost
    stats = engine.stats("thermal")
    assert (stats.runs, stats.failures) == (1, 0)  # nor run twice
    assert engine.config is new
    assert engine.action("zombie_reaper") is reaper and reaper.config.min_age == 5
    assert engine.action("thermal") is not thermal and engine.action("recommend") is None
    assert engine.run("thermal") and engine.stats("thermal").runs == 2
    engine.stop()


class Disk:
    """A small filesystem that the test fills: a 64 KiB tmpfs when this test may mount one,
    else a folder where ``os.write`` to its files fails with ENOSPC once it is "full"."""

    def __init__(self, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.path, self.monkeypatch = path, monkeypatch
        path.mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)]
        self.mounted = (
            os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0
        )
        self.full = False

    def fill(self) -> None:
        if self.mounted:
            fd = os.open(self.path / "filler", os.O_WRONLY | os.O_CREAT)
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * 4096):
                    pass
            os.close(fd)
        else:
            real = os.write
            room = [20]  # what is left: a write past it is cut short, the next one fails

            def write(fd: int, data: bytes) -> int:
                if not os.readlink(f"/proc/self/fd/{fd}").startswith(str(self.path)):
                    return real(fd, data)
                if not room[0]:
                    raise OSError(errno.ENOSPC, "No space left on device")
                written = real(fd, data[: room[0]])
                room[0] -= written
                return written

            self.monkeypatch.setattr(os, "write", write)
        self.full = True

    def free(self) -> None:
        if self.mounted:
            (self.path / "filler").unlink()
        else:
            self.monkeypatch.undo()
        self.full = False

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def disk(tmp_path, monkeypatch) -> Iterator[Disk]:
    made = Disk(tmp_path / "small", monkeypatch)
    yield made
    made.close()


def test_a_full_disk_under_the_audit_log_is_reported_and_nothing_is_killed_unrecorded(
    simulated, collector, clock, tmp_path, subreaper, disk, monkeypatch, caplog
):
    audit = disk.path / "audit.jsonl"
    job = start_job(subreaper, _device(tmp_path))
    pid = job.worker
    engine = _engine(simulated, collector, clock, tmp_path, audit, job)
    sent = _watch_signals(monkeypatch, audit)
    assert _run(engine, clock, 0)  # the job's leader is seen on the GPU: nothing to record yet
    job.end()
    assert _run(engine, clock, 1)  # its exit is seen
    # an earlier record that ends 20 bytes before a page boundary: the next line straddles it
    fd = os.open(audit, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.write(fd, b'{"pad": "' + b"x" * (4096 - 20 - len(b'{"pad": ""}\n')) + b'"}\n')
    os.close(fd)
    disk.fill()
    caplog.set_level(logging.WARNING)
    for _ in range(3):  # the disk stays full: each run goes on, nothing is signalled
        assert _run(engine, clock)
        assert engine.run("thermal")  # and the other actions go on
    assert alive(pid) and sent == []
    assert [r.get("pad") is not None for r in _records(audit)] == [True]  # no half line
    assert caplog.text.count("cannot write the audit log") == 1  # said once, not every run
    found = samples(engine.exposition())
    assert one(found, "gpu_exporter_audit_write_failures_total") >= 3
    assert one(found, "gpu_exporter_zombie_actions_total", action="skip", outcome="audit_failed")
    disk.free()
    sent = _watch_signals(monkeypatch, audit)
    assert _run(engine, clock, 1)
    wait_exited(pid)
    assert sent == [pid]
    assert [r["event"] for r in _records(audit)[1:]] == ["found", "signalling"]
    assert "is writable again" in caplog.text
    engine.stop()
