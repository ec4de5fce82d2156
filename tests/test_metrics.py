"""Snapshot -> exposition, parsed back with prometheus_client's own parser."""

from __future__ import annotations

import os

from exporter.exposition.metrics import render, render_liveness
from exporter.sampling.stats import SelfStats
from tests.helpers import one, samples

SCENARIO = """
gpus:
  - name: NVIDIA H100 80GB HBM3
    memory_total: 80GiB
    memory_reserved: 1GiB
    temperature: 70
    power: 350
    unsupported: [fan_speed]
    ecc: {corrected: 5, uncorrected: 2}
    clock_event_reasons: [hw_thermal_slowdown]
    processes:
      - {pid: self, memory: 4GiB}
      - {pid: parent, memory: 2GiB, until: 10s}
  - name: NVIDIA GeForce RTX 4090
    ecc: {enabled: false}
    fan_speed: 0.5
    errors: [{field: "*", error: GpuIsLost, from: 20s}]
"""


def test_every_contract_metric_with_values(simulated, collector):
    simulated(SCENARIO)
    snap = collector.sample()
    stats = SelfStats(interval_seconds=5)
    stats.count(snap, deadline=5)
    found = samples(render(snap, stats))
    uuid = snap.gpus[0].uuid
    info = found["gpu_info"][0].labels
    assert info["gpu"] == "0" and info["uuid"] == uuid
    assert info["name"] == "NVIDIA H100 80GB HBM3"
    assert info["driver_version"] == "550.54.15" and info["cuda_version"] == "12.4"
    assert info["pci_bus_id"].startswith("00000000:")
    assert one(found, "gpu_up", gpu="0", uuid=uuid) == 1
    assert one(found, "gpu_memory_total_bytes", gpu="0") == 80 * 1024**3
    assert one(found, "gpu_memory_used_bytes", gpu="0") == 6 * 1024**3
    assert one(found, "gpu_memory_reserved_bytes", gpu="0") == 1024**3
    assert one(found, "gpu_memory_free_bytes", gpu="0") == (80 - 1 - 6) * 1024**3
    assert one(found, "gpu_temperature_celsius", gpu="0") == 70
    assert one(found, "gpu_temperature_threshold_celsius", gpu="0", threshold="slowdown") == 89
    assert one(found, "gpu_power_watts", gpu="0") == 350
    assert one(found, "gpu_power_limit_watts", gpu="0") == 700
    assert one(found, "gpu_clock_hz", gpu="0", clock="sm") == 1755e6
    assert one(found, "gpu_clock_event_active", gpu="0", reason="hw_thermal_slowdown") == 1
    assert one(found, "gpu_clock_event_active", gpu="0", reason="sw_power_cap") == 0
    assert one(found, "gpu_ecc_errors_total", gpu="0", type="uncorrected") == 2
    assert one(found, "gpu_processes", gpu="0") == 2
    assert one(found, "gpu_performance_state", gpu="0") == 0
    assert "gpu_energy_joules_total" in found
    me = one(found, "gpu_process_memory_used_bytes", gpu="0", pid=str(os.getpid()), type="compute")
    assert me == 4 * 1024**3
    assert one(found, "gpu_fan_speed_ratio", gpu="1") == 0.5
    assert one(found, "gpu_exporter_nvml_up") == 1
    assert one(found, "gpu_exporter_samples_total") == 1
    assert one(found, "gpu_exporter_last_sample_timestamp_seconds") == snap.timestamp
    assert one(found, "gpu_exporter_sample_nvml_calls") == snap.nvml_calls
    assert found["gpu_exporter_build_info"][0].labels["version"]


def test_unsupported_fields_are_absent_never_zero_or_nan(simulated, collector):
    simulated(SCENARIO)
    found = samples(render(collector.sample(), SelfStats(5)))
    assert [s.labels["gpu"] for s in found["gpu_fan_speed_ratio"]] == ["1"]
    assert {s.labels["gpu"] for s in found["gpu_ecc_errors_total"]} == {"0"}
    for name, series in found.items():
        for sample in series:
            assert sample.value == sample.value, f"NaN in {name}"


