"""The readings declared as data (exporter/core/fields.py): the table itself, the one
field-value call per GPU per sample with its per-entry return codes, the slow cadence, the
exposition of every reading (present, unsupported, failed) and the docs written from the table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from exporter.core.fields import (
    BY_KEY,
    FIELD_READINGS,
    NVLINK_LINK_COUNT,
    READINGS,
    FieldValue,
    Function,
    GpmMetric,
    Reading,
)
from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.exposition.metrics import render
from exporter.sampling.collect import Collector
from exporter.sampling.stats import SelfStats
from exporter.simulate.scenario import LINK_READINGS
from tests.helpers import one, samples

ROOT = Path(__file__).resolve().parent.parent
METRICS_DOC = ROOT / "docs" / "metrics.md"
#: Readings the scenario sets through keys of their own, not ``fields:``.
OWN_KEYS = {"power", "power_instant", "energy", "memory_temperature"}
OWN_KEYS |= {"ecc_corrected", "ecc_uncorrected"}
LINKS = 14  # past NVML's per-link crc_data fields (links 0-11)


def _available(reading: Reading) -> bool:
    """Whether this nvidia-ml-py can read ``reading`` (12.535 lacks NVML 13's functions)."""
    import pynvml

    return not isinstance(reading.source, Function) or callable(
        getattr(pynvml, reading.source.name, None)
    )


def _value_of(reading: Reading) -> float:
    """A distinct value for each reading that survives NVML's units (whole raw numbers)."""
    if reading.equals is not None:
        return 1.0
    raw = 3 + READINGS.index(reading)  # raw units: the value NVML would answer
    return raw * reading.scale


def _everything() -> str:
    """A one-GPU scenario that sets every reading it can to a value of its own."""
    fields = {r.key: _value_of(r) for r in READINGS if r.key not in OWN_KEYS and not r.per_link}
    per_link = {r.key: _value_of(r) for r in READINGS if r.per_link}
    lines = [f"      {key}: {value!r}" for key, value in fields.items()]
    links = [f"          {key}: {value!r}" for key, value in per_link.items()]
    return "\n".join(
        [
            "gpus:",
            "  - name: NVIDIA H100 80GB HBM3",
            "    gpm: true",
            "    power: 250",
            "    memory_temperature: 45",
            "    ecc: {corrected: 4, uncorrected: 2}",
            "    fields:",
            *lines,
            "    nvlink:",
            f"      links: {LINKS}",
            "      per_link:",
            "        3:",
            *links,
            "",
        ]
    )


def _sample(collector: Collector):
    snap = collector.sample()
    return snap, samples(render(snap, SelfStats(interval_seconds=5)))


def _gpm(reading: Reading) -> bool:
    """A GPM reading: computed between two samples, so first present at the second."""
    return isinstance(reading.source, GpmMetric)


def _labels(reading: Reading, link: int | None = None) -> dict[str, str]:
    labels = dict(reading.labels)
    if link is not None:
        labels["link"] = str(link)
    return labels


# -- the table ------------------------------------------------------------------------------


def test_each_family_is_declared_alike():
    families: dict[str, list[Reading]] = {}
    for reading in READINGS:
        families.setdefault(reading.metric, []).append(reading)
    for metric, members in families.items():
        first = members[0]
        for other in members[1:]:  # one family: one type, help, unit, label names, cadence
            assert (other.kind, other.help, other.unit, other.per_link, other.cadence) == (
                first.kind,
                first.help,
                first.unit,
                first.per_link,
                first.cadence,
            ), metric
            assert [n for n, _ in other.labels] == [n for n, _ in first.labels], metric
        values = [tuple(r.labels) for r in members]
        assert len(set(values)) == len(values), f"{metric}: two readings with one label set"
        assert metric.startswith("gpu_") and re.fullmatch(r"[a-z0-9_]+", metric)
        assert metric.endswith("_total") == (first.kind == "counter"), metric
        if metric.endswith("_ratio"):
            assert first.unit == "0-1"


def test_field_ids_are_unique_and_not_restated_elsewhere():
    ids = [r.field_id(None) for r in FIELD_READINGS if not r.link_ids]
    ids += [i for r in FIELD_READINGS for i in r.link_ids]
    assert len(ids) == len(set(ids)), "a field id declared twice"
    assert NVLINK_LINK_COUNT not in ids
    # NVML's field ids live in core/fields.py only: the NVML layer and the simulation take them
    # from the table
    for path in ("exporter/core/nvml.py", "exporter/simulate/driver.py"):
        text = (ROOT / path).read_text()
        assert "NVML_FI_DEV" not in text, path


def test_the_pynvml_constants_the_table_names_have_its_numbers():
    import pynvml

    for reading in FIELD_READINGS:
        source = reading.source
        assert isinstance(source, FieldValue)
        number = getattr(pynvml, source.constant, None)
        if number is not None:  # an older nvidia-ml-py may lack the newer names
            assert number == source.id, (source.constant, number, source.id)


# -- present, with its value ------------------------------------------------------------------


def test_every_reading_is_exported_with_its_value(simulated, collector, clock):
    simulated(_everything())
    _, first = _sample(collector)
    assert not [r.key for r in READINGS if _gpm(r) and r.metric in first]  # nothing to compare
    clock.advance(1)
    snap, found = _sample(collector)
    gpu = snap.gpus[0]
    assert gpu.up and snap.errors == ()
    for reading in READINGS:
        if reading.per_link:
            for link in range(LINKS):
                present = reading.field_id(link) is not None
                got = [
                    s
                    for s in found.get(reading.metric, [])
                    if s.labels.items() >= _labels(reading, link).items()
                ]
                assert len(got) == (1 if present else 0), (reading.key, link)
            want = _value_of(reading)
            assert one(found, reading.metric, **_labels(reading, 3)) == pytest.approx(want)
            continue
        if reading.key in OWN_KEYS:
            continue
        if not _available(reading):
            assert reading.metric not in found, reading.key
            continue
        value = one(found, reading.metric, gpu="0", **_labels(reading))
        assert value == pytest.approx(_value_of(reading)), reading.key
    assert one(found, "gpu_power_watts", gpu="0") == 250
    assert one(found, "gpu_power_instant_watts", gpu="0") == 250
    assert one(found, "gpu_memory_temperature_celsius", gpu="0") == 45
    assert one(found, "gpu_ecc_errors_total", gpu="0", type="uncorrected") == 2
    # /snapshot carries every reading too
    body = snap.to_dict()["gpus"][0]
    assert body["fields"]["row_remap_pending"] == _value_of(BY_KEY["row_remap_pending"])
    assert body["nvlink"]["3"]["nvlink_errors_replay"] == _value_of(BY_KEY["nvlink_errors_replay"])
    assert body["power_watts"] == 250 and body["ecc_errors"] == {"corrected": 4, "uncorrected": 2}


def test_nvlink_down_and_links_without_fields(simulated, collector, clock):
    simulated(
        """
        gpus:
          - nvlink: {links: 14, down: [{link: 2, from: 10s}]}
          - name: NVIDIA GeForce RTX 4090
        """
    )
    _, found = _sample(collector)
    assert one(found, "gpu_nvlink_up", gpu="0", link="2") == 1
    assert {s.labels["link"] for s in found["gpu_nvlink_up"]} == {str(i) for i in range(14)}
    crc_data = {
        s.labels["link"] for s in found["gpu_nvlink_errors_total"] if s.labels["type"] == "crc_data"
    }
    assert crc_data == {str(i) for i in range(12)}  # NVML has the field for links 0-11 only
    assert not [s for s in found["gpu_nvlink_up"] if s.labels["gpu"] == "1"]  # no NVLink
    clock.advance(10)
    _, found = _sample(collector)
    assert one(found, "gpu_nvlink_up", gpu="0", link="2") == 0
    assert one(found, "gpu_nvlink_up", gpu="0", link="1") == 1


# -- absent: unsupported, and older drivers ------------------------------------------------------


@pytest.mark.parametrize("key", sorted(BY_KEY))
def test_an_unsupported_reading_is_absent_and_not_asked_again(simulated, clock, key):
    reading = BY_KEY[key]
    nvlink = "    nvlink: {links: 2}\n" if reading.per_link else ""
    driver = simulated(f"gpus:\n  - gpm: true\n    unsupported: [{key}]\n{nvlink}")
    collector = Collector(Nvml(library=driver, slow_seconds=0), ProcFs(), monotonic=clock)
    asked: list[list[int]] = []
    real = driver.nvmlDeviceGetFieldValues
    metrics_asked: list[list[int]] = []
    real_metrics = driver.nvmlGpmMetricsGet

    def recording(handle, ids):
        asked.append([i if isinstance(i, int) else i[0] for i in ids])
        return real(handle, ids)

    def recording_metrics(request):
        metrics_asked.append([m.metricId for m in request.metrics[: request.numMetrics]])
        return real_metrics(request)

    driver.nvmlDeviceGetFieldValues = recording
    driver.nvmlGpmMetricsGet = recording_metrics
    try:
        for _ in range(4):
            snap, found = _sample(collector)
            assert snap.errors == ()
            got = [
                s
                for s in found.get(reading.metric, [])
                if s.labels.items() >= _labels(reading).items()
            ]
            assert got == [], key
            clock.advance(1)
    finally:
        collector.close()
    others = [
        r
        for r in READINGS
        if r.metric == reading.metric
        and r is not reading
        and r.source != reading.source
        and getattr(r.source, "name", 1) != getattr(reading.source, "name", 2)
    ]
    for other in others:  # the rest of its family is there (but what shares its function)
        if not other.per_link and other.cadence != "static" and _available(other):
            assert other.metric in found, other.key
    if isinstance(reading.source, FieldValue):
        field_id = reading.field_id(0 if reading.per_link else None)
        # asked once (the first sample), then left out of the call
        assert [field_id in ids for ids in asked[1:]] == [True, False, False, False]
    elif isinstance(reading.source, GpmMetric):  # GPM's first answer is at the second sample
        assert [reading.source.id in ids for ids in metrics_asked] == [True, False, False]
    elif _available(reading):
        assert isinstance(reading.source, Function)
        assert driver.calls[reading.source.name] == 1


def test_fields_an_older_driver_lacks_are_absent_and_power_falls_back(simulated, collector):
    driver = simulated(
        """
        driver:
          missing_fields:
            [power, recovery_action, clock_event_seconds_hw_thermal_slowdown, memory_unrepairable]
        gpus: [{power: 320}]
        """
    )
    _, found = _sample(collector)
    assert one(found, "gpu_power_watts", gpu="0") == 320  # nvmlDeviceGetPowerUsage
    assert driver.calls["nvmlDeviceGetPowerUsage"] == 1
    assert "gpu_recovery_action" not in found and "gpu_memory_unrepairable" not in found
    reasons = {s.labels["reason"] for s in found["gpu_clock_event_seconds_total"]}
    assert "hw_thermal_slowdown" not in reasons and "sw_power_cap" in reasons
    _sample(collector)
    assert driver.calls["nvmlDeviceGetPowerUsage"] == 2  # the fallback, every sample
    if _available(BY_KEY["memory_unrepairable"]):  # FunctionNotFound, once
        assert driver.calls["nvmlDeviceGetUnrepairableMemoryFlag_v1"] == 1


def test_ecc_readings_are_not_asked_with_ecc_off(simulated, collector):
    driver = simulated("gpus: [{ecc: {enabled: false}}]\n")
    asked = []
    real = driver.nvmlDeviceGetFieldValues
    driver.nvmlDeviceGetFieldValues = lambda h, ids: asked.append(ids) or real(h, ids)
    _, found = _sample(collector)
    ecc_ids = {r.field_id(None) for r in FIELD_READINGS if r.requires_ecc}
    assert not ecc_ids & {i for ids in asked for i in ids if isinstance(i, int)}
    assert "gpu_ecc_errors_total" not in found and "gpu_ecc_errors_aggregate_total" not in found


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(BY_KEY))
def test_an_error_is_absent_this_sample_counted_and_read_again(simulated, clock, key):
    reading = BY_KEY[key]
    if not _available(reading):
        pytest.skip(f"this nvidia-ml-py has no {reading.source}")
    nvlink = "    nvlink: {links: 2}\n" if reading.per_link else ""
    start = "1s" if _gpm(reading) else "0s"  # GPM: after its first sample, which asks nothing
    driver = simulated(
        f"gpus:\n  - gpm: true\n    errors: [{{field: {key}, error: Timeout, from: {start},"
        f" until: 5s}}]\n{nvlink}"
    )
    collector = Collector(Nvml(library=driver, slow_seconds=0), ProcFs(), monotonic=clock)
    try:
        if _gpm(reading):
            collector.sample()
            clock.advance(1)
        snap, found = _sample(collector)
        if reading.cadence == "static":  # read with the static facts: read again later
            assert key not in snap.gpus[0].info.fields
            assert 0 in collector.nvml.incomplete
        else:
            absent = [
                s
                for s in found.get(reading.metric, [])
                if s.labels.items() >= _labels(reading).items()
            ]
            assert absent == [], key
        if reading.cadence != "static":  # static facts that failed are logged, not counted
            shared = {r.key for r in READINGS if r.source == reading.source}  # one function's
            names = {e.field.partition("@")[0] for e in snap.errors}
            assert {(e.source, e.error) for e in snap.errors} == {("field", "Timeout")}
            assert names <= shared | {getattr(reading.source, "name", "")}, names
        assert snap.gpus[0].up
        clock.advance(5)
        snap, found = _sample(collector)
        clock.advance(1)
        snap, found = _sample(collector)  # static facts: read again 1 s after the failure
        assert snap.errors == ()
        present = [
            s for s in found.get(reading.metric, []) if s.labels.items() >= _labels(reading).items()
        ]
        assert present, key
    finally:
        collector.close()


