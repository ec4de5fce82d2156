"""End to end with real components on loopback: the agent on simulated GPUs, a real Prometheus
scraping it with our rules, a real Alertmanager routing to a webhook this test runs.

The scenario heats GPU 0 and cools it again, leaves an orphan holding GPU 1, and keeps GPU 2 fit
to recommend while it reports XID 79 (fallen off the bus: resolution reboot) and a row remapping
pending. GPU 3 has every health signal the dashboard's Health row shows (tests/dashboard.py).
GPU 0 is also a pod's (a fake kubelet) and GPU 1 Slurm job 4242's, both idle, and a job on GPU 0
grows its memory at every sample: the Waste row's allocations, idle GPU-hours and leak suspect.
The thermal, zombie, fatal XID and row remapping alerts must fire in Prometheus, reach the
webhook through Alertmanager with the right labels, and the thermal one must resolve. Then every
query of the Grafana dashboard must return data from that Prometheus.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.agent import free_port, healthz_until, http_get, running, serve, stderr_of
from tests.dashboard import HEALTH_GPU
from tests.kubelet import fake_kubelet

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (PROMETHEUS and ALERTMANAGER),
        reason="needs Debian's prometheus and prometheus-alertmanager (test.sh installs them)",
    ),
]

SCENARIO = (
    """
gpus:
  # GPU 0: allocated to a pod (the fake kubelet) and idle, and a job on it whose memory grows at
  # every sample (a leak suspect), for the Waste row
  - name: NVIDIA H100 80GB HBM3
    temperature: {points: [[0s, 45], [4s, 45], [6s, 93], [22s, 93], [24s, 45]]}
    processes:
      - {spawn: [sleep, "120"], memory: {from: 1GiB, to: 41GiB, over: 120s}}
  # GPU 1: allocated to Slurm job 4242 (the job-mapping directory) and idle
  - name: NVIDIA H100 80GB HBM3
    temperature: 45
    processes:
      - {spawn: [sleep, "120"], orphan: true, memory: 3GiB}
  # a fatal XID and a pending row remapping (so the health verdict leaves it out of the
  # recommendations too). Its XID comes a few seconds in, after the agent registered the GPU
  # for XID events (NVML delivers none from before); the remapping is there from the start.
  - name: NVIDIA H100 80GB HBM3
    temperature: 40
    xids: [{at: 4s, code: 79}]
    fields: {row_remap_pending: 1}
"""
    + HEALTH_GPU  # GPU 3
    + """
  # GPU 4: neither hot, nor held by a zombie, nor unhealthy: there is always one to recommend
  # (GPU 0 is a hotspot a while, GPU 1 is left out once its orphan is found, GPUs 2 and 3 are
  # critical by the health verdict). It has GPM, for the True utilization row.
  - name: NVIDIA H100 80GB HBM3
    temperature: 40
    gpm: true
    fields:
      sm_active: 0.4
      tensor_active: 0.2
      dram_active: 0.3
      pcie_transmit_rate: 1e9
      pcie_receive_rate: 2e9
      nvlink_transmit_rate: 3e9
      nvlink_receive_rate: 3e9
  # GPU 5: in MIG mode, one job on one of its two MIG devices, for the MIG panels
  - name: NVIDIA H100 80GB HBM3
    temperature: 40
    gpm: true
    mig_devices:
      - {uuid: MIG-e2e00000-0000-4000-8000-000000000001, profile: 3g.40gb, memory_total: 40GiB,
         fields: {sm_active: 0.5, tensor_active: 0.25}}
      - {uuid: MIG-e2e00000-0000-4000-8000-000000000002, profile: 3g.40gb, gpu_instance: 2,
         memory_total: 40GiB}
    processes:
      - {spawn: [sleep, "120"], memory: 8GiB, mig: MIG-e2e00000-0000-4000-8000-000000000001}
"""
)
CONFIG = """
actions:
  thermal: {every: 500ms, for: 2s}
  zombie_reaper: {every: 500ms, min_age: 1s, protect_users: []}
  recommend: {every: 1s}
  waste: {every: 500ms, for: 2s, leak: {samples: 3, min_growth: 1MiB}}
"""
#: GPU 0 given to a pod: who the Waste row's idle GPU-hours by namespace charge
PODS = [("team-a", "notebook", "main", "nvidia.com/gpu", ["0"])]


class Webhook:
    """Alertmanager's webhook receiver: keeps every notification it is sent."""

    def __init__(self) -> None:
        self.notifications: list[dict] = []
        received = self.notifications

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                received.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self, name: str, status: str, **labels: str) -> list[dict]:
        """The alerts named ``name`` in ``status`` received so far, with these ``labels``."""
        return [
            alert
            for note in self.notifications
            for alert in note["alerts"]
            if alert["labels"].get("alertname") == name
            and alert["status"] == status
            and all(alert["labels"].get(k) == v for k, v in labels.items())
        ]


def short_rules(tmp_path: Path) -> Path:
    """Our rules with every ``for:`` cut to 1s, so alerts fire within the test."""
    text = (ROOT / "rules" / "gpu-exporter.rules.yml").read_text()
    path = tmp_path / "rules.yml"
    path.write_text(re.sub(r"(?m)^(\s*)for:\s*\S+\s*$", r"\1for: 1s", text))
    return path


