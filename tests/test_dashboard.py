"""The Grafana dashboard: generated, well formed, and querying only documented metrics; its Health
row on a real Prometheus scraping the agent on simulated GPUs with every health signal."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.agent import free_port, healthz_until, http_get, running, serve, stderr_of
from tests.dashboard import (
    DASHBOARD,
    HEALTH_SCENARIO,
    ROOT,
    dashboard_queries,
    iter_panels,
    load,
    rows,
    substitute,
)

GRAFANA = ROOT / "grafana"
RULES = ROOT / "rules" / "gpu-exporter.rules.yml"
DATASOURCE_UID = "${datasource}"
PROVISIONED_DIR = "/var/lib/grafana/dashboards/gpu-exporter"
GPU_LEGEND = "{{instance}} GPU {{gpu}}"

#: Exported by the agent (exporter/exposition/metrics.py) but not yet listed in docs/metrics.md.
#: Drop a name from here once the docs list it.

#: Metrics without the gpu label (so their selectors take no gpu=~"$gpu"): the agent's own, and
#: prometheus_client's process_* metrics of the agent's process.
NO_GPU_LABEL = re.compile(r"gpu_exporter_\w+|gpu_recommended_devices|process_\w+")

#: A metric name in PromQL or in docs/metrics.md: the agent's gpu_* and the process_* ones.
#: (``gpu_process_*`` is one name: no word boundary inside it; a recording rule's name such as
#: ``instance_gpu:gpu_idle:bool`` is none of them, see RECORDED.)
METRIC = r"(?<![\w:])(?:gpu|process)_\w+(?![\w:])"
#: A recording rule's name (level:metric:operations), as rules/gpu-exporter.rules.yml records.
RECORDED = r"(?<![\w:])[a-z_]+:[a-z_]+:[a-z0-9_]+(?![\w:])"

#: (title, panel type, unit or None, a metric the panel's queries use): the required sections.
REQUIRED = [
    ("GPUs up", "stat", "none", "gpu_up"),
    ("GPUs down", "stat", "none", "gpu_up"),
    ("GPUs", "table", None, "gpu_info"),
    ("Memory used vs total", "timeseries", "bytes", "gpu_memory_total_bytes"),
    ("Memory used (fraction)", "bargauge", "percentunit", "gpu_memory_used_bytes"),
    ("GPU utilization", "heatmap", None, "gpu_utilization_ratio"),
    (
        "Temperature vs slowdown threshold",
        "timeseries",
        "celsius",
        "gpu_temperature_threshold_celsius",
    ),
    ("Power draw vs limit", "timeseries", "watt", "gpu_power_limit_watts"),
    ("Average power from the energy counter (5m)", "timeseries", "watt", "gpu_energy_joules_total"),
    ("Throttling (thermal and power)", "state-timeline", None, "gpu_clock_event_active"),
    # True utilization
    ("SM and tensor activity vs utilization", "timeseries", "percentunit", "gpu_sm_active_ratio"),
    (
        "SM and tensor activity vs utilization",
        "timeseries",
        "percentunit",
        "gpu_tensor_active_ratio",
    ),
    (
        "SM and tensor activity vs utilization",
        "timeseries",
        "percentunit",
        "gpu_utilization_ratio",
    ),
    ("DRAM bandwidth utilization", "timeseries", "percentunit", "gpu_dram_active_ratio"),
    ("PCIe bandwidth (GPM)", "timeseries", "binBps", "gpu_pcie_transmit_bytes_per_second"),
    ("PCIe bandwidth (GPM)", "timeseries", "binBps", "gpu_pcie_receive_bytes_per_second"),
    ("NVLink bandwidth (GPM)", "timeseries", "binBps", "gpu_nvlink_transmit_bytes_per_second"),
    ("NVLink bandwidth (GPM)", "timeseries", "binBps", "gpu_nvlink_receive_bytes_per_second"),
    ("GPUs with GPM", "stat", "none", "gpu_gpm_supported"),
    ("GPM support per GPU", "table", None, "gpu_gpm_supported"),
    ("MIG devices", "table", "bytes", "gpu_mig_info"),
    ("MIG devices", "table", "bytes", "gpu_mig_memory_used_bytes"),
    ("MIG devices", "table", "bytes", "gpu_mig_memory_total_bytes"),
    ("MIG devices", "table", "bytes", "gpu_mig_sm_active_ratio"),
    ("MIG devices", "table", "bytes", "gpu_mig_tensor_active_ratio"),
    ("MIG device memory used", "timeseries", "percentunit", "gpu_mig_memory_used_bytes"),
    ("MIG device memory used", "timeseries", "percentunit", "gpu_mig_memory_total_bytes"),
    ("MIG device memory used", "timeseries", "percentunit", "gpu_mig_info"),
    ("GPU processes", "table", "bytes", "gpu_process_memory_used_bytes"),
    ("GPU processes", "table", "bytes", "gpu_process_sm_utilization_ratio"),
    ("SM utilization by process", "timeseries", "percentunit", "gpu_process_sm_utilization_ratio"),
    (
        "Idle processes holding GPU memory (30m)",
        "table",
        "bytes",
        "gpu_process_sm_utilization_ratio",
    ),
    ("Zombie processes by class", "timeseries", None, "gpu_zombie_processes"),
    ("Thermal hotspots", "state-timeline", None, "gpu_thermal_hotspot"),
    ("Thermal outliers", "state-timeline", None, "gpu_thermal_outlier"),
    ("Recommended GPU per policy", "table", None, "gpu_recommended"),
    ("Recommended GPUs per policy", "bargauge", None, "gpu_recommended_devices"),
    ("Launcher reservations", "state-timeline", None, "gpu_reserved"),
    ("Sample duration", "timeseries", "s", "gpu_exporter_sample_duration_seconds"),
    ("Snapshot age", "timeseries", "s", "gpu_exporter_snapshot_age_seconds"),
    ("Snapshot stale", "state-timeline", None, "gpu_exporter_snapshot_stale"),
    ("NVML up", "state-timeline", None, "gpu_exporter_nvml_up"),
    (
        "Time since last successful action run",
        "timeseries",
        "s",
        "gpu_exporter_action_last_success_timestamp_seconds",
    ),
    ("Action failures", "timeseries", None, "gpu_exporter_action_failures_total"),
    ("HTTP requests by path and code", "timeseries", "reqps", "gpu_exporter_http_requests_total"),
    ("HTTP error responses", "timeseries", "reqps", "gpu_exporter_http_requests_total"),
    ("HTTP connections open", "timeseries", "none", "gpu_exporter_http_connections"),
    (
        "Rejected connections",
        "timeseries",
        "none",
        "gpu_exporter_http_rejected_connections_total",
    ),
    ("Agent memory (RSS)", "timeseries", "bytes", "process_resident_memory_bytes"),
    ("Agent CPU", "timeseries", "percentunit", "process_cpu_seconds_total"),
    ("Open file descriptors vs limit", "timeseries", "none", "process_open_fds"),
    ("Open file descriptors vs limit", "timeseries", "none", "process_max_fds"),
    ("Agent uptime", "timeseries", "s", "process_start_time_seconds"),
    # Health
    ("XIDs (24h)", "stat", "none", "gpu_xid_errors_total"),
    ("GPUs without XID events", "stat", "none", "gpu_xid_events_supported"),
    ("GPUs with a repair pending", "stat", "none", "gpu_row_remap_pending"),
    ("GPUs with a repair pending", "stat", "none", "gpu_retired_pages_pending"),
    ("GPUs with a repair pending", "stat", "none", "gpu_bank_remap_pending"),
    ("GPUs with failed memory repair", "stat", "none", "gpu_row_remap_failed"),
    ("GPUs with failed memory repair", "stat", "none", "gpu_memory_unrepairable"),
    ("GPUs needing recovery", "stat", "none", "gpu_recovery_action"),
    ("NVLink links down", "stat", "none", "gpu_nvlink_up"),
    ("XID errors by code", "timeseries", "none", "gpu_xid_errors_total"),
    ("XID errors in the last 24 hours", "table", None, "gpu_xid_errors_total"),
    ("Memory repair per GPU", "table", None, "gpu_remapped_rows"),
    ("Memory repair per GPU", "table", None, "gpu_row_remap_pending"),
    ("Memory repair per GPU", "table", None, "gpu_row_remap_failed"),
    ("Memory repair per GPU", "table", None, "gpu_retired_pages"),
    ("Memory repair per GPU", "table", None, "gpu_memory_unrepairable"),
    ("Memory repair per GPU", "table", None, "gpu_recovery_action"),
    ("Remapped rows and retired pages", "timeseries", "none", "gpu_remapped_rows"),
    ("Remapped rows and retired pages", "timeseries", "none", "gpu_retired_pages"),
    ("ECC errors", "timeseries", "none", "gpu_ecc_errors_total"),
    ("Recovery action", "state-timeline", None, "gpu_recovery_action"),
    ("PCIe traffic", "timeseries", "binBps", "gpu_pcie_transmit_bytes_total"),
    ("PCIe traffic", "timeseries", "binBps", "gpu_pcie_receive_bytes_total"),
    ("PCIe errors per second", "timeseries", "cps", "gpu_pcie_replay_errors_total"),
    ("PCIe errors per second", "timeseries", "cps", "gpu_pcie_errors_total"),
    ("PCIe link generation vs max", "timeseries", "none", "gpu_pcie_link_generation_max"),
    ("PCIe link width vs max", "timeseries", "none", "gpu_pcie_link_width_max"),
    ("NVLink traffic per link", "timeseries", "binBps", "gpu_nvlink_transmit_bytes_total"),
    ("NVLink traffic per link", "timeseries", "binBps", "gpu_nvlink_receive_bytes_total"),
    ("NVLink errors per link and type", "timeseries", "cps", "gpu_nvlink_errors_total"),
    ("NVLink links down per GPU", "timeseries", "none", "gpu_nvlink_up"),
    ("Down NVLink links", "table", None, "gpu_nvlink_up"),
    (
        "Share of time throttled by reason",
        "timeseries",
        "percentunit",
        "gpu_clock_event_seconds_total",
    ),
    (
        "Video encoder and decoder utilization",
        "timeseries",
        "percentunit",
        "gpu_encoder_utilization_ratio",
    ),
    (
        "Video encoder and decoder utilization",
        "timeseries",
        "percentunit",
        "gpu_decoder_utilization_ratio",
    ),
    ("GPU health verdict per GPU over time", "state-timeline", None, "gpu_health"),
    ("Failing health checks over time", "state-timeline", None, "gpu_health_check"),
    ("Failing health checks now", "table", None, "gpu_health_check"),
]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return load(DASHBOARD)


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that shows data (rows left out)."""
    return [p for p in iter_panels(dashboard) if p["type"] != "row"]