def test_the_call_failing_leaves_every_field_value_absent_for_one_sample(
    simulated, collector, clock
):
    simulated("gpus: [{errors: [{field: field_values, error: Timeout, until: 5s}], power: 99}]\n")
    snap, found = _sample(collector)
    assert snap.gpus[0].up
    assert [(e.field, e.error) for e in snap.errors] == [("field_values", "Timeout")]
    assert "gpu_power_watts" not in found and "gpu_remapped_rows" not in found
    assert "gpu_pcie_link_width" in found  # a function reading, not a field value
    clock.advance(5)
    _, found = _sample(collector)
    assert one(found, "gpu_power_watts", gpu="0") == 99


def test_a_lost_gpu_in_the_field_call_fails_the_gpu(simulated, collector):
    simulated("gpus: [{errors: [{field: field_values, error: GpuIsLost}]}, {}]\n")
    snap, found = _sample(collector)
    assert [g.up for g in snap.gpus] == [False, True]
    assert {s.labels["gpu"] for s in found["gpu_remapped_rows"]} == {"1"}


# -- how often ------------------------------------------------------------------------------------


def test_one_field_call_per_gpu_per_sample_and_no_field_read_twice(simulated, collector, clock):
    driver = simulated("gpus: [{nvlink: {links: 4}}, {}]\n")
    asked: list[list] = []
    real = driver.nvmlDeviceGetFieldValues

    def recording(handle, ids):
        asked.append(list(ids))
        return real(handle, ids)

    driver.nvmlDeviceGetFieldValues = recording
    calls = []
    for _ in range(4):
        before = dict(driver.calls)
        collector.sample()
        calls.append({k: v - before.get(k, 0) for k, v in driver.calls.items()})
        clock.advance(1)
    sampled = [ids for ids in asked if ids != [NVLINK_LINK_COUNT]]
    assert len(sampled) == 2 * 4
    for ids in sampled:
        assert len(ids) == len(set(ids)), "a field asked twice in one call"
    for per_sample in calls[1:]:
        assert per_sample["nvmlDeviceGetFieldValues"] == 2
        for name, count in per_sample.items():  # every other function at most once per GPU
            if name != "nvmlDeviceGetClockInfo":  # graphics and sm: two clocks, one function
                assert count <= 2, (name, count)
        assert per_sample.get("nvmlDeviceGetClockInfo", 0) == 2 * 2