def query(prometheus: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    status, body = http_get(url)
    assert status == 200, body
    return json.loads(body)["data"]["result"]


def wait_until(what: str, check, timeout: float, logs: list[Path]):
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
            raise AssertionError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.5)


def test_alerts_fire_reach_the_webhook_and_resolve(tmp_path):
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(SCENARIO)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    webhook = Webhook()
    am_port, prom_port = free_port(), free_port()
    (tmp_path / "alertmanager.yml").write_text(
        "route:\n"
        "  receiver: webhook\n"
        "  group_by: [alertname, instance, gpu]\n"
        "  group_wait: 1s\n"
        "  group_interval: 1s\n"
        "  repeat_interval: 1h\n"
        "receivers:\n"
        "  - name: webhook\n"
        "    webhook_configs:\n"
        f"      - url: http://127.0.0.1:{webhook.port}/\n"
        "        send_resolved: true\n"
    )
    logs = [tmp_path / "prometheus.log", tmp_path / "alertmanager.log"]
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "1").write_text("4242 0\n")  # as a prolog writes it: GPU 1 is job 4242's
    (tmp_path / "kubelet").mkdir()
    with (
        fake_kubelet(tmp_path / "kubelet", PODS) as kubelet,
        serve(
            tmp_path,
            "--simulate",
            str(scenario),
            "--config",
            str(config),
            "--interval",
            "0.5",
            "--lock-dir",
            str(tmp_path),
            "--slurm-job-dir",
            str(jobs),
            "--kubelet-socket",
            kubelet.path,
        ) as (agent, agent_port),
    ):
        healthz_until(agent, agent_port)
        (tmp_path / "prometheus.yml").write_text(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  evaluation_interval: 1s\n"
            f"rule_files: [{short_rules(tmp_path)}]\n"
            "alerting:\n"
            "  alertmanagers:\n"
            f"    - static_configs: [{{targets: ['127.0.0.1:{am_port}']}}]\n"
            "scrape_configs:\n"
            "  - job_name: gpu-exporter\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{agent_port}']}}]\n"
        )
        alertmanager = [
            ALERTMANAGER,
            f"--config.file={tmp_path / 'alertmanager.yml'}",
            f"--storage.path={tmp_path / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{am_port}",
            "--cluster.listen-address=",
        ]
        prometheus = [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'prom-data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ]
        with running(alertmanager, logs[1]), running(prometheus, logs[0]):
            hot = wait_until(
                "the hotspot alert at the webhook",
                lambda: webhook.alerts("GpuThermalHotspotCritical", "firing"),
                timeout=60,
                logs=logs,
            )
            labels = hot[0]["labels"]
            assert labels["gpu"] == "0" and labels["uuid"].startswith("GPU-")
            assert labels["instance"] == f"127.0.0.1:{agent_port}"
            assert labels["severity"] == "critical"
            assert str(labels["gpu"]) in hot[0]["annotations"]["summary"] + hot[0][
                "annotations"
            ].get("description", "")

            orphan = wait_until(
                "the zombie alert at the webhook",
                lambda: webhook.alerts("GpuZombieProcesses", "firing"),
                timeout=60,
                logs=logs,
            )
            assert orphan[0]["labels"]["class"] == "orphan"
            assert orphan[0]["labels"]["gpu"] == "1"

            # A health signal pushed by NVML (the XID) and one read as a field value, each
            # through its alert with the labels that say which GPU and what happened.
            xid = wait_until(
                "the fatal XID alert of GPU 2 at the webhook",
                lambda: webhook.alerts("GpuXidFatal", "firing", gpu="2"),
                timeout=60,
                logs=logs,
            )
            (gpu2,) = query(prom_port, 'gpu_up{gpu="2"}')
            xid_labels = xid[0]["labels"]
            assert xid_labels["gpu"] == "2" and xid_labels["uuid"] == gpu2["metric"]["uuid"]
            assert xid_labels["xid"] == "79" and xid_labels["resolution"] == "reboot"
            assert xid_labels["instance"] == f"127.0.0.1:{agent_port}"
            assert xid_labels["severity"] == "critical"
            assert "XID 79" in xid[0]["annotations"]["summary"]
            remap = wait_until(
                "the row remapping alert of GPU 2 at the webhook",
                lambda: webhook.alerts("GpuRowRemapPending", "firing", gpu="2"),
                timeout=60,
                logs=logs,
            )
            assert remap[0]["labels"]["uuid"] == gpu2["metric"]["uuid"]

            resolved = wait_until(
                "the hotspot alert to resolve",
                lambda: webhook.alerts("GpuThermalHotspotCritical", "resolved"),
                timeout=60,
                logs=logs,
            )
            assert resolved[0]["labels"]["uuid"] == labels["uuid"]
            assert not query(prom_port, 'ALERTS{alertname="GpuThermalHotspotCritical"}')

            _every_dashboard_query_returns_data(prom_port, logs)
        agent.terminate()
        agent.wait(timeout=5)
        assert "Traceback" not in stderr_of(agent)


def _every_dashboard_query_returns_data(prom_port: int, logs: list[Path]) -> None:
    from tests.dashboard import dashboard_queries

    queries = dashboard_queries(ROOT / "grafana" / "gpu-exporter.json")
    assert queries
    empty = []
    for title, expr in queries:
        if not query(prom_port, expr):
            empty.append(f"{title}: {expr}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