def by_title(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["title"]: p for p in panels(dashboard)}


def metric_names(expr: str) -> set[str]:
    """The gpu_* and process_* metric names an expression uses (string literals left out)."""
    return set(re.findall(METRIC, re.sub(r'"[^"]*"', '""', expr)))


def test_json_is_what_the_generator_writes(tmp_path: Path) -> None:
    out = tmp_path / "dashboard.json"
    subprocess.run(
        [sys.executable, str(GRAFANA / "generate.py"), "--output", str(out)],
        check=True,
        timeout=60,
    )
    assert out.read_text(encoding="utf-8") == DASHBOARD.read_text(encoding="utf-8"), (
        "grafana/gpu-exporter.json is out of date: run python grafana/generate.py and commit it"
    )


def test_identity(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "gpu-exporter"
    assert dashboard["title"] == "GPU exporter"
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["id"] is None


def test_panel_ids_are_unique_and_fit_the_grid(dashboard: dict[str, Any]) -> None:
    everything = list(iter_panels(dashboard))
    ids = [p["id"] for p in everything]
    assert all(isinstance(i, int) for i in ids)
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for panel in everything:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]


def test_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"datasource", "instance", "gpu"}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    expected = {
        "instance": 'label_values(gpu_up{job="gpu-exporter"}, instance)',
        "gpu": 'label_values(gpu_up{job="gpu-exporter", instance=~"$instance"}, gpu)',
    }
    for name, query in expected.items():
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["definition"] == query
        assert variable["query"]["query"] == query
        assert variable["multi"] is True and variable["includeAll"] is True
        assert variable["datasource"]["uid"] == DATASOURCE_UID


def test_every_panel_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"]) == panel["datasource"]


def test_every_target_has_ref_and_expr(dashboard: dict[str, Any]) -> None:
    for panel in panels(dashboard):
        refs = [t.get("refId") for t in panel["targets"]]
        assert all(refs) and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), panel["title"]
            # Legends name the host (and GPU); stats and tables show no legend.
            if panel["type"] not in ("stat", "table"):
                assert "{{instance}}" in target["legendFormat"], panel["title"]