def test_label_sets_keep_their_shape_and_ended_processes_leave(simulated, collector, clock):
    simulated(SCENARIO)
    before = samples(render(collector.sample(), SelfStats(5)))
    clock.advance(10)  # the parent's process ended
    after = samples(render(collector.sample(), SelfStats(5)))
    for name in before:
        shapes = {tuple(sorted(s.labels)) for s in before[name] + after.get(name, [])}
        assert len(shapes) == 1, (name, shapes)
    pids = {s.labels["pid"] for s in after["gpu_process_memory_used_bytes"]}
    assert pids == {str(os.getpid())}
    assert one(after, "gpu_processes", gpu="0") == 1


def test_failed_gpu_keeps_identity_and_up_zero_only(simulated, collector, clock):
    simulated(SCENARIO)
    collector.sample()
    clock.advance(20)
    collector.sample()
    clock.advance(5)
    snap = collector.sample()  # still lost: identity is kept from before
    stats = SelfStats(5)
    stats.count(snap, 5)
    found = samples(render(snap, stats))
    uuid = snap.gpus[1].uuid
    assert one(found, "gpu_up", gpu="1", uuid=uuid) == 0
    assert one(found, "gpu_info", gpu="1", uuid=uuid) == 1
    for name, series in found.items():
        if (
            name not in ("gpu_up", "gpu_info")
            and name.startswith("gpu_")
            and not name.startswith("gpu_exporter")
        ):
            assert all(s.labels.get("gpu") != "1" for s in series), name
    assert one(found, "gpu_up", gpu="0") == 1
    assert one(found, "gpu_exporter_sample_errors_total", source="gpu", error="GpuIsLost") == 1
    assert one(found, "gpu_info", gpu="1")  # identity survives every sample while it is down


def test_nvml_down_exports_only_self_metrics(simulated, collector):
    simulated("driver: {errors: [{field: init, error: LibraryNotFound}]}\ngpus: [{}]\n")
    found = samples(render(collector.sample(), SelfStats(5)))
    assert one(found, "gpu_exporter_nvml_up") == 0
    assert all(name.startswith("gpu_exporter_") for name in found)


def test_liveness_lines_parse():
    found = samples(render_liveness(12.5, True))
    assert one(found, "gpu_exporter_snapshot_age_seconds") == 12.5
    assert one(found, "gpu_exporter_snapshot_stale") == 1
    assert "gpu_exporter_snapshot_age_seconds" not in samples(render_liveness(None, True))


def test_process_sm_utilization_has_the_process_labels_and_is_absent_when_unknown(
    simulated, collector
):
    simulated(
        """
        gpus:
          - processes:
              - {pid: self, memory: 1GiB, sm_utilization: 0.25}
              - {pid: parent, memory: 1GiB}
          - unsupported: [process_utilization]
            processes: [{pid: self, memory: 1GiB, sm_utilization: 0.5}]
        """
    )
    found = samples(render(collector.sample(), SelfStats(5)))
    series = found["gpu_process_sm_utilization_ratio"]
    memory = found["gpu_process_memory_used_bytes"]
    assert {tuple(sorted(s.labels)) for s in series} == {tuple(sorted(memory[0].labels))}
    me, parent = str(os.getpid()), str(os.getppid())
    assert one(found, "gpu_process_sm_utilization_ratio", gpu="0", pid=me) == 0.25
    assert one(found, "gpu_process_sm_utilization_ratio", gpu="0", pid=parent) == 0  # idle
    assert {s.labels["gpu"] for s in series} == {"0"}  # GPU 1's processes: unknown, absent
    assert {s.labels["gpu"] for s in memory} == {"0", "1"}


