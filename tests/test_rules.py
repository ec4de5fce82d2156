"""The Prometheus rules in rules/: promtool's own checks and unit tests, plus checks of our
conventions that promtool does not make (every alert has for, severity, summary, description
and a runbook that exists; every alert is tested firing and silent; every metric the rules name
is documented)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
RULES_DIR = ROOT / "rules"
RULES = RULES_DIR / "gpu-exporter.rules.yml"
RULE_TESTS = sorted((RULES_DIR / "tests").glob("*.yml"))
RUNBOOK = RULES_DIR / "README.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"

SEVERITIES = {"critical", "warning", "info"}
ANNOTATIONS = ("summary", "description", "runbook")
# Alerts that the end-to-end test relies on, with the labels they must keep.
REQUIRED_ALERTS = {
    "GpuThermalHotspotWarning": "gpu_thermal_hotspot",
    "GpuThermalHotspotCritical": "gpu_thermal_hotspot",
    "GpuZombieProcesses": "gpu_zombie_processes",
    "GpuXidFatal": "gpu_xid_errors_total",
}
#: An aggregation, which would take labels away from a per-GPU alert.
AGGREGATION = re.compile(
    r"\b(sum|avg|max|min|count|group|stddev|stdvar|topk|bottomk|quantile|count_values)\s*(\(|by\b|without\b)"
    r"|\b(by|without)\s*\("
)
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
#: A metric name the rules may use: the agent's gpu_* and prometheus_client's process_*.
METRIC = re.compile(r"(?<![\w:])((?:gpu|process)_[a-z0-9_]+)(?![\w:])")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "promtool is not installed (Debian/Ubuntu package 'prometheus', or the binary from "
            "a Prometheus release); test.sh is meant to install it"
        )
    return path


def _run(*args: str) -> None:
    proc = subprocess.run(
        [_promtool(), *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0:
        pytest.fail(
            f"promtool {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}",
            pytrace=False,
        )


def _rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _alerts() -> list[dict]:
    return [rule for rule in _rules() if "alert" in rule]


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_promtool_check_rules() -> None:
    _run("check", "rules", str(RULES.relative_to(ROOT)))


def test_promtool_unit_tests() -> None:
    assert RULE_TESTS, "no rules/tests/*.yml"
    _run("test", "rules", *(str(p.relative_to(ROOT)) for p in RULE_TESTS))


def test_every_alert_has_for_severity_and_annotations() -> None:
    alerts = _alerts()
    assert alerts
    problems = []
    for rule in alerts:
        name = rule["alert"]
        if not DURATION.match(str(rule.get("for", ""))):
            problems.append(f"{name}: no plain `for:` duration ({rule.get('for')!r})")
        severity = (rule.get("labels") or {}).get("severity")
        if severity not in SEVERITIES:
            problems.append(f"{name}: severity {severity!r} not one of {sorted(SEVERITIES)}")
        annotations = rule.get("annotations") or {}
        for key in ANNOTATIONS:
            if not str(annotations.get(key, "")).strip():
                problems.append(f"{name}: no {key} annotation")
    assert not problems, "\n".join(problems)


def test_for_is_a_plain_line_for_every_alert() -> None:
    # The end-to-end test shortens the durations textually: each `for:` must be a line of its own.
    lines = re.findall(r"^\s+for: (\S+)\s*$", RULES.read_text(), flags=re.MULTILINE)
    assert len(lines) == len(_alerts())
    assert all(DURATION.match(d) for d in lines), lines


def test_runbook_anchors_exist() -> None:
    anchors = {
        _slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", RUNBOOK.read_text(), re.MULTILINE)
    }
    problems = []
    for rule in _alerts():
        runbook = rule["annotations"]["runbook"]
        path, _, anchor = runbook.partition("#")
        if path != "rules/README.md" or anchor not in anchors:
            problems.append(f"{rule['alert']}: runbook {runbook!r} has no heading in {RUNBOOK}")
    assert not problems, "\n".join(problems)


def test_every_alert_is_tested_firing_and_silent() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        for case in doc.get("tests") or []:
            for check in case.get("alert_rule_test") or []:
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {rule["alert"] for rule in _alerts()}
    assert not names - firing, f"alerts never tested firing: {sorted(names - firing)}"
    assert not names - silent, f"alerts never tested silent: {sorted(names - silent)}"
    assert not (firing | silent) - names, f"tests of unknown alerts: {(firing | silent) - names}"


def test_every_recording_rule_is_tested() -> None:
    tested = ""
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        for case in doc.get("tests") or []:
            tested += " ".join(check["expr"] for check in case.get("promql_expr_test") or [])
    records = [rule["record"] for rule in _rules() if "record" in rule]
    assert records
    untested = [r for r in records if not re.search(rf"(?<![\w:]){re.escape(r)}(?![\w:])", tested)]
    assert not untested, f"recording rules without a promql_expr_test: {untested}"


def _referenced_metrics() -> set[str]:
    names: set[str] = set()
    for rule in _rules():
        expr = rule["expr"]
        # Label values in matchers (reason="gpu_idle") are not metric names; the replacement
        # strings of label_replace ("metric", "gpu_up", ...) are, and stay.
        expr = re.sub(r'(=~|!~|!=|=)\s*"[^"]*"', "", expr)
        names |= set(METRIC.findall(expr))
        for text in (rule.get("annotations") or {}).values():
            names |= set(METRIC.findall(str(text)))
    return names


def test_every_referenced_metric_is_documented() -> None:
    documented = set(re.findall(r"`((?:gpu|process)_[a-z0-9_]+)", METRICS_DOC.read_text()))
    referenced = _referenced_metrics()
    assert {"gpu_thermal_hotspot", "process_open_fds"} <= referenced  # the extraction works
    missing = sorted(referenced - documented)
    assert not missing, f"metrics the rules use but docs/metrics.md does not list: {missing}"


def test_alerts_the_end_to_end_test_needs() -> None:
    alerts = _alerts()
    for name, metric in REQUIRED_ALERTS.items():
        rules = [r for r in alerts if r["alert"] == name]
        assert rules, f"no alert {name}"
        for rule in rules:
            assert metric in rule["expr"], (name, rule["expr"])
            # A per-GPU alert must not aggregate away instance, gpu or uuid.
            assert not AGGREGATION.search(rule["expr"]), (name, rule["expr"])
    zombie_classes = {
        r["labels"].get("class") for r in alerts if r["alert"] == "GpuZombieProcesses"
    }
    assert zombie_classes == {"orphan", "defunct", "uninterruptible", "unverifiable", "leaked"}


def test_job_name_only_where_targets_are_found() -> None:
    # Only the rules that must find the scrape targets themselves name the job (README).
    for rule in _rules():
        if 'job="' in rule["expr"]:
            assert 'job="gpu-exporter"' in rule["expr"], rule.get("alert", rule.get("record"))
            assert rule.get("alert") in {
                "GpuExporterAbsent",
                "GpuExporterDown",
                "GpuExporterMetricMissing",
                "GpuMetricMissing",
            }, rule.get("alert", rule.get("record"))


def test_process_metrics_only_of_the_agents() -> None:
    # Every Python exporter has process_*: a rule on their values keeps only the targets that
    # export a gpu_exporter_* metric, whatever the job is called. (The missing-metric check only
    # asks whether an agent's target has them: `unless on (...) process_...`.)
    rules = []
    for rule in _rules():
        expr = " ".join(rule["expr"].split())
        values = re.sub(r'"[^"]*"|\bunless on \([^)]*\) process_\w+', "", expr)
        if re.search(r"(?<![\w:])process_", values):
            rules.append((rule.get("alert", rule.get("record")), expr))
    assert rules
    for name, expr in rules:
        assert re.search(r"\band on \(job, instance\) gpu_exporter_\w+$", expr), (name, expr)


def test_health_alerts_keep_every_label_of_their_series() -> None:
    # The health alerts are per GPU (per link for NVLink): each keeps instance, gpu and uuid and
    # the label that says what is wrong (xid and resolution, link, type, reason), so none may
    # aggregate, and none may rename labels.
    doc = yaml.safe_load(RULES.read_text())
    (group,) = [g for g in doc["groups"] if g["name"] == "gpu-exporter.health"]
    alerts = [r for r in group["rules"] if "alert" in r]
    assert {"GpuXidFatal", "GpuXidError", "GpuNvlinkDown"} <= {r["alert"] for r in alerts}
    for rule in alerts:
        assert not AGGREGATION.search(rule["expr"]), (rule["alert"], rule["expr"])
        assert "label_replace" not in rule["expr"] and "label_join" not in rule["expr"]


def test_aggregation_pattern() -> None:
    # The pattern above finds aggregations, and not the *_over_time functions or `on (...)`.
    assert AGGREGATION.search("sum by (job) (x)")
    assert AGGREGATION.search("max(x)")
    assert AGGREGATION.search("count without (gpu) (x)")
    assert AGGREGATION.search("x / on (job) group_left sum(y)")
    assert not AGGREGATION.search("max_over_time(x[1d:15m]) == 1 and on (job, gpu) y")
    assert not AGGREGATION.search("count_over_time(x[1d:15m]) unless on (job) y offset 1h")


def test_verdict_alerts_follow_the_contract() -> None:
    # The health action's verdict: gpu_health 0 ok, 1 warning, 2 critical. Per GPU like the
    # health alerts (no aggregation, no renamed labels), and their annotations name the failing
    # checks from gpu_health_check.
    doc = yaml.safe_load(RULES.read_text())
    (group,) = [g for g in doc["groups"] if g["name"] == "gpu-exporter.verdict"]
    alerts = {r["alert"]: r for r in group["rules"] if "alert" in r}
    assert set(alerts) == {"GpuUnhealthy", "GpuDegraded"}
    for name, expr, severity in (
        ("GpuUnhealthy", "gpu_health == 2", "critical"),
        ("GpuDegraded", "gpu_health == 1", "warning"),
    ):
        rule = alerts[name]
        assert rule["expr"] == expr and rule["labels"]["severity"] == severity, name
        assert "gpu_health_check{" in rule["annotations"]["summary"], name
        assert "gpu_health_check{" in rule["annotations"]["description"], name
    assert alerts["GpuDegraded"]["for"] == "15m"
    assert alerts["GpuUnhealthy"]["for"] in ("0s", "1m")