def documented_metrics() -> set[str]:
    """The metrics docs/metrics.md names, and the MIG devices' GPM metrics, which it names as
    "every other GPM metric of the readings as `gpu_mig_*`": gpu_mig_X for each GPM reading
    gpu_X of its readings table."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(METRIC, text))
    assert "every other GPM metric of [the readings](#readings) as `gpu_mig_*`" in text
    gpm = re.findall(r"^\| `gpu_(\w+)` \|.*\| GPM metric `NVML_GPM_METRIC_", text, re.MULTILINE)
    assert "sm_active_ratio" in gpm and "tensor_active_ratio" in gpm  # the extraction works
    return documented | {f"gpu_mig_{name}" for name in gpm}


def test_every_metric_is_documented(dashboard: dict[str, Any]) -> None:
    documented = documented_metrics()
    for panel in panels(dashboard):
        for target in panel["targets"]:
            for name in metric_names(target["expr"]):
                assert name in documented, (panel["title"], name)


def test_every_recorded_series_has_its_rule(dashboard: dict[str, Any]) -> None:
    recorded = set(re.findall(r"^\s*- record: (\S+)$", RULES.read_text(), re.MULTILINE))
    used = {
        name
        for panel in panels(dashboard)
        for target in panel["targets"]
        for name in re.findall(RECORDED, re.sub(r'"[^"]*"', '""', target["expr"]))
    }
    assert "instance_namespace:gpu_idle_seconds:sum24h" in used  # the extraction works
    assert used <= recorded, used - recorded


def test_every_selector_is_filtered(dashboard: dict[str, Any]) -> None:
    selector = re.compile(rf"({METRIC}|{RECORDED})(\{{[^}}]*\}})?")
    for panel in panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"]
            for name, matchers in selector.findall(expr):
                where = (panel["title"], name, expr)
                assert 'job="gpu-exporter"' in matchers, where
                assert 'instance=~"$instance"' in matchers, where
                per_gpu = not NO_GPU_LABEL.fullmatch(name) and (
                    ":" not in name or name.startswith("instance_gpu:")
                )
                if per_gpu:
                    assert 'gpu=~"$gpu"' in matchers, where


def test_required_sections(dashboard: dict[str, Any]) -> None:
    found = by_title(dashboard)
    for title, kind, unit, metric in REQUIRED:
        assert title in found, title
        panel = found[title]
        assert panel["type"] == kind, title
        if unit is not None:
            units = {panel["fieldConfig"]["defaults"].get("unit")}
            if panel["type"] == "heatmap":
                units = {panel["options"]["cellValues"]["unit"]}
            assert unit in units, (title, units)
        assert any(metric in metric_names(t["expr"]) for t in panel["targets"]), title
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == [
        "Fleet overview",
        "True utilization",
        "Processes",
        "Waste",
        "Actions",
        "Health",
        "Agent health",
    ]


def test_specific_queries(dashboard: dict[str, Any]) -> None:
    found = by_title(dashboard)
    assert found["GPUs up"]["targets"][0]["expr"].startswith("sum(gpu_up{")
    assert "count(gpu_up{" in found["GPUs down"]["targets"][0]["expr"]
    assert "== 0" in found["GPUs down"]["targets"][0]["expr"]
    temperature = [t["expr"] for t in found["Temperature vs slowdown threshold"]["targets"]]
    assert any('threshold="slowdown"' in e for e in temperature)
    assert "[5m]" in found["Average power from the energy counter (5m)"]["targets"][0]["expr"]
    throttling = found["Throttling (thermal and power)"]["targets"][0]["expr"]
    for reason in ("sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown"):
        assert reason in throttling
    assert "== 1" in found["Recommended GPU per policy"]["targets"][0]["expr"]
    assert "time() -" in found["Time since last successful action run"]["targets"][0]["expr"]
    assert "increase(" in found["Action failures"]["targets"][0]["expr"]
    # The errors counter has no series before the first error: a fallback keeps the panel fed.
    for target in found["Sample errors"]["targets"]:
        if "gpu_exporter_sample_errors_total" in target["expr"]:
            assert " or " in target["expr"]
    # So has a status code never answered yet.
    (errors,) = found["HTTP error responses"]["targets"]
    assert 'code=~"[45].."' in errors["expr"] and " or on (instance) " in errors["expr"]
    assert "rate(" in found["HTTP requests by path and code"]["targets"][0]["expr"]
    assert "increase(" in found["Rejected connections"]["targets"][0]["expr"]
    assert "rate(" in found["Agent CPU"]["targets"][0]["expr"]
    assert "time() -" in found["Agent uptime"]["targets"][0]["expr"]
    # A process listed as compute and graphics is one line, not two.
    sm = found["SM utilization by process"]["targets"][0]["expr"]
    assert sm.startswith("max by (instance, gpu, uuid, pid, user, process) (")
    fds = found["Open file descriptors vs limit"]
    assert fds["fieldConfig"]["defaults"]["custom"]["scaleDistribution"]["type"] == "log"


def test_health_queries(dashboard: dict[str, Any]) -> None:
    found = by_title(dashboard)

    def exprs(title: str) -> list[str]:
        return [t["expr"] for t in found[title]["targets"]]

    # A code's series starts at 1 with its first XID, which increase() alone misses.
    (timeline,) = exprs("XID errors by code")
    assert "increase(gpu_xid_errors_total{" in timeline and "[$__rate_interval])" in timeline
    assert "unless gpu_xid_errors_total{" in timeline and "offset $__rate_interval" in timeline
    assert timeline.startswith("sum by (instance, gpu, uuid, xid, resolution) (")
    assert found["XID errors by code"]["fieldConfig"]["defaults"]["custom"]["drawStyle"] == "bars"
    (last_day,) = exprs("XID errors in the last 24 hours")
    assert "offset 1d" in last_day and "[1d]" in last_day and last_day.endswith("> 0")
    assert "offset 1d" in exprs("XIDs (24h)")[0]
    # Counts of GPUs: 0, not "No data", when none is in that state.
    for title in (
        "XIDs (24h)",
        "GPUs without XID events",
        "GPUs with a repair pending",
        "GPUs with failed memory repair",
        "GPUs needing recovery",
        "NVLink links down",
    ):
        assert exprs(title)[0].endswith(" or vector(0)"), title
    # Rates per second of the byte and error counters.
    for title in (
        "PCIe traffic",
        "PCIe errors per second",
        "NVLink traffic per link",
        "NVLink errors per link and type",
        "Share of time throttled by reason",
    ):
        for expr in exprs(title):
            assert expr.startswith("rate(") and expr.endswith("[$__rate_interval])"), title
    nvlink_errors = found["NVLink errors per link and type"]["targets"][0]["legendFormat"]
    assert "{{link}}" in nvlink_errors and "{{type}}" in nvlink_errors
    assert "{{link}}" in found["NVLink traffic per link"]["targets"][0]["legendFormat"]
    assert "{{reason}}" in found["Share of time throttled by reason"]["targets"][0]["legendFormat"]
    throttle = found["Share of time throttled by reason"]["fieldConfig"]["defaults"]
    assert throttle["custom"]["stacking"]["mode"] == "none"  # the reasons overlap
    # Link generation and width next to their maxima, dashed.
    for title, metric in (
        ("PCIe link generation vs max", "gpu_pcie_link_generation"),
        ("PCIe link width vs max", "gpu_pcie_link_width"),
    ):
        assert [metric_names(e) for e in exprs(title)] == [{metric}, {metric + "_max"}], title
        (override,) = found[title]["fieldConfig"]["overrides"]
        assert override["matcher"] == {"id": "byFrameRefID", "options": "B"}, title
    assert "== bool 0" in exprs("NVLink links down per GPU")[0]
    # The recovery action by name, as NVML numbers them.
    recovery = {"none", "GPU reset", "node reboot", "drain P2P", "drain and reset"}
    (states,) = found["Recovery action"]["fieldConfig"]["defaults"]["mappings"]
    texts = {int(value): option["text"] for value, option in states["options"].items()}
    assert {texts[i] for i in range(5)} == recovery
    assert texts[0] == "none" and texts[1] == "GPU reset" and texts[4] == "drain and reset"
    # The health verdict and its checks: 0 ok green, 1 warning, 2 critical red, the state's name
    # written in the lane too, so that color is not the only cue.
    for title in ("GPU health verdict per GPU over time", "Failing health checks over time"):
        (states,) = found[title]["fieldConfig"]["defaults"]["mappings"]
        options = {int(value): (o["text"], o["color"]) for value, o in states["options"].items()}
        assert options == {0: ("ok", "green"), 1: ("warning", "orange"), 2: ("critical", "red")}
        assert found[title]["options"]["showValue"] == "always", title
    assert exprs("GPU health verdict per GPU over time") == [
        'gpu_health{job="gpu-exporter", instance=~"$instance", gpu=~"$gpu"}'
    ]
    # Only the checks that are not ok: an ok check has no lane and no row.
    for title in ("Failing health checks over time", "Failing health checks now"):
        (failing,) = exprs(title)
        assert failing.startswith("gpu_health_check{") and failing.endswith("} > 0"), title
    assert "{{check}}" in found["Failing health checks over time"]["targets"][0]["legendFormat"]


def test_true_utilization_queries(dashboard: dict[str, Any]) -> None:
    found = by_title(dashboard)
    gpm = rows(dashboard)["True utilization"]
    assert [p["title"] for p in gpm] == [
        "SM and tensor activity vs utilization",
        "DRAM bandwidth utilization",
        "PCIe bandwidth (GPM)",
        "NVLink bandwidth (GPM)",
        "GPUs with GPM",
        "GPM support per GPU",
        *MIG_PANELS,
    ]
    # GPM metrics are gauges (the average between two samples): shown as they are, no rate().
    for panel in gpm:
        for target in panel["targets"]:
            assert "rate(" not in target["expr"], panel["title"]
    activity = found["SM and tensor activity vs utilization"]
    sm, tensor, utilization = (t["expr"] for t in activity["targets"])
    assert metric_names(sm) == {"gpu_sm_active_ratio"}
    assert metric_names(tensor) == {"gpu_tensor_active_ratio"}
    # Utilization only of the GPUs with GPM, whose SM activity is there to compare with.
    assert utilization.startswith("gpu_utilization_ratio{")
    assert " and on (instance, gpu, uuid) gpu_gpm_supported{" in utilization
    assert utilization.endswith("} == 1")
    (override,) = activity["fieldConfig"]["overrides"]
    assert override["matcher"] == {"id": "byFrameRefID", "options": "C"}  # utilization dashed
    assert [t["legendFormat"] for t in activity["targets"]] == [
        GPU_LEGEND + " SM active",
        GPU_LEGEND + " tensor active",
        GPU_LEGEND + " utilization",
    ]
    for title in ("PCIe bandwidth (GPM)", "NVLink bandwidth (GPM)"):
        legends = [t["legendFormat"] for t in found[title]["targets"]]
        assert legends == [GPU_LEGEND + " transmit", GPU_LEGEND + " receive"], title
    # A count of GPUs: 0, not "No data", when none has GPM.
    assert found["GPUs with GPM"]["targets"][0]["expr"].endswith(" or vector(0)")
    support = found["GPM support per GPU"]
    (level,) = support["fieldConfig"]["overrides"]
    assert level["matcher"] == {"id": "byName", "options": "GPM"}
    (states,) = level["properties"][0]["value"]
    assert {int(v): o["text"] for v, o in states["options"].items()} == {0: "no", 1: "yes"}


#: The True utilization row's panels of MIG devices (docs/metrics.md#mig), last in the row.
MIG_PANELS = ["MIG devices", "MIG device memory used"]
#: Labels of a MIG device's series, and the profile joined in from gpu_mig_info.
MIG_KEY = "instance, gpu, uuid, mig_uuid"
MIG_JOIN = f" * on ({MIG_KEY}) group_left (profile) gpu_mig_info{{"


def test_mig_queries(dashboard: dict[str, Any]) -> None:
    found = by_title(dashboard)
    devices = found["MIG devices"]
    info, *values = (t["expr"] for t in devices["targets"])
    # One row per MIG device: the device itself first, then its values, each with only the
    # device's labels and profile (so that the merge makes one row of them).
    assert info.startswith(f"max by ({MIG_KEY}, profile) (gpu_mig_info{{")
    assert metric_names(info) == {"gpu_mig_info"}
    assert [metric_names(e) for e in values] == [
        {"gpu_mig_memory_used_bytes", "gpu_mig_info"},
        {"gpu_mig_memory_total_bytes", "gpu_mig_info"},
        {"gpu_mig_sm_active_ratio", "gpu_mig_info"},
        {"gpu_mig_tensor_active_ratio", "gpu_mig_info"},
    ]
    for expr in values:
        assert expr.startswith(f"max by ({MIG_KEY}, profile) ("), expr
        assert MIG_JOIN in expr, expr
    # GPM metrics are gauges: shown as they are.
    assert not any("rate(" in e for e in values)
    (used,) = found["MIG device memory used"]["targets"]
    assert metric_names(used["expr"]) == {
        "gpu_mig_memory_used_bytes",
        "gpu_mig_memory_total_bytes",
        "gpu_mig_info",
    }
    assert used["expr"].startswith("(gpu_mig_memory_used_bytes{")
    assert f"}} / on ({MIG_KEY}) gpu_mig_memory_total_bytes{{" in used["expr"]
    assert MIG_JOIN in used["expr"]
    assert used["legendFormat"] == GPU_LEGEND + " {{profile}} {{mig_uuid}}"
    assert found["MIG device memory used"]["fieldConfig"]["defaults"]["min"] == 0


def test_panel_ids_follow_their_row(dashboard: dict[str, Any]) -> None:
    """Panels of row N00 have ids N01, N02, ... in order, so links to a panel survive edits."""
    row_id = 0
    expected = 0
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row_id = expected = panel["id"]
            continue
        expected += 1
        assert panel["id"] == expected and row_id < panel["id"] < row_id + 100, panel["title"]


PROCESS_COLUMNS = ["instance", "gpu", "uuid", "pid", "user", "process", "type"]


def test_tables(dashboard: dict[str, Any]) -> None:
    found = by_title(dashboard)
    for title, queries, columns in [
        ("GPU processes", 2, [*PROCESS_COLUMNS, "Value #A", "Value #B"]),
        ("Idle processes holding GPU memory (30m)", 1, [*PROCESS_COLUMNS, "Value"]),
        ("GPUs", 1, ["instance", "gpu", "uuid", "name", "driver_version"]),
        (
            "XID errors in the last 24 hours",
            1,
            ["instance", "gpu", "uuid", "xid", "resolution", "Value"],
        ),
        ("Memory repair per GPU", 12, ["instance", "gpu", "uuid", "Value #A", "Value #B"]),
        ("Down NVLink links", 1, ["instance", "gpu", "uuid", "link"]),
        ("Failing health checks now", 1, ["instance", "gpu", "uuid", "check", "Value"]),
        ("GPM support per GPU", 1, ["instance", "gpu", "uuid", "name", "Value"]),
        (
            "MIG devices",
            5,
            ["instance", "gpu", "mig_uuid", "profile", *(f"Value #{r}" for r in "BCDE")],
        ),
    ]:
        panel = found[title]
        assert len(panel["targets"]) == queries, title
        for target in panel["targets"]:
            assert target["format"] == "table" and target["instant"] is True, title
        kinds = [t["id"] for t in panel["transformations"]]
        # Several queries are merged into one row per label set before the columns are ordered.
        assert kinds == (["merge", "organize"] if queries > 1 else ["organize"]), title
        order = panel["transformations"][-1]["options"]["indexByName"]
        assert sorted(order, key=order.get)[: len(columns)] == columns, title
    processes = found["GPU processes"]
    rename = processes["transformations"][-1]["options"]["renameByName"]
    assert rename == {"Value #A": "memory", "Value #B": "SM utilization"}
    assert processes["fieldConfig"]["defaults"]["unit"] == "bytes"
    (override,) = processes["fieldConfig"]["overrides"]
    assert override["matcher"] == {"id": "byName", "options": "SM utilization"}
    assert override["properties"] == [{"id": "unit", "value": "percentunit"}]
    metrics = [metric_names(t["expr"]) for t in processes["targets"]]
    assert metrics == [{"gpu_process_memory_used_bytes"}, {"gpu_process_sm_utilization_ratio"}]
    idle = found["Idle processes holding GPU memory (30m)"]
    assert idle["transformations"][-1]["options"]["renameByName"] == {"Value": "memory"}
    assert "max_over_time(" in idle["targets"][0]["expr"] and "== 0" in idle["targets"][0]["expr"]
    xids = found["XID errors in the last 24 hours"]
    assert xids["transformations"][-1]["options"]["renameByName"] == {"Value": "XIDs"}
    assert xids["options"]["sortBy"] == [{"desc": True, "displayName": "XIDs"}]
    # Merged by GPU: every query keeps the GPU's labels and nothing else (no cause, no job).
    memory = found["Memory repair per GPU"]
    for target in memory["targets"]:
        assert target["expr"].startswith("max by (instance, gpu, uuid) ("), target["expr"]
    columns = memory["transformations"][-1]["options"]["renameByName"]
    assert columns["Value #A"] == "remapped rows (correctable)"
    assert columns["Value #L"] == "recovery action"
    mapped = {
        o["matcher"]["options"]: o["properties"][0]["value"]
        for o in memory["fieldConfig"]["overrides"]
    }
    assert (
        mapped["recovery action"] == found["Recovery action"]["fieldConfig"]["defaults"]["mappings"]
    )
    assert {"row remap pending", "row remap failed", "unrepairable"} <= set(mapped)
    mig = found["MIG devices"]["transformations"][-1]["options"]
    assert mig["renameByName"] == {
        "Value #A": "device",
        "Value #B": "memory used",
        "Value #C": "memory total",
        "Value #D": "SM active",
        "Value #E": "tensor active",
    }
    # The parent GPU's UUID is in the GPUs table; the device query's 1 says nothing.
    assert {"uuid", "Value #A"} <= set(mig["excludeByName"])
    assert found["MIG devices"]["fieldConfig"]["defaults"]["unit"] == "bytes"
    assert {
        o["matcher"]["options"]: o["properties"]
        for o in found["MIG devices"]["fieldConfig"]["overrides"]
    } == {
        "SM active": [{"id": "unit", "value": "percentunit"}],
        "tensor active": [{"id": "unit", "value": "percentunit"}],
    }
    failing = found["Failing health checks now"]
    assert failing["transformations"][-1]["options"]["renameByName"] == {"Value": "level"}
    assert failing["options"]["sortBy"] == [{"desc": True, "displayName": "level"}]
    (level,) = failing["fieldConfig"]["overrides"]
    assert level["matcher"] == {"id": "byName", "options": "level"}
    assert level["properties"][0] == {
        "id": "mappings",
        "value": found["GPU health verdict per GPU over time"]["fieldConfig"]["defaults"][
            "mappings"
        ],
    }


def test_queries_for_prometheus() -> None:
    queries = dashboard_queries(DASHBOARD)
    targets = sum(len(p.get("targets", [])) for p in iter_panels(load(DASHBOARD)))
    assert len(queries) == targets
    for title, expr in queries:
        assert "$" not in expr, (title, expr)
        assert 'instance=~".*"' in expr or "instance" not in expr, (title, expr)
    assert substitute('x{instance=~"$instance", gpu=~"${gpu}"}[$__rate_interval]') == (
        'x{instance=~".*", gpu=~".*"}[1m]'
    )
    assert substitute('rate(x{gpu=~"${gpu:regex}"}[${__interval}])') == 'rate(x{gpu=~".*"}[1m])'


def test_queries_parse_with_promtool(tmp_path: Path) -> None:
    """promtool 2.42 has no command that parses a query; a recording rule's expr is parsed."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    rules = [
        {"record": f"dashboard:query_{i}", "expr": expr}
        for i, (_, expr) in enumerate(dashboard_queries(DASHBOARD))
    ]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_provisioning() -> None:
    provisioning = GRAFANA / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    assert datasources["apiVersion"] == 1
    (datasource,) = datasources["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"]
    providers = yaml.safe_load((provisioning / "dashboards" / "gpu-exporter.yaml").read_text())
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == PROVISIONED_DIR
    # The README puts the dashboard JSON in that directory.
    readme = (GRAFANA / "README.md").read_text()
    assert f"{PROVISIONED_DIR}/gpu-exporter.json" in readme
    assert "python grafana/generate.py" in readme


