"""bench/scale.py at a tiny size: 3 hosts x 10 minutes, the real agent, promtool and Prometheus.

No timing is asserted (the figures depend on the machine): that every phase ran, that the
TSDB holds what was generated, that every dashboard and fleet query was answered, and that
nothing it started is left running. Its generator is checked on its own too.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script, pids_running

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCALE = REPO / "bench" / "scale.py"
TOOLS = shutil.which("promtool") is not None and shutil.which("prometheus") is not None


def _prometheus_processes(folder: Path) -> list[int]:
    """PIDs of the processes whose command line names ``folder``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if str(folder).encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
            except OSError:
                continue
    return found


@pytest.mark.skipif(not TOOLS, reason="needs promtool and prometheus on the PATH")
def test_tiny_fleet_runs_every_phase_and_leaves_nothing(tmp_path: Path) -> None:
    before = pids_running(b"sleep\x0086400\x00")
    keep, report = tmp_path / "work", tmp_path / "scale.json"
    argv = [sys.executable, str(SCALE), "--phases", "host,tsdb,query,head", "--no-mig"]
    argv += ["--hosts", "3", "--hours", "0.17", "--step", "30", "--lead", "5m"]
    argv += ["--runs", "2", "--rank-runs", "1", "--top", "1", "--chunk-hosts", "2"]
    argv += ["--head-interval", "2", "--head-scrapes", "1", "--target-hosts", "2"]
    argv += ["--no-compaction-wait", "--keep", str(keep), "--json", str(report)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    figures = json.loads(report.read_text())

    host = figures["host"][0]
    assert host["by_kind"]["per process"] == 8 * 16 * len(host["process_families"])
    assert host["by_kind"]["per NVLink link"] > 0 and host["by_kind"]["per GPU"] > 0
    assert host["sizes"]["text, gzip"] < host["sizes"]["text"] / 5

    tsdb = figures["tsdb"]
    per_host = host["series"] + 5  # and Prometheus' up and scrape_* of each target
    assert tsdb["series"] == 3 * per_host
    assert tsdb["samples"] == tsdb["series"] * tsdb["grid"]["samples"]
    # promtool cuts a chunk's blocks at multiples of its block duration (2 h here) since the
    # epoch, so a grid that spans such a boundary makes two blocks a chunk.
    span = 2 * 3600
    windows = tsdb["grid"]["end"] // span - tsdb["grid"]["start"] // span + 1
    assert tsdb["chunks"] == 2 and tsdb["blocks"] == 2 * windows  # overlapping across chunks

    dashboard = figures["dashboard_all"]
    assert len(dashboard) > 50 and not [t for t in dashboard if t["error"]]
    assert any(t["series"] >= 3 * 8 for t in dashboard)  # every host's GPUs are there
    assert len(figures["dashboard_heavy"]) == 3  # instant, range of all, range of one
    fleet = figures["fleet"]
    if fleet["available"]:
        assert fleet["problems"] == [] and fleet["printed"].startswith("gpu-node-")
        assert len(fleet["command_s"]) == 2
    assert fleet["queries"] and not [q for q in fleet["queries"] if q["error"]]

    head = figures["head"]
    assert head["head_series"] >= 3 * host["series"] and not head["stopped_early"]

    assert not _prometheus_processes(keep), "a Prometheus or promtool is still running"
    assert not (pids_running(b"sleep\x0086400\x00") - before), "the host's processes are left"
    assert (keep / "tsdb").is_dir() and not list(keep.glob("chunk-*"))


def test_generated_exposition_is_valid_openmetrics_with_a_series_per_host() -> None:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    scale = load_script(SCALE)
    scrape = (
        b"# HELP gpu_up 1 while up.\n# TYPE gpu_up gauge\n"
        b'gpu_up{gpu="0",uuid="GPU-b3ac0000-0000-4000-8000-000000000000"} 1.0\n'
        b"# TYPE gpu_energy_joules counter\n# UNIT gpu_energy_joules joules\n"
        b'gpu_energy_joules_total{gpu="0",uuid="GPU-b3ac0000-0000-4000-8000-000000000000"} 10.0\n'
        b"# TYPE gpu_utilization_ratio gauge\n"
        b'gpu_utilization_ratio{gpu="0",uuid="GPU-b3ac0000-0000-4000-8000-000000000000"} 0.9\n'
        b"# TYPE gpu_process_memory_used_bytes gauge\n"
        b'gpu_process_memory_used_bytes{gpu="0",pid="42",uuid="GPU-b3ac0000-0000-4000-8000-'
        b'000000000000"} 1024.0\n# EOF\n'
    )
    later = scrape.replace(b"} 10.0", b"} 30.0").replace(b"} 0.9", b"} 0.7")
    model = scale.fleet_model(scrape, later, 2.0, 1000.0)
    kinds = {s.name: s.kind for f in model for s in f.series}
    assert kinds == {
        "gpu_up": "const",
        "gpu_energy_joules_total": "counter",
        "gpu_utilization_ratio": "wave",
        "gpu_process_memory_used_bytes": "const",
    }
    out = io.StringIO()
    times = [1000, 1030, 1060]
    written = scale.write_exposition(out, model, range(2), times, 1000.0)
    assert written == 4 * 2 * 3
    families = {f.name: f for f in text_string_to_metric_families(out.getvalue())}
    energy = [s for s in families["gpu_energy_joules"].samples if s.name.endswith("_total")]
    assert {s.labels["instance"] for s in energy} == {"gpu-node-0000:9402", "gpu-node-0001:9402"}
    assert len({s.labels["uuid"] for s in energy}) == 2  # each host its own GPU UUIDs
    host0 = [s.value for s in energy if s.labels["instance"] == "gpu-node-0000:9402"]
    assert host0 == sorted(host0) and host0[0] < host0[-1]  # a counter only grows
    ratios = [s.value for s in families["gpu_utilization_ratio"].samples]
    assert all(0 <= v <= 1 for v in ratios) and len(set(ratios)) > 1
    pids = {s.labels["pid"] for s in families["gpu_process_memory_used_bytes"].samples}
    assert len(pids) == 2


def test_churn_scenario_is_a_valid_scenario(tmp_path: Path) -> None:
    from exporter.simulate.scenario import load_scenario

    scale = load_script(SCALE)
    path = tmp_path / "churn.yaml"
    path.write_text(scale.churn_scenario(30.0))
    scenario = load_scenario(str(path))
    assert len(scenario.gpus) == 8
    assert all(len(gpu.processes) == 16 for gpu in scenario.gpus)