def test_memory_encoder_and_decoder_utilization_per_process(simulated, collector):
    simulated(
        """
        gpus:
          - processes:
              - pid: self
                memory: 1GiB
                sm_utilization: 0.5
                memory_utilization: 0.2
                encoder_utilization: 0.3
                decoder_utilization: 0.04
              - {pid: parent, memory: 1GiB}
          - unsupported: [process_utilization]
            processes: [{pid: self, memory: 1GiB, decoder_utilization: 0.5}]
        """
    )
    found = samples(render(collector.sample(), SelfStats(5)))
    me, parent = str(os.getpid()), str(os.getppid())
    for name, mine in (("memory", 0.2), ("encoder", 0.3), ("decoder", 0.04)):
        metric = f"gpu_process_{name}_utilization_ratio"
        assert one(found, metric, gpu="0", pid=me) == mine
        assert one(found, metric, gpu="0", pid=parent) == 0  # no sample: idle
        assert {s.labels["gpu"] for s in found[metric]} == {"0"}  # GPU 1: unknown, absent
        labels = {tuple(sorted(s.labels)) for s in found[metric]}
        assert labels == {tuple(sorted(found["gpu_process_memory_used_bytes"][0].labels))}


def test_the_text_is_what_prometheus_client_writes(simulated, collector):
    """exposition/text.py writes the text format itself (for speed): byte for byte
    prometheus_client's, on every family the agent renders, odd label values included."""
    from dataclasses import replace

    from prometheus_client.exposition import generate_latest

    from exporter.core.snapshot import GpuProcess
    from exporter.exposition.metrics import gpu_families, process_families, self_families
    from exporter.exposition.text import render_text

    simulated(SCENARIO.replace("name: NVIDIA H100 80GB HBM3", "name: 'H100 \\\\ \"x\"'"))
    snap = collector.sample()
    odd = GpuProcess(7, "compute", 1, True, name='a"b\\c\nd', user="ü")
    gpus = (replace(snap.gpus[0], processes=(odd,)), *snap.gpus[1:])
    snap = replace(snap, gpus=gpus)
    stats = SelfStats(interval_seconds=5)
    stats.count(snap, deadline=5)
    families = [*gpu_families(snap), *self_families(snap, stats), *process_families()]
    families = [f for f in families if f.samples]

    class Registry:
        def collect(self):
            return iter(families)

    assert render_text(families) == generate_latest(Registry())
    assert b'process="a\\"b\\\\c\\nd"' in render_text(families)


def test_openmetrics_carries_the_readings(simulated, collector):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from exporter.exposition.metrics import OPENMETRICS_EOF

    simulated("gpus: [{nvlink: {links: 2}, fields: {row_remap_pending: 1}}]\n")
    exposition = render(collector.sample(), SelfStats(interval_seconds=5))
    text = (exposition.openmetrics() + OPENMETRICS_EOF).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["gpu_row_remap_pending"].samples[0].value == 1
    assert families["gpu_nvlink_errors"].type == "counter"
    links = {s.labels["link"] for s in families["gpu_nvlink_up"].samples}
    assert links == {"0", "1"}


def test_gpu_process_owner_info_names_the_slurm_job_of_a_process():
    from exporter.core.snapshot import Gpu, GpuInfo, GpuProcess, HostInfo, Snapshot

    processes = (
        GpuProcess(pid=10, type="compute", used_memory_bytes=1, visible=True, slurm_job="77"),
        GpuProcess(pid=11, type="compute", used_memory_bytes=1, visible=True),  # not Slurm's
    )
    gpu = Gpu(0, "GPU-a", True, GpuInfo(0, "GPU-a"), processes=processes)
    snap = Snapshot(1, 1.7e9, 1.0, 0.01, True, HostInfo("h"), (gpu,))
    (owner,) = samples(render(snap, SelfStats(5)))["gpu_process_owner_info"]
    assert owner.labels == {
        "gpu": "0",
        "uuid": "GPU-a",
        "pid": "10",
        "namespace": "",
        "pod": "",
        "container": "",
        "slurm_job": "77",
    }
    assert owner.value == 1
