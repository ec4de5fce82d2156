"""The Grafana dashboard: generated, well formed, and querying only documented metrics."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.dashboard import DASHBOARD, ROOT, dashboard_queries, iter_panels, load, substitute

GRAFANA = ROOT / "grafana"
DATASOURCE_UID = "${datasource}"
PROVISIONED_DIR = "/var/lib/grafana/dashboards/gpu-exporter"

#: Exported by the agent (exporter/exposition/metrics.py) but not yet listed in docs/metrics.md.
#: Drop a name from here once the docs list it.

#: Metrics without the gpu label (so their selectors take no gpu=~"$gpu"): the agent's own, and
#: prometheus_client's process_* metrics of the agent's process.
NO_GPU_LABEL = re.compile(r"gpu_exporter_\w+|gpu_recommended_devices|process_\w+")

#: A metric name in PromQL or in docs/metrics.md: the agent's gpu_* and the process_* ones.
#: (``gpu_process_*`` is one name: no word boundary inside it.)
METRIC = r"\b(?:gpu|process)_\w+"

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


def test_every_metric_is_documented(dashboard: dict[str, Any]) -> None:
    documented = set(re.findall(METRIC, (ROOT / "docs" / "metrics.md").read_text()))
    for panel in panels(dashboard):
        for target in panel["targets"]:
            for name in metric_names(target["expr"]):
                assert name in documented, (panel["title"], name)


def test_every_selector_is_filtered(dashboard: dict[str, Any]) -> None:
    selector = re.compile(rf"({METRIC})(\{{[^}}]*\}})?")
    for panel in panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"]
            for name, matchers in selector.findall(expr):
                where = (panel["title"], name, expr)
                assert 'job="gpu-exporter"' in matchers, where
                assert 'instance=~"$instance"' in matchers, where
                if not NO_GPU_LABEL.fullmatch(name):
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
    assert rows == ["Fleet overview", "Processes", "Actions", "Agent health"]


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