# --- the Health row on a real Prometheus ----------------------------------------------------------

PROMETHEUS = shutil.which("prometheus")


@contextlib.contextmanager
def prometheus(tmp_path: Path, target: str) -> Iterator[int]:
    """A real Prometheus scraping ``target`` as job gpu-exporter every second; its port."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: gpu-exporter\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    log = tmp_path / "prometheus.log"
    argv = [
        str(PROMETHEUS),
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'prom-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with running(argv, log):
        yield port


def prom_query(port: int, expr: str) -> list[dict[str, Any]]:
    """An instant query, now: its result vector; [] while Prometheus is not up yet."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        status, body = http_get(url)
    except OSError:
        return []
    assert status == 200, (expr, body)
    return json.loads(body)["data"]["result"]


#: What the Health row shows for HEALTH_SCENARIO (tests/dashboard.py): (panel title, refId,
#: labels the series has, value). GPU 0 is healthy, GPU 1 has it all.
HEALTH_VALUES: list[tuple[str, str, dict[str, str], float]] = [
    ("XIDs (24h)", "A", {}, 3),  # the first XID of each code counts
    ("GPUs without XID events", "A", {}, 0),
    ("GPUs with a repair pending", "A", {}, 1),
    ("GPUs with failed memory repair", "A", {}, 0),
    ("GPUs needing recovery", "A", {}, 1),
    ("NVLink links down", "A", {}, 1),
    # within a minute of the XIDs: the series are new, which increase() alone would miss
    ("XID errors by code", "A", {"gpu": "1", "xid": "13", "resolution": "restart_app"}, 2),
    ("XID errors by code", "A", {"gpu": "1", "xid": "48", "resolution": "reset_gpu"}, 1),
    ("XID errors in the last 24 hours", "A", {"gpu": "1", "xid": "13"}, 2),
    ("XID errors in the last 24 hours", "A", {"gpu": "1", "xid": "48"}, 1),
    ("Memory repair per GPU", "A", {"gpu": "1"}, 3),  # remapped rows, correctable
    ("Memory repair per GPU", "B", {"gpu": "1"}, 1),  # uncorrectable
    ("Memory repair per GPU", "C", {"gpu": "1"}, 1),  # row remap pending
    ("Memory repair per GPU", "C", {"gpu": "0"}, 0),
    ("Memory repair per GPU", "K", {"gpu": "1"}, 7),  # uncorrected ECC, lifetime
    ("Memory repair per GPU", "L", {"gpu": "1"}, 1),  # recovery action: GPU reset
    ("Memory repair per GPU", "L", {"gpu": "0"}, 0),
    ("Remapped rows and retired pages", "A", {"gpu": "1", "cause": "correctable"}, 3),
    ("Recovery action", "A", {"gpu": "1"}, 1),
    ("PCIe link width vs max", "A", {"gpu": "1"}, 8),
    ("PCIe link width vs max", "B", {"gpu": "1"}, 16),
    ("PCIe link generation vs max", "A", {"gpu": "1"}, 5),
    ("NVLink links down per GPU", "A", {"gpu": "1"}, 1),
    ("Down NVLink links", "A", {"gpu": "1", "link": "3"}, 0),
    ("Video encoder and decoder utilization", "A", {"gpu": "1"}, 0.4),
    ("Video encoder and decoder utilization", "B", {"gpu": "1"}, 0.2),
    # The health action's verdict: GPU 1's XID 48 (reset_gpu) and recovery action are critical.
    ("GPU health verdict per GPU over time", "A", {"gpu": "1"}, 2),
    ("GPU health verdict per GPU over time", "A", {"gpu": "0"}, 0),
    ("Failing health checks over time", "A", {"gpu": "1", "check": "xid"}, 2),
    ("Failing health checks now", "A", {"gpu": "1", "check": "xid"}, 2),
    ("Failing health checks now", "A", {"gpu": "1", "check": "recovery_action"}, 2),
]
#: Rates, with the interval variables at 10 s (what Grafana's $__rate_interval is near for a
#: scrape every second) so that the window fills within the test: same columns, a value per
#: second (ECC errors: per 10 s), within 15 %.
HEALTH_RATES: list[tuple[str, str, dict[str, str], float]] = [
    ("ECC errors", "A", {"gpu": "1", "type": "uncorrected"}, 10),
    ("PCIe traffic", "A", {"gpu": "1"}, 1e9),
    ("PCIe traffic", "B", {"gpu": "1"}, 5e8),
    ("PCIe traffic", "A", {"gpu": "0"}, 0),
    ("PCIe errors per second", "A", {"gpu": "1"}, 1),
    ("PCIe errors per second", "B", {"gpu": "1", "type": "correctable"}, 2),
    ("NVLink traffic per link", "A", {"gpu": "1", "link": "0"}, 2e9),
    ("NVLink traffic per link", "A", {"gpu": "1", "link": "1"}, 0),
    ("NVLink errors per link and type", "A", {"gpu": "1", "link": "0", "type": "replay"}, 0.5),
    ("NVLink errors per link and type", "A", {"gpu": "1", "link": "0", "type": "recovery"}, 0),
    ("Share of time throttled by reason", "A", {"gpu": "1", "reason": "sw_power_cap"}, 0.25),
    ("Share of time throttled by reason", "A", {"gpu": "0", "reason": "sw_power_cap"}, 0),
]