def test_slow_readings_are_read_every_30s_and_say_when(simulated, collector, clock):
    driver = simulated(
        """
        gpus:
          - fan_speed: {from: 0.2, to: 0.8, over: 60s}
            fields: {pcie_link_width: {points: [[0s, 16], [1s, 8]]}}
        """
    )
    first = collector.sample().gpus[0]
    assert first.fan_speed_ratio == 0.2 and first.fields["pcie_link_width"] == 16
    assert first.slow_read_at is not None
    for _ in range(29):
        clock.advance(1)
        gpu = collector.sample().gpus[0]
        assert gpu.fan_speed_ratio == 0.2 and gpu.fields["pcie_link_width"] == 16
        assert gpu.slow_read_at == first.slow_read_at
    assert driver.calls["nvmlDeviceGetFanSpeed"] == 1
    assert driver.calls["nvmlDeviceGetCurrPcieLinkWidth"] == 1
    clock.advance(1)
    gpu = collector.sample().gpus[0]
    assert gpu.fields["pcie_link_width"] == 8 and gpu.fan_speed_ratio == 0.5
    assert driver.calls["nvmlDeviceGetFanSpeed"] == 2
    assert gpu.clocks_hz.keys() == {"graphics", "sm", "memory", "video"}


def test_idle_media_engines_are_read_every_5s_and_every_sample_once_busy(
    simulated, collector, clock
):
    driver = simulated(
        """
        gpus:
          - fields:
              encoder_utilization:
                points: [[0s, 0], [7s, 0], [7500ms, 0.3], [12s, 0.3], [12500ms, 0]]
        """
    )
    seen = []
    for _ in range(20):
        gpu = collector.sample().gpus[0]
        seen.append(gpu.fields["encoder_utilization"])
        assert gpu.fields["decoder_utilization"] == 0.0  # idle all along: present, 0
        clock.advance(1)
    # idle: read at 0 s and 5 s; at 10 s it is busy: read every sample until it reads 0 (13 s),
    # then again every 5 s (18 s)
    assert seen[:10] == [0.0] * 10 and seen[10:13] == [0.3] * 3 and seen[13:] == [0.0] * 7
    assert driver.calls["nvmlDeviceGetEncoderUtilization"] == 2 + 4 + 1
    assert driver.calls["nvmlDeviceGetDecoderUtilization"] == 4  # 0, 5, 10 and 15 s