def _problems(
    port: int,
    targets: dict[tuple[str, str], str],
    expected: list[tuple[str, str, dict[str, str], float]],
    tolerance: float,
) -> list[str]:
    """What the queries answer now unlike ``expected`` (and queries without data)."""
    problems = []
    results = {key: prom_query(port, expr) for key, expr in targets.items()}
    for (title, ref), result in results.items():
        if not result:
            problems.append(f"{title} {ref}: no data: {targets[title, ref]}")
    for title, ref, labels, value in expected:
        if (title, ref) not in results:
            continue
        found = [
            float(r["value"][1])
            for r in results[title, ref]
            if labels.items() <= r["metric"].items()
        ]
        if len(found) != 1 or abs(found[0] - value) > tolerance * value + 1e-9:
            problems.append(f"{title} {ref} {labels}: {found}, expected {value}")
    return problems


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (test.sh installs it)")
def test_health_row_on_a_real_prometheus(tmp_path: Path) -> None:
    """The agent on HEALTH_SCENARIO, scraped by a real Prometheus: every query of the Health row
    returns data, and the values it should (counts, states, rates)."""
    health = rows(load(DASHBOARD))["Health"]
    queries = {
        interval: {
            (panel["title"], target["refId"]): substitute(target["expr"], interval)
            for panel in health
            for target in panel["targets"]
        }
        for interval in ("1m", "10s")
    }
    rates = {(title, ref) for title, ref, _, _ in HEALTH_RATES}
    assert {title for title, *_ in HEALTH_VALUES + HEALTH_RATES} == {p["title"] for p in health}
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(HEALTH_SCENARIO)
    simulate = ["--simulate", str(scenario), "--interval", "0.5", "--lock-dir", str(tmp_path)]
    with serve(tmp_path, *simulate) as (agent, agent_port):
        healthz_until(agent, agent_port)
        with prometheus(tmp_path, f"127.0.0.1:{agent_port}") as port:
            # Until all holds at once: the rates once their 10 s fill, the XIDs of the timeline
            # before the series are a minute old.
            deadline = time.monotonic() + 45
            while True:
                problems = _problems(port, queries["1m"], HEALTH_VALUES, 0) + _problems(
                    port,
                    {k: v for k, v in queries["10s"].items() if k in rates},
                    HEALTH_RATES,
                    0.15,
                )
                if not problems or time.monotonic() > deadline:
                    break
                time.sleep(1)
        assert "Traceback" not in stderr_of(agent)
    log = (tmp_path / "prometheus.log").read_text()[-3000:]
    assert not problems, "\n".join(problems) + "\n--- prometheus.log\n" + log


# --- the True utilization row on a real Prometheus ------------------------------------------------

#: The built-in scenario's GPUs with GPM (its H100s); its A100 (2) and RTX 4090 (3) have none.
GPM_GPUS = {"0", "1"}
#: What the True utilization row shows for the built-in scenario (exporter/scenarios/builtin.yaml):
#: (panel title, refId, labels the series has, lowest, highest value).
GPM_VALUES: list[tuple[str, str, dict[str, str], float, float]] = [
    # GPU 0 busy and efficient, GPU 1 busy but few of its SMs at work
    ("SM and tensor activity vs utilization", "A", {"gpu": "0"}, 0.64, 0.80),
    ("SM and tensor activity vs utilization", "A", {"gpu": "1"}, 0.05, 0.15),
    ("SM and tensor activity vs utilization", "B", {"gpu": "0"}, 0.45, 0.65),
    ("SM and tensor activity vs utilization", "B", {"gpu": "1"}, 0.01, 0.01),
    ("SM and tensor activity vs utilization", "C", {"gpu": "0"}, 0.75, 0.95),
    ("SM and tensor activity vs utilization", "C", {"gpu": "1"}, 0.3, 0.98),
    ("DRAM bandwidth utilization", "A", {"gpu": "0"}, 0.30, 0.46),
    ("DRAM bandwidth utilization", "A", {"gpu": "1"}, 0.03, 0.03),
    ("PCIe bandwidth (GPM)", "A", {"gpu": "0"}, 13e9, 13e9),
    ("PCIe bandwidth (GPM)", "B", {"gpu": "0"}, 25e9, 25e9),
    ("PCIe bandwidth (GPM)", "A", {"gpu": "1"}, 5e9, 5e9),
    ("PCIe bandwidth (GPM)", "B", {"gpu": "1"}, 10e9, 10e9),
    ("NVLink bandwidth (GPM)", "A", {"gpu": "0"}, 39e9, 39e9),
    ("NVLink bandwidth (GPM)", "B", {"gpu": "0"}, 39e9, 39e9),
    ("NVLink bandwidth (GPM)", "A", {"gpu": "1"}, 0, 0),
    ("NVLink bandwidth (GPM)", "B", {"gpu": "1"}, 0, 0),
    ("GPUs with GPM", "A", {}, 2, 2),
    ("GPM support per GPU", "A", {"gpu": "0", "name": "NVIDIA H100 80GB HBM3"}, 1, 1),
    ("GPM support per GPU", "A", {"gpu": "1", "name": "NVIDIA H100 80GB HBM3"}, 1, 1),
    ("GPM support per GPU", "A", {"gpu": "2", "name": "NVIDIA A100-SXM4-40GB"}, 0, 0),
    ("GPM support per GPU", "A", {"gpu": "3", "name": "NVIDIA GeForce RTX 4090"}, 0, 0),
]