def test_a_failed_slow_read_is_absent_and_tried_again_next_sample(simulated, collector, clock):
    driver = simulated("gpus: [{errors: [{field: pcie_link_width, error: Timeout, until: 1s}]}]\n")
    gpu = collector.sample().gpus[0]
    assert "pcie_link_width" not in gpu.fields and "pcie_link_generation" in gpu.fields
    clock.advance(1)
    gpu = collector.sample().gpus[0]
    assert gpu.fields["pcie_link_width"] == 16
    assert driver.calls["nvmlDeviceGetCurrPcieLinkWidth"] == 2
    clock.advance(1)
    collector.sample()
    assert driver.calls["nvmlDeviceGetCurrPcieLinkWidth"] == 2  # then every 30 s again


# -- the scenario -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpus: [{fields: {nope: 1}}]", "unknown reading 'nope' in fields"),
        ("gpus: [{fields: {power: 1}}]", "it has a key of its own"),
        ("gpus: [{nvlink: {links: 2, down: [{link: 2}]}}]", "link 2 does not exist"),
        ("gpus: [{nvlink: {links: 2, per_link: {0: {row_remap_pending: 1}}}}]", "unknown reading"),
        ("gpus: [{xids: [{code: 79}]}]", "is required"),
        ("gpus: [{xids: [{at: 1s, code: 0}]}]", "xids"),
        ("driver: {missing_fields: [nope]}", "expected a list of readings"),
    ],
)
def test_bad_scenario_readings_are_clear_errors(tmp_path, text, message):
    from exporter.config.yamlconf import ConfigError
    from exporter.simulate.scenario import load_scenario

    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as raised:
        load_scenario(str(path))
    assert message in str(raised.value)
    assert "bad.yaml:1" in str(raised.value)


def test_link_readings_are_the_per_link_ones():
    assert {r.key for r in READINGS if r.per_link} == LINK_READINGS


# -- the docs ---------------------------------------------------------------------------------


def test_docs_rows_are_what_the_table_writes():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_every_exported_metric_is_in_docs_metrics_md(simulated, collector):
    """docs/architecture.md promises this: a metric the agent exports and the page does not
    name fails here (the agent's own and the process collector's included)."""
    from exporter.exposition.metrics import render_with_process

    simulated(_everything())
    snap = collector.sample()
    stats = SelfStats(interval_seconds=5)
    stats.count(snap, deadline=5)
    stats.errors_total[("field", "Timeout")] = 1
    text = render_with_process(snap, stats).decode()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    doc = METRICS_DOC.read_text()
    missing = sorted(
        name for name in names if f"`{name}`" not in doc and f"`{name}_total`" not in doc
    )
    assert not missing, missing