def _gpm_problems(port: int, targets: dict[tuple[str, str], str]) -> list[str]:
    """What the True utilization row's queries answer now unlike GPM_VALUES: a query without
    data, a graph with other GPUs than the GPM ones, a value out of its range."""
    problems = []
    results = {key: prom_query(port, expr) for key, expr in targets.items()}
    for (title, ref), result in results.items():
        gpus = {r["metric"].get("gpu") for r in result}
        if not result:
            problems.append(f"{title} {ref}: no data: {targets[title, ref]}")
        elif title not in ("GPUs with GPM", "GPM support per GPU") and gpus != GPM_GPUS:
            problems.append(f"{title} {ref}: GPUs {sorted(gpus)}, expected {sorted(GPM_GPUS)}")
    for title, ref, labels, low, high in GPM_VALUES:
        found = [
            float(r["value"][1])
            for r in results[title, ref]
            if labels.items() <= r["metric"].items()
        ]
        # 1e-9: the simulation's floating point (0.03 may come back as 0.030000000000000013)
        if len(found) != 1 or not low - 1e-9 * (1 + low) <= found[0] <= high + 1e-9 * (1 + high):
            problems.append(f"{title} {ref} {labels}: {found}, expected {low} to {high}")
    return problems


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (test.sh installs it)")
def test_true_utilization_row_on_a_real_prometheus(tmp_path: Path) -> None:
    """The agent on the built-in scenario, scraped by a real Prometheus: every query of the True
    utilization row returns data for the H100s (GPM), and the values the scenario gives them."""
    panels = rows(load(DASHBOARD))["True utilization"]
    queries = {
        (panel["title"], target["refId"]): substitute(target["expr"])
        for panel in panels
        if panel["title"] not in MIG_PANELS  # no MIG in the built-in scenario: see below
        for target in panel["targets"]
    }
    assert {(title, ref) for title, ref, *_ in GPM_VALUES} == set(queries)
    simulate = ["--simulate", "--interval", "0.5", "--lock-dir", str(tmp_path)]
    with serve(tmp_path, *simulate) as (agent, agent_port):
        healthz_until(agent, agent_port)
        with prometheus(tmp_path, f"127.0.0.1:{agent_port}") as port:
            # GPM is there from the agent's second sample on, in the scrape after it.
            deadline = time.monotonic() + 45
            while (problems := _gpm_problems(port, queries)) and time.monotonic() < deadline:
                time.sleep(1)
        assert "Traceback" not in stderr_of(agent)
    log = (tmp_path / "prometheus.log").read_text()[-3000:]
    assert not problems, "\n".join(problems) + "\n--- prometheus.log\n" + log


# --- the True utilization row's MIG panels on a real Prometheus -----------------------------------

MIG_A = "MIG-aaaaaaaa-0000-4000-8000-000000000001"
MIG_B = "MIG-bbbbbbbb-0000-4000-8000-000000000002"
#: GPU 0 an H100 in MIG mode with two MIG devices (A nearly full, B with the agent itself on it:
#: its memory counts on B), GPU 1 a GPU without MIG (docs/simulate.md#mig).
MIG_SCENARIO = f"""
gpus:
  - name: NVIDIA H100 80GB HBM3
    gpm: true
    mig_devices:
      - {{uuid: {MIG_A}, profile: 3g.40gb, gpu_instance: 1, memory_total: 40GiB,
         memory_used: 39GiB, fields: {{sm_active: 0.6, tensor_active: 0.3}}}}
      - {{uuid: {MIG_B}, profile: 1g.10gb, gpu_instance: 9, memory_total: 10GiB,
         fields: {{sm_active: 0.2}}}}
    processes:
      - {{pid: self, memory: 4GiB, mig: {MIG_B}}}
  - {{}}
"""
GIB = 1024**3
#: Each MIG device's profile: every query of the MIG panels returns these devices (of GPU 0),
#: and no other series, each with its profile joined in from gpu_mig_info.
MIG_DEVICES = {MIG_A: "3g.40gb", MIG_B: "1g.10gb"}
#: What the MIG panels show for MIG_SCENARIO: (panel title, refId, MIG device, value).
MIG_VALUES: list[tuple[str, str, str, float]] = [
    ("MIG devices", "A", MIG_A, 1),
    ("MIG devices", "A", MIG_B, 1),
    ("MIG devices", "B", MIG_A, 39 * GIB),
    ("MIG devices", "B", MIG_B, 4 * GIB),  # its own 0, and the process on it
    ("MIG devices", "C", MIG_A, 40 * GIB),
    ("MIG devices", "C", MIG_B, 10 * GIB),
    ("MIG devices", "D", MIG_A, 0.6),  # GPM: from the agent's second sample on
    ("MIG devices", "D", MIG_B, 0.2),
    ("MIG devices", "E", MIG_A, 0.3),
    ("MIG devices", "E", MIG_B, 0),
    ("MIG device memory used", "A", MIG_A, 39 / 40),
    ("MIG device memory used", "A", MIG_B, 0.4),
]


def _mig_problems(port: int, targets: dict[tuple[str, str], str]) -> list[str]:
    """What the MIG panels' queries answer now unlike MIG_VALUES: other series than the MIG
    devices of GPU 0 with their profile, a value that differs."""
    problems = []
    results = {key: prom_query(port, expr) for key, expr in targets.items()}
    for (title, ref), result in results.items():
        devices = sorted(
            (r["metric"].get("gpu"), r["metric"].get("mig_uuid"), r["metric"].get("profile"))
            for r in result
        )
        expected = sorted(("0", mig, profile) for mig, profile in MIG_DEVICES.items())
        if devices != expected:
            problems.append(f"{title} {ref}: {devices}, expected {expected}: {targets[title, ref]}")
    for title, ref, mig, value in MIG_VALUES:
        found = [
            float(r["value"][1]) for r in results[title, ref] if r["metric"].get("mig_uuid") == mig
        ]
        # 1e-9: the simulation's floating point (0.6 may come back as 0.5999999999999999)
        if len(found) != 1 or abs(found[0] - value) > 1e-9 * (1 + value):
            problems.append(f"{title} {ref} {mig}: {found}, expected {value}")
    return problems


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (test.sh installs it)")
def test_mig_panels_on_a_real_prometheus(tmp_path: Path) -> None:
    """The agent on MIG_SCENARIO, scraped by a real Prometheus: every query of the True
    utilization row's MIG panels returns the two MIG devices of GPU 0, with their profile, and
    the memory and GPM values the scenario gives them."""
    panels = [p for p in rows(load(DASHBOARD))["True utilization"] if p["title"] in MIG_PANELS]
    assert [p["title"] for p in panels] == MIG_PANELS
    queries = {
        (panel["title"], target["refId"]): substitute(target["expr"])
        for panel in panels
        for target in panel["targets"]
    }
    assert {(title, ref) for title, ref, *_ in MIG_VALUES} == set(queries)
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(MIG_SCENARIO)
    simulate = ["--simulate", str(scenario), "--interval", "0.5", "--lock-dir", str(tmp_path)]
    with serve(tmp_path, *simulate) as (agent, agent_port):
        healthz_until(agent, agent_port)
        with prometheus(tmp_path, f"127.0.0.1:{agent_port}") as port:
            # GPM is there from the agent's second sample on, in the scrape after it.
            deadline = time.monotonic() + 45
            while (problems := _mig_problems(port, queries)) and time.monotonic() < deadline:
                time.sleep(0.5)
        assert "Traceback" not in stderr_of(agent)
    log = (tmp_path / "prometheus.log").read_text()[-3000:]
    assert not problems, "\n".join(problems) + "\n--- prometheus.log\n" + log
