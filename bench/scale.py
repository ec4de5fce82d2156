#!/usr/bin/env python3
"""Fleet scale: what one host costs a Prometheus, and how a Prometheus of many hosts answers.

    .venv/bin/python bench/scale.py                          # every phase, 1,000 hosts (minutes)
    .venv/bin/python bench/scale.py --phases host,churn      # one simulated host only
    .venv/bin/python bench/scale.py --phases host,tsdb --hosts 3 --hours 0.17 --step 30 --runs 2

Phases (``--phases``, in this order):

host   The real agent (``serve --simulate``) on bench/benchmark.py's 8 GPUs x 16 processes with
       every feature the simulation has: GPM, 18 NVLink links, XIDs, per-process utilization, the
       actions at their defaults (thermal, health, recommend, zombie_reaper); Slurm and kubelet
       attribution off. Series by kind, bytes per scrape (text and OpenMetrics, plain and gzip),
       and the same for the GPUs in MIG mode (7 MIG devices each).
churn  The same 8 x 16 host with every process replaced every ``--churn-period`` (half real
       ``sleep`` children, half PIDs this host cannot see, as in bench/soak.py), scraped every
       second: distinct per-process series and new series per hour.
tsdb   One real OpenMetrics scrape of the host (two, for rates) becomes ``--hosts`` hosts over
       ``--hours`` at ``--step``: new instance labels, UUIDs and PIDs per host, values that move
       per host and per timestamp. Written in chunks of hosts with ``promtool tsdb
       create-blocks-from openmetrics``, then served by ``prometheus`` (empty scrape config) on a
       free loopback port once it has compacted the chunks' overlapping blocks.
query  On that Prometheus: every query of the Grafana dashboard (tests/dashboard.py) at the end
       time, the ``--top`` heaviest ``--runs`` times (instant, and query_range over ``--hours``
       for all instances and for one), and ``gpu-exporter recommend --prometheus`` end to end with
       each of its queries when exporter/launcher/fleet.py is there.
head   A Prometheus that scrapes the ``--hosts`` hosts live (one target per ``--target-hosts``
       hosts, ``honor_labels``) for ``--head-scrapes`` scrapes: head series, RSS, CPU.

Every process it starts is stopped at the end, also on errors and Ctrl-C; its folders are
removed unless ``--keep DIR``. See docs/scale.md for what the figures mean and a run's results.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import io
import itertools
import json
import math
import os
import re
import shutil
import signal
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark import (
    REPO,
    Reaper,
    _fmt,
    _free_port,
    _percentile,
    machine,
    make_host,
    scenario_yaml,
)
from soak import INVISIBLE_BASE, INVISIBLE_STRIDE

sys.path.insert(0, str(REPO))
from tests.dashboard import iter_panels, substitute
from tests.dashboard import load as load_dashboard

PHASES = ("host", "churn", "tsdb", "query", "head")
#: What Prometheus 2.42 sends when it scrapes.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
GPUS, PER_GPU, MIG_DEVICES = 8, 16, 7
#: The churn phase's real processes: two days' sleep, told apart from benchmark.py's and soak.py's.
SLEEP = ["sleep", "172800"]
JOB = "gpu-exporter"
PROMTOOL = ("promtool", "tsdb", "create-blocks-from", "openmetrics", "--quiet")
PORT = 9402  # the agent's default, in the instance labels
#: Grafana's points per panel (about its width in pixels): a query_range step is at least
#: range / this, and at least the scrape interval (the data's step here).
MAX_POINTS = 1000
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAMES = re.compile(r'(?:^|,)(\w+)="')
_UUID = re.compile(r'(uuid="(?:GPU|MIG)-[0-9a-fA-F]{8}-)[0-9a-fA-F]{4}')
_PID = re.compile(r'pid="(\d+)"')
_SERIAL = re.compile(r'serial="\d{4}')
_SAMPLES_TOTAL = re.compile(rb"^gpu_exporter_samples_total (\S+)$", re.M)
_LAST_SAMPLE = re.compile(rb"^gpu_exporter_last_sample_timestamp_seconds (\S+)$", re.M)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- HTTP --------------------------------------------------------------------------------------


def get(
    port: int, path: str, headers: dict[str, str] | None = None, timeout: float = 300.0
) -> tuple[int, dict[str, str], bytes]:
    """GET on 127.0.0.1: (status, headers in lower case, body as sent, not decompressed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        body = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        conn.close()


# -- the simulated host ------------------------------------------------------------------------


def feature_scenario(path: str, mig: bool) -> None:
    """Rewrite bench/benchmark.py's scenario at ``path`` with what it lacks of "every feature":
    XIDs (13 on every GPU, 31 too on GPU 0), per-process SM utilization that moves, and with
    ``mig`` each GPU in MIG mode with 7 1g.10gb devices (GPM fields on each) holding its
    processes round-robin."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    data["driver"]["call_latency"] = "0s"
    for g, gpu in enumerate(data["gpus"]):
        gpu["xids"] = [{"at": "2s", "code": 13}] + ([{"at": "3s", "code": 31}] if g == 0 else [])
        migs = [f"MIG-{g:04x}{d:04x}-0000-4000-8000-{g * 16 + d:012x}" for d in range(MIG_DEVICES)]
        if mig:
            gpu["mig_devices"] = [
                {
                    "uuid": u,
                    "profile": "1g.10gb",
                    "fields": {"sm_active": 0.4, "tensor_active": 0.2},
                }
                for u in migs
            ]
        for p, process in enumerate(gpu.get("processes", [])):
            process["sm_utilization"] = {"base": 0.5, "amplitude": 0.3, "period": f"{10 + p}s"}
            process["memory"] = "1GiB" if mig else process["memory"]
            if mig:
                process["mig"] = migs[p % MIG_DEVICES]
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


def churn_scenario(period: float) -> str:
    """8 GPUs x 16 processes, each replaced every ``period`` seconds, staggered: 8 real
    ``sleep`` children and 8 PIDs above pid_max (another container's) per GPU."""
    uuids = [f"GPU-c4a1{g:04x}-0000-4000-8000-{g:012x}" for g in range(GPUS)]
    data = yaml.safe_load(scenario_yaml([[] for _ in range(GPUS)], uuids, "0s"))
    for g, gpu in enumerate(data["gpus"]):
        processes: list[dict[str, Any]] = []
        for p in range(PER_GPU):
            at = f"{(g * PER_GPU + p) * period / (GPUS * PER_GPU):.3f}s"
            entry: dict[str, Any] = {
                "memory": {"base": "1GiB", "amplitude": "256MiB", "period": f"{10 + p}s"},
                "sm_utilization": 0.5,
                "churn": f"{period:g}s",
                "from": at,
            }
            if p % 2:
                entry["pid"] = INVISIBLE_BASE + g * INVISIBLE_STRIDE + p * 10_000
            else:
                entry["spawn"] = SLEEP
            processes.append(entry)
        gpu["processes"] = processes
    return "# Written by bench/scale.py: every process replaced every period.\n" + yaml.safe_dump(
        data, sort_keys=False
    )


class Agent:
    """``gpu-exporter serve --simulate`` on a free loopback port, stopped by ``stop``."""

    def __init__(
        self, reaper: Reaper, scenario: str, folder: str, dev: str | None, interval: str = "1s"
    ) -> None:
        self.port = _free_port()
        self.reaper = reaper
        self.log_path = os.path.join(folder, f"agent-{self.port}.log")
        locks = os.path.join(folder, f"locks-{self.port}")
        os.mkdir(locks, 0o700)
        argv = [
            *(sys.executable, "-m", "exporter", "serve", "--simulate", scenario),
            *("--listen", f"127.0.0.1:{self.port}", "--interval", interval, "--lock-dir", locks),
            *(("--dev", dev) if dev else ()),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_EXPORTER_")}
        env["PYTHONPATH"] = str(REPO)
        with open(self.log_path, "wb") as err:
            self.child = reaper.popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env
            )

    def wait(self, wanted: Iterable[bytes], timeout: float = 90.0) -> bytes:
        """The first text scrape holding every one of ``wanted`` after two samples."""
        wanted = list(wanted)
        started = time.monotonic()
        while True:
            if self.child.poll() is not None:
                raise RuntimeError(f"the agent exited ({self.child.returncode}):\n{self.tail()}")
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"the agent served no full /metrics in {timeout:g}s")
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, _, body = get(self.port, "/metrics", timeout=10)
                match = _SAMPLES_TOTAL.search(body)
                samples = float(match.group(1)) if match else 0.0
                if status == 200 and samples >= 2 and all(w in body for w in wanted):
                    return body
            time.sleep(0.2)

    def scrape(self, openmetrics: bool = False, gzip: bool = False) -> bytes:
        headers = {"Accept": PROMETHEUS_ACCEPT} if openmetrics else {}
        if gzip:
            headers["Accept-Encoding"] = "gzip"
        status, _, body = get(self.port, "/metrics", headers)
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return body

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            text = Path(self.log_path).read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        self.reaper.stop(self.child, signal.SIGTERM)


def sample_lines(body: bytes) -> list[str]:
    return [line for line in body.decode().splitlines() if line and not line.startswith("#")]


def series_kind(line: str) -> str:
    """per process (a pid label), per NVLink link, per MIG device, per GPU (a uuid), or host."""
    brace = line.find("{")
    names = set(_LABEL_NAMES.findall(line[brace + 1 : line.rfind("}")])) if brace > 0 else set()
    if "pid" in names:
        return "per process"
    if "link" in names:
        return "per NVLink link"
    if "mig_uuid" in names:
        return "per MIG device"
    if "uuid" in names:
        return "per GPU"
    return "host and agent"


@dataclass
class HostReading:
    """One simulated host's exposition."""

    label: str
    series: int
    families: int
    by_kind: dict[str, int]
    process_families: list[str]
    sizes: dict[str, int]  # median bytes per scrape by format


def read_host(agent: Agent, label: str, scrapes: int = 5) -> HostReading:
    text = agent.scrape()
    lines = sample_lines(text)
    by_kind: dict[str, int] = {}
    process_families = set()
    for line in lines:
        kind = series_kind(line)
        by_kind[kind] = by_kind.get(kind, 0) + 1
        if kind == "per process":
            process_families.add(_NAME.match(line).group(0))  # type: ignore[union-attr]
    families = sum(1 for line in text.decode().splitlines() if line.startswith("# TYPE "))
    sizes = {}
    for name, om, gz in (
        ("text", False, False),
        ("text, gzip", False, True),
        ("OpenMetrics", True, False),
        ("OpenMetrics, gzip", True, True),
    ):
        sizes[name] = int(statistics.median(len(agent.scrape(om, gz)) for _ in range(scrapes)))
    return HostReading(label, len(lines), families, by_kind, sorted(process_families), sizes)


@dataclass
class HostPhase:
    readings: list[HostReading]
    openmetrics: tuple[bytes, bytes]  # two OpenMetrics scrapes of the MIG-off host, for tsdb
    between_s: float  # sample time between the two
    first_at: float  # the first one's sample time (epoch seconds)


def run_host_phase(reaper: Reaper, folder: str, mig: bool = True) -> HostPhase:
    readings = []
    pair: tuple[bytes, bytes] = (b"", b"")
    between = first_at = 0.0
    for with_mig in (False, True) if mig else (False,):
        sub = tempfile.mkdtemp(prefix="host-", dir=folder)
        host = make_host(reaper, GPUS, PER_GPU, sub, call_latency="0s")
        feature_scenario(host.scenario, with_mig)
        agent = Agent(reaper, host.scenario, sub, host.dev)
        try:
            wanted = [b"gpu_recommended{", b"gpu_zombie_processes{", b"gpu_health{", b'xid="13"']
            wanted += [b"gpu_thermal_hotspot{", b"gpu_sm_active_ratio{"]
            wanted += [b"gpu_mig_sm_active_ratio{"] if with_mig else []
            agent.wait(wanted)
            time.sleep(2)  # the XIDs' counters and the first action runs settle
            label = "8 GPUs x 16 processes" + (", MIG on (7 devices each)" if with_mig else "")
            readings.append(read_host(agent, label))
            log(f"host: {label}: {readings[-1].series} series")
            if not with_mig:
                first = agent.scrape(openmetrics=True)
                time.sleep(3)
                second = agent.scrape(openmetrics=True)
                t1, t2 = (float(_LAST_SAMPLE.search(b).group(1)) for b in (first, second))  # type: ignore[union-attr]
                pair, between, first_at = (first, second), t2 - t1, t1
        finally:
            agent.stop()
            reaper.stop_all()
    return HostPhase(readings, pair, between, first_at)


# -- churn -------------------------------------------------------------------------------------


@dataclass
class ChurnReading:
    period_s: float
    window_s: float
    scrapes: int
    process_series_per_scrape: float
    distinct_process_series: int
    distinct_pids: int
    series_per_process: float
    new_series_per_hour: float
    pids_per_hour: float


def run_churn_phase(
    reaper: Reaper, folder: str, period: float, window: float, every: float
) -> ChurnReading:
    sub = tempfile.mkdtemp(prefix="churn-", dir=folder)
    scenario = os.path.join(sub, "scenario.yaml")
    Path(scenario).write_text(churn_scenario(period), encoding="utf-8")
    agent = Agent(reaper, scenario, sub, None)
    try:
        agent.wait([b"gpu_process_memory_used_bytes{"])
        time.sleep(period)  # every staggered slot has started
        first: set[str] | None = None
        seen: set[str] = set()
        pids: set[str] = set()
        per_scrape = []
        started = time.monotonic()
        while time.monotonic() - started < window:
            keys = {
                line.rsplit(" ", 1)[0]
                for line in sample_lines(agent.scrape())
                if series_kind(line) == "per process"
            }
            first = keys if first is None else first
            seen |= keys
            pids |= {m.group(1) for key in keys for m in [_PID.search(key)] if m}
            per_scrape.append(len(keys))
            time.sleep(max(0.0, every - (time.monotonic() - started) % every))
        elapsed = time.monotonic() - started
        if agent.child.poll() is not None:
            raise RuntimeError(f"the agent exited during the churn:\n{agent.tail()}")
    finally:
        agent.stop()
        reaper.stop_all()
    new = len(seen) - len(first or ())
    first_pids = {m.group(1) for key in first or () for m in [_PID.search(key)] if m}
    return ChurnReading(
        period_s=period,
        window_s=elapsed,
        scrapes=len(per_scrape),
        process_series_per_scrape=statistics.median(per_scrape),
        distinct_process_series=len(seen),
        distinct_pids=len(pids),
        series_per_process=len(seen) / max(len(pids), 1),
        new_series_per_hour=new / elapsed * 3600,
        pids_per_hour=(len(pids) - len(first_pids)) / elapsed * 3600,
    )


# -- the fleet's exposition ----------------------------------------------------------------------


@dataclass
class Series:
    """One series of the scraped host and how it moves: const (as scraped), counter (the
    scraped rate), wave (around the scraped value) or clock (a timestamp that keeps its age)."""

    name: str
    labels: str  # inside the braces, as scraped
    kind: str
    value: float
    rate: float = 0.0
    amplitude: float = 0.0
    period: float = 600.0
    upper: float = math.inf  # ratios stay at most 1


@dataclass
class Family:
    header: str  # the # HELP / # TYPE / # UNIT lines, newline-terminated
    kind: str
    series: list[Series] = field(default_factory=list)


def parse_openmetrics(body: bytes) -> tuple[list[tuple[str, str, list[str]]], dict[str, float]]:
    """([(family name, header, sample lines)], {series key: value})."""
    families: list[tuple[str, str, list[str]]] = []
    values: dict[str, float] = {}
    for line in body.decode().splitlines():
        if not line or line == "# EOF":
            continue
        if line.startswith("# "):
            name = line.split(" ", 3)[2]
            if not families or families[-1][0] != name:
                families.append((name, "", []))
            families[-1] = (name, families[-1][1] + line + "\n", families[-1][2])
            continue
        key, value = line.rsplit(" ", 1)
        families[-1][2].append(key)
        values[key] = float(value)
    return families, values


def fleet_model(first: bytes, second: bytes, between: float, first_at: float) -> list[Family]:
    """The families of a host from two OpenMetrics scrapes ``between`` seconds apart."""
    families, a = parse_openmetrics(first)
    _, b = parse_openmetrics(second)
    out = []
    index = 0
    for _, header, keys in families:
        kind = re.search(r"^# TYPE \S+ (\S+)$", header, re.M)
        family = Family(header, kind.group(1) if kind else "unknown")
        for key in keys:
            index += 1
            brace = key.find("{")
            name, labels = (key[:brace], key[brace + 1 : -1]) if brace >= 0 else (key, "")
            v1, v2 = a[key], b.get(key, a[key])
            series = Series(name, labels, "const", v1, period=600.0 * (1 + index % 7))
            if math.isnan(v1) or math.isnan(v2) or v1 == v2:
                pass
            elif family.kind == "counter":
                series.kind, series.rate = "counter", max(0.0, (v2 - v1) / max(between, 1e-3))
            elif name.endswith("_timestamp_seconds"):
                series.kind, series.value = "clock", first_at - v1  # its age at the scrape
            else:
                series.kind = "wave"
                series.amplitude = 0.1 * abs(v1) + abs(v2 - v1) / 2
                series.upper = 1.0 if name.endswith("_ratio") else math.inf
            family.series.append(series)
        out.append(family)
    return out


def target_families(series: int) -> list[Family]:
    """The series Prometheus adds to every target it scrapes (``up`` and ``scrape_*``)."""

    def one(name: str, value: float, kind: str = "const") -> Family:
        return Family(
            f"# TYPE {name} gauge\n", "gauge", [Series(name, "", kind, value, amplitude=0.003)]
        )

    return [
        one("up", 1),
        one("scrape_duration_seconds", 0.01, "wave"),
        one("scrape_samples_scraped", series),
        one("scrape_samples_post_metric_relabeling", series),
        one("scrape_series_added", 0),
    ]


def host_labels(labels: str, host: int) -> str:
    """The labels of host ``host``'s copy: its instance and job, its own GPU and MIG UUIDs,
    serial numbers and PIDs."""
    if "uuid=" in labels:
        labels = _UUID.sub(lambda m: f"{m.group(1)}{host:04x}", labels)
    if "pid=" in labels:
        labels = _PID.sub(
            lambda m: f'pid="{(int(m.group(1)) + host * 7919) % 4194304 + 1}"', labels
        )
    if "serial=" in labels:
        labels = _SERIAL.sub(f'serial="{host % 10000:04d}', labels)
    own = f'instance="gpu-node-{host:04d}:{PORT}",job="{JOB}"'
    return f"{own},{labels}" if labels else own


def _frac(x: float) -> float:
    return x - math.floor(x)


def write_exposition(
    out: TextIO,
    families: list[Family],
    hosts: Iterable[int],
    times: list[int],
    anchor: float,
    timestamps: bool = True,
) -> int:
    """OpenMetrics of ``hosts`` at ``times`` (epoch seconds), family by family, each series's
    samples in time order; without ``timestamps``, one sample per series at ``times[0]``.
    Values vary by host (a factor and a phase) and by time. Returns the samples written."""
    hosts = list(hosts)
    tails = [f" {t}\n" for t in times] if timestamps else ["\n"]
    rel = [t - anchor for t in times]
    waves: dict[float, tuple[list[float], list[float]]] = {}
    written = 0
    for f_index, family in enumerate(families):
        out.write(family.header)
        for s_index, s in enumerate(family.series):
            if s.kind == "wave" and s.period not in waves:
                w = 2 * math.pi / s.period
                waves[s.period] = ([math.sin(w * x) for x in rel], [math.cos(w * x) for x in rel])
            for h in hosts:
                prefix = f"{s.name}{{{host_labels(s.labels, h)}}} "
                factor = 0.85 + 0.3 * _frac(h * 0.618034 + f_index * 0.1)
                if s.kind == "const":
                    lines = (prefix + _number(s.value)).join(["", *tails])
                elif s.kind == "counter":
                    v, r = s.value * factor, s.rate * factor
                    lines = "".join(
                        [
                            f"{prefix}{v + r * x:.12g}{tail}"
                            for x, tail in zip(rel, tails, strict=True)
                        ]
                    )
                elif s.kind == "clock":
                    lines = "".join(
                        [
                            f"{prefix}{t - s.value:.3f}{tail}"
                            for t, tail in zip(times, tails, strict=True)
                        ]
                    )
                else:
                    phase = 2 * math.pi * _frac(h * 0.754877 + s_index * 0.569840)
                    sin, cos = waves[s.period]
                    c = s.value * factor
                    ps, pc = s.amplitude * math.cos(phase), s.amplitude * math.sin(phase)
                    top = s.upper
                    lines = "".join(
                        [
                            f"{prefix}{min(top, max(0.0, c + ps * a + pc * b)):.6g}{tail}"
                            for a, b, tail in zip(sin, cos, tails, strict=True)
                        ]
                    )
                out.write(lines)
                written += len(tails)
    out.write("# EOF\n")
    return written


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return repr(value) if value != int(value) or abs(value) >= 1e15 else str(int(value))


# -- Prometheus ----------------------------------------------------------------------------------


def prometheus_version() -> str:
    done = subprocess.run(["prometheus", "--version"], capture_output=True, text=True)
    return (done.stdout or done.stderr).splitlines()[0].strip() if done.returncode == 0 else "?"


class Prometheus:
    """A ``prometheus`` on a free loopback port over ``tsdb``; ``stop`` stops it."""

    def __init__(self, reaper: Reaper, tsdb: str, folder: str, config: str = "") -> None:
        self.reaper, self.tsdb, self.port = reaper, tsdb, _free_port()
        cfg = os.path.join(folder, f"prometheus-{self.port}.yml")
        Path(cfg).write_text(config or "scrape_configs: []\n", encoding="utf-8")
        self.log_path = os.path.join(folder, f"prometheus-{self.port}.log")
        argv = [
            "prometheus",
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tsdb}",
            "--storage.tsdb.retention.time=3650d",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with open(self.log_path, "wb") as out:
            self.child = reaper.popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        self.conn: http.client.HTTPConnection | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 900.0) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.child.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.child.returncode}):\n{self.tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if get(self.port, "/-/ready", timeout=5)[0] == 200:
                    return time.monotonic() - started
            time.sleep(0.5)
        raise RuntimeError(f"prometheus not ready after {timeout:g}s:\n{self.tail()}")

    def metric(self, name: str) -> float | None:
        """The sum of a metric of Prometheus's own /metrics."""
        _, _, body = get(self.port, "/metrics")
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in body.decode().splitlines()
            if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{")
        ]
        return sum(values) if values else None

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.child.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
        return math.nan

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.child.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def api(self, path: str, params: dict[str, str]) -> tuple[float, dict[str, Any]]:
        """(seconds, JSON answer) of one API call on a kept-alive connection."""
        query = urllib.parse.urlencode(params)
        for attempt in (1, 2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
            started = time.perf_counter()
            try:
                self.conn.request("GET", f"{path}?{query}")
                response = self.conn.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
                continue
            return time.perf_counter() - started, json.loads(body)
        raise AssertionError("unreachable")

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.reaper.stop(self.child, signal.SIGTERM, wait=120)


def blocks(tsdb: str) -> list[tuple[int, int]]:
    """(minTime, maxTime) of every block on disk."""
    out = []
    for meta in Path(tsdb).glob("*/meta.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            data = json.loads(meta.read_text())
            out.append((int(data["minTime"]), int(data["maxTime"])))
    return sorted(out)


def overlapping(spans: list[tuple[int, int]]) -> bool:
    return any(b[0] < a[1] for a, b in itertools.pairwise(spans))


def wait_compacted(prom: Prometheus, timeout: float, wait: bool = True) -> tuple[float, int]:
    """Wait until Prometheus has merged the overlapping blocks (vertical compaction): (seconds,
    blocks). It compacts a minute after it starts, then every minute. Without ``wait``, the
    blocks as they are now."""
    if not wait:
        return 0.0, len(blocks(prom.tsdb))
    started = time.monotonic()
    stable = 0
    while time.monotonic() - started < timeout:
        spans = blocks(prom.tsdb)
        loaded = prom.metric("prometheus_tsdb_blocks_loaded")
        busy = any(p.name.endswith(".tmp-for-creation") for p in Path(prom.tsdb).iterdir())
        if not overlapping(spans) and not busy and loaded == len(spans):
            stable += 1
            if stable >= 2:
                return time.monotonic() - started, len(spans)
        else:
            stable = 0
        time.sleep(5)
    raise RuntimeError(f"blocks still overlapping after {timeout:g}s: {blocks(prom.tsdb)}")


# -- the TSDB ------------------------------------------------------------------------------------


@dataclass
class Grid:
    start: int
    step: int
    samples: int

    @property
    def end(self) -> int:
        return self.start + (self.samples - 1) * self.step

    def times(self) -> list[int]:
        return [self.start + i * self.step for i in range(self.samples)]


def make_grid(hours: float, step: int, lead: float, now: float | None = None) -> Grid:
    """``hours`` of samples at ``step`` up to now, and ``lead`` seconds past it, so that the
    queries made minutes later, at their own now, still find the latest samples."""
    now = time.time() if now is None else now
    end = int((now + lead) // step * step)
    samples = round((hours * 3600 + lead) / step) + 1
    return Grid(end - (samples - 1) * step, step, samples)


def block_duration(grid: Grid) -> str:
    """promtool's --max-block-duration: the smallest of Prometheus's ranges (2h x 3^k) that holds
    the grid, so that promtool reads each chunk once per block, not once per 2 h."""
    span_h = (grid.end - grid.start) / 3600
    hours = 2
    while hours < span_h and hours < 2 * 3**6:
        hours *= 3
    return f"{hours}h"


@dataclass
class TsdbBuild:
    hosts: int
    grid: dict[str, int]
    series: int
    samples: int
    chunks: int
    generate_s: float  # writing the OpenMetrics files (this process)
    promtool_cpu_s: float
    wall_s: float
    text_bytes: int
    disk_bytes: int = 0
    compaction_s: float = 0.0
    ready_s: float = 0.0
    blocks: int = 0
    prometheus_rss_mb: float = 0.0  # once compacted, before any query


def build_tsdb(
    reaper: Reaper,
    model: list[Family],
    hosts: int,
    grid: Grid,
    chunk_hosts: int,
    jobs: int,
    workdir: str,
    anchor: float,
) -> TsdbBuild:
    """Write the fleet's OpenMetrics in chunks of hosts and turn each into blocks with promtool
    (``jobs`` at a time, while the next chunk is written), each file removed once read."""
    tsdb = os.path.join(workdir, "tsdb")
    os.makedirs(tsdb, exist_ok=True)
    duration = block_duration(grid)
    times = grid.times()
    running: list[tuple[subprocess.Popen[bytes], str, float]] = []
    generate = promtool_cpu = 0.0
    samples = text_bytes = 0
    started = time.monotonic()

    def reap(child: subprocess.Popen[bytes], path: str) -> None:
        nonlocal promtool_cpu
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        promtool_cpu += usage.ru_utime + usage.ru_stime
        if child.returncode != 0:
            raise RuntimeError(f"promtool failed on {path}:\n{Path(path + '.log').read_text()}")
        os.unlink(path)

    starts = list(range(0, hosts, chunk_hosts))
    for i, first in enumerate(starts):
        while len(running) >= jobs:
            child, path, _ = running.pop(0)
            reap(child, path)
        path = os.path.join(workdir, f"chunk-{i:04d}.om")
        t0 = time.process_time()
        with open(path, "w", encoding="utf-8", buffering=1 << 22) as out:
            samples += write_exposition(
                out, model, range(first, min(hosts, first + chunk_hosts)), times, anchor
            )
        generate += time.process_time() - t0
        text_bytes += os.path.getsize(path)
        with open(path + ".log", "wb") as err:
            child = reaper.popen(
                [*PROMTOOL, f"--max-block-duration={duration}", path, tsdb],
                stdout=err,
                stderr=subprocess.STDOUT,
            )
        running.append((child, path, time.monotonic()))
        log(f"tsdb: chunk {i + 1}/{len(starts)} written ({samples / 1e6:.1f}M samples so far)")
    for child, path, _ in running:
        reap(child, path)
    for leftover in Path(workdir).glob("chunk-*.om.log"):
        leftover.unlink()
    series = hosts * sum(len(f.series) for f in model)
    return TsdbBuild(
        hosts=hosts,
        grid={"start": grid.start, "end": grid.end, "step": grid.step, "samples": grid.samples},
        series=series,
        samples=samples,
        chunks=len(starts),
        generate_s=generate,
        promtool_cpu_s=promtool_cpu,
        wall_s=time.monotonic() - started,
        text_bytes=text_bytes,
    )


def disk_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# -- queries -------------------------------------------------------------------------------------


@dataclass
class Timing:
    label: str
    expr: str
    mode: str  # instant, range (all instances), range (one instance)
    seconds: list[float] = field(default_factory=list)
    series: int = 0
    samples: int | None = None  # totalQueryableSamples, from stats=all
    error: str = ""
    eval_seconds: list[float] = field(default_factory=list)  # Prometheus' own evalTotalTime

    @property
    def eval_ms(self) -> float:
        return statistics.median(self.eval_seconds) * 1e3 if self.eval_seconds else math.nan

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1e3 if self.seconds else math.nan

    @property
    def p95_ms(self) -> float:
        return _percentile(self.seconds, 0.95) * 1e3 if self.seconds else math.nan


def time_query(
    prom: Prometheus,
    timing: Timing,
    runs: int,
    at: int,
    budget_s: float,
    range_s: int = 0,
    step: int = 0,
) -> Timing:
    """Run one query ``runs`` times (fewer once ``budget_s`` is spent, at least 3), after one
    untimed run that warms the page cache."""
    if range_s:
        path = "/api/v1/query_range"
        params = {"query": timing.expr, "start": str(at - range_s), "end": str(at)}
        params |= {"step": str(step), "stats": "all"}
    else:
        path, params = "/api/v1/query", {"query": timing.expr, "time": str(at), "stats": "all"}
    spent = 0.0
    for run in range(runs + 1):
        seconds, answer = prom.api(path, params)
        if answer.get("status") != "success":
            timing.error = f"{answer.get('errorType')}: {answer.get('error')}"[:160]
            return timing
        data = answer["data"]
        if run:
            timing.seconds.append(seconds)
            evaluated = data.get("stats", {}).get("timings", {}).get("evalTotalTime")
            if evaluated is not None:
                timing.eval_seconds.append(float(evaluated))
        spent += seconds
        timing.series = len(data["result"]) if isinstance(data["result"], list) else 1
        stats = data.get("stats", {}).get("samples", {})
        timing.samples = stats.get("totalQueryableSamples", timing.samples)
        if run >= 3 and spent > budget_s:
            break
    return timing


def dashboard_exprs(interval: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard target, variables replaced as Grafana would with
    a scrape interval of the data's step; each expression once. A title that several targets
    share gets the first metric its expression reads."""
    seen: dict[str, str] = {}
    for panel in iter_panels(load_dashboard()):
        for target in panel.get("targets", []):
            if target.get("expr"):
                seen.setdefault(substitute(target["expr"], interval), panel.get("title", ""))
    titles = list(seen.values())
    out = []
    for expr, title in seen.items():
        if titles.count(title) > 1:
            metric = re.search(r"\b((?:gpu|process)_\w+)\{", expr)
            title = f"{title}: {metric.group(1) if metric else expr[:30]}"
        out.append((title, expr))
    return out


def one_instance(expr: str) -> str:
    return expr.replace('instance=~".*"', f'instance=~"gpu-node-0000:{PORT}"')


FLEET = REPO / "exporter" / "launcher" / "fleet.py"
FLEET_DOC = REPO / "docs" / "fleet.md"


def fleet_status() -> tuple[bool, str]:
    """Whether ``gpu-exporter recommend --prometheus`` is there, and what is missing if not."""
    if not FLEET.exists():
        return False, f"{FLEET.relative_to(REPO)} does not exist"
    done = subprocess.run(
        [sys.executable, "-m", "exporter", "recommend", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    if "--prometheus" not in done.stdout + done.stderr:
        return False, "gpu-exporter recommend --help lists no --prometheus"
    return True, ""


def fleet_queries() -> list[tuple[str, str]]:
    """(name, PromQL) of a fleet recommend, as exporter/launcher/fleet.py asks them: the default
    policy's, then the ``avg_over_time`` ones a policy with ``window: 4`` adds; without
    fleet.py, the ```promql blocks of docs/fleet.md."""
    asked = fleet_asked()
    if not asked:
        text = FLEET_DOC.read_text(encoding="utf-8") if FLEET_DOC.exists() else ""
        found = re.findall(r"```promql\n(.*?)```", text, re.S)
        return [(f"docs/fleet.md query {i + 1}", " ".join(q.split())) for i, q in enumerate(found)]
    from exporter.core.selection import Policy
    from exporter.launcher import fleet

    window = fleet.queries(Policy("default", window=4))
    return [
        *asked.items(),
        *((f"{name} (window: 4)", q) for name, q in window.items() if name not in asked),
    ]


_FLEET_SHAPE = re.compile(r"^max by \(([^)]*)\) \((.*) and on \(instance, job\) \((.*)\)\)$", re.S)


def fleet_asked() -> dict[str, str]:
    """fleet.queries() of the default policy ({} without fleet.py)."""
    try:
        from exporter.core.selection import Policy
        from exporter.launcher import fleet
    except ImportError:
        return {}
    return dict(fleet.queries(Policy("default")))


def fleet_variants(asked: dict[str, str]) -> list[tuple[str, str]]:
    """Parts of the gauges and flags queries, to see where their time goes."""
    out = []
    for name in ("gauges", "flags"):
        match = _FLEET_SHAPE.match(asked.get(name, ""))
        if match is None:
            continue
        by, selector, fresh = match.groups()
        bare = selector.removesuffix(" > 0")
        out.append((f"{name}: the selector alone", bare))
        plain = re.sub(r',(?:class|reason)=~"[^"]*"', "", bare)
        if plain != bare:
            out.append((f"{name}: the selector without class/reason matchers", plain))
        if bare != selector:
            out.append((f"{name}: the selector > 0", selector))
        out.append((f"{name}: max by, no freshness join", f"max by ({by}) ({selector})"))
        out.append(
            (f"{name}: freshness join, no max by", f"{selector} and on (instance, job) ({fresh})")
        )
    return out


def fleet_rules(asked: dict[str, str]) -> tuple[str, list[tuple[str, str]]]:
    """Recording rules that do the fleet recommend's work ahead, every evaluation interval
    (its three queries, each series keeping its metric name in a ``metric`` label), and the
    queries a recommend would ask instead: (rules YAML, [(name, PromQL)])."""
    fresh = _FLEET_SHAPE.match(asked["gauges"]).group(3)  # type: ignore[union-attr]

    def named(expr: str) -> str:
        return f'label_replace({expr}, "metric", "$1", "__name__", "(.+)")'

    rules = [
        {"record": "gpu_fleet:fresh", "expr": fresh},
        {"record": "gpu_fleet:gauge", "expr": named(asked["gauges"])},
        {"record": "gpu_fleet:flag", "expr": named(asked["flags"])},
    ]
    text = yaml.safe_dump({"groups": [{"name": "gpu-fleet", "interval": "15s", "rules": rules}]})
    recorded = [
        ("fresh, from gpu_fleet:fresh", "count by (instance) (gpu_fleet:fresh)"),
        ("gauges, from gpu_fleet:gauge", "gpu_fleet:gauge"),
        ("flags, from gpu_fleet:flag", "gpu_fleet:flag"),
    ]
    return text, recorded


def time_fleet_command(url: str, runs: int, count: int) -> tuple[list[float], list[str], str]:
    """``gpu-exporter recommend --prometheus URL --count N`` end to end, ``runs`` times, after one
    untimed run: (seconds, problems, what the first run printed)."""
    argv = [sys.executable, "-m", "exporter", "recommend", "--prometheus", url]
    argv += ["--count", str(count)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    seconds, problems, printed = [], [], ""
    for run in range(runs + 1):
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env)
        elapsed = time.perf_counter() - started
        if run == 0:
            printed = (done.stdout or done.stderr).strip()[:300]
        if done.returncode != 0:
            problems.append(f"exit {done.returncode}: {(done.stderr or done.stdout)[-300:]}")
            if len(problems) >= 2:
                break
        elif run:
            seconds.append(elapsed)
    return seconds, problems, printed


def time_fleet_in_process(url: str, runs: int) -> dict[str, list[float]]:
    """fleet.read_fleet (the queries and the Snapshots) and the whole recommend_fleet, called
    in this process: the command's time without Python's start and imports."""
    from exporter.core.selection import Policy
    from exporter.launcher import fleet

    policy, prometheus = Policy("default"), fleet.Prometheus(url, timeout=120)
    out: dict[str, list[float]] = {"read_fleet": [], "recommend_fleet": []}
    for run in range(runs + 1):
        started = time.perf_counter()
        fleet.read_fleet(prometheus, policy)
        middle = time.perf_counter()
        fleet.recommend_fleet(prometheus, policy)
        if run:
            out["read_fleet"].append(middle - started)
            out["recommend_fleet"].append(time.perf_counter() - middle)
    return out


# -- live scraping (head) ------------------------------------------------------------------------


class Targets:
    """A loopback HTTP server of ``/t/K``: hosts K*per .. K*per+per-1 in OpenMetrics, two
    renderings at times ``interval`` apart served in turn (gauges move, counters do not)."""

    def __init__(self, model: list[Family], hosts: int, per: int, interval: int) -> None:
        steady = [
            Family(f.header, f.kind, [s if s.kind != "counter" else _const(s) for s in f.series])
            for f in model
        ]
        now = int(time.time())
        self.bodies: list[tuple[bytes, bytes]] = []
        for first in range(0, hosts, per):
            rendered = []
            for t in (now, now + interval):
                out = io.StringIO()
                write_exposition(
                    out, steady, range(first, min(hosts, first + per)), [t], now, False
                )
                rendered.append(out.getvalue().encode())
            self.bodies.append((rendered[0], rendered[1]))
        self.count = [0] * len(self.bodies)
        bodies, count = self.bodies, self.count

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    k = int(self.path.rsplit("/", 1)[1])
                    body = bodies[k][count[k] % 2]
                    count[k] += 1
                except (ValueError, IndexError):
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/openmetrics-text; version=1.0.0")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def config(self, interval: int) -> str:
        targets = [
            {"targets": [f"127.0.0.1:{self.port}"], "labels": {"__metrics_path__": f"/t/{k}"}}
            for k in range(len(self.bodies))
        ]
        job = {
            "job_name": "fleet",
            "honor_labels": True,  # the instance and job labels of the hosts, not of the server
            "scrape_interval": f"{interval}s",
            "scrape_timeout": f"{interval}s",
            "static_configs": targets,
        }
        return yaml.safe_dump({"scrape_configs": [job]}, sort_keys=False)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _const(series: Series) -> Series:
    return Series(series.name, series.labels, "const", series.value)


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024**2
    return math.inf


@dataclass
class HeadReading:
    hosts: int
    targets: int
    interval_s: int
    scrapes: int
    head_series: float
    head_chunks: float
    rss_mb: float
    heap_inuse_mb: float
    cpu_percent: float  # Prometheus's, over the scrapes after the first
    scrape_duration_s: float  # the slowest target's last scrape
    body_bytes: int  # all targets, one scrape
    stopped_early: str = ""


def run_head_phase(
    reaper: Reaper,
    folder: str,
    model: list[Family],
    hosts: int,
    per: int,
    interval: int,
    scrapes: int,
    min_free_gib: float,
) -> HeadReading:
    log(f"head: rendering {hosts} hosts in targets of {per}")
    targets = Targets(model, hosts, per, interval)
    tsdb = tempfile.mkdtemp(prefix="head-tsdb-", dir=folder)
    prom = Prometheus(reaper, tsdb, folder, targets.config(interval))
    stopped = ""
    try:
        prom.wait_ready()
        total = len(targets.bodies)
        # Wait for the first full round (the series are created), then time ``scrapes`` more.
        deadline = time.monotonic() + 20 * interval + 300
        while min(targets.count) < 1 and time.monotonic() < deadline:
            time.sleep(1)
        first_round = min(targets.count)
        cpu0, t0 = prom.cpu_s(), time.monotonic()
        while min(targets.count) < first_round + scrapes:
            if time.monotonic() > deadline + scrapes * interval * 3:
                stopped = "the scrapes fell behind"
                break
            if mem_available_gib() < min_free_gib:
                stopped = f"stopped early: under {min_free_gib:g} GiB of memory left"
                break
            if prom.child.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{prom.tail()}")
            time.sleep(1)
        cpu = (prom.cpu_s() - cpu0) / max(time.monotonic() - t0, 1e-9) * 100
        time.sleep(2)  # the last appends are committed
        _, answer = prom.api("/api/v1/query", {"query": "max(scrape_duration_seconds)"})
        result = answer.get("data", {}).get("result", [])
        return HeadReading(
            hosts=hosts,
            targets=total,
            interval_s=interval,
            scrapes=min(targets.count),
            head_series=prom.metric("prometheus_tsdb_head_series") or 0.0,
            head_chunks=prom.metric("prometheus_tsdb_head_chunks") or 0.0,
            rss_mb=prom.rss_mb(),
            heap_inuse_mb=(prom.metric("go_memstats_heap_inuse_bytes") or 0.0) / 1e6,
            cpu_percent=cpu,
            scrape_duration_s=float(result[0]["value"][1]) if result else math.nan,
            body_bytes=sum(len(b[0]) for b in targets.bodies),
            stopped_early=stopped,
        )
    finally:
        prom.stop()
        targets.stop()


# -- tables --------------------------------------------------------------------------------------


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header, *[[_fmt(c, grouped=True) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = []
    for row in cells:
        first = row[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        out.append("  ".join([first, *rest]).rstrip())
    return "\n".join(out)


def host_table(readings: list[HostReading]) -> str:
    kinds = ["per GPU", "per NVLink link", "per MIG device", "per process", "host and agent"]
    rows: list[list[Any]] = [["series", *(r.series for r in readings)]]
    rows += [[f"  {k}", *(r.by_kind.get(k, 0) for r in readings)] for k in kinds]
    rows.append(["metric families", *(r.families for r in readings)])
    for name in readings[0].sizes:
        rows.append([f"bytes per scrape, {name}", *(r.sizes[name] for r in readings)])
    return table(rows, ["", *(r.label for r in readings)])


def timing_table(timings: list[Timing]) -> str:
    rows = []
    for t in timings:
        if t.error:
            rows.append([t.label[:60], t.mode, "refused", "", "", "", "", t.error[:70]])
            continue
        rows.append(
            [
                *(t.label[:60], t.mode, t.median_ms, t.p95_ms, t.eval_ms),
                *(len(t.seconds), t.series, t.samples),
            ]
        )
    header = ["query", "kind", "median ms", "p95 ms", "eval ms", "runs", "series", "samples"]
    return table(rows, header)


# -- the run -------------------------------------------------------------------------------------


def _duration(raw: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)?", raw.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {raw!r} (say 30s, 5m, 2h)")
    return float(match.group(1)) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, None: 1}[match.group(2)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated of {PHASES}")
    p.add_argument("--hosts", type=int, default=1000, help="simulated hosts (default 1000)")
    p.add_argument("--hours", type=float, default=6.0, help="hours of samples (default 6)")
    p.add_argument("--step", type=int, default=300, help="seconds between samples (default 300)")
    p.add_argument("--lead", type=_duration, default=2700.0, help="samples past now (default 45m)")
    p.add_argument("--chunk-hosts", type=int, default=50, help="hosts per promtool run (50)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="promtool runs at once")
    p.add_argument("--runs", type=int, default=20, help="timed runs per query (default 20)")
    p.add_argument("--rank-runs", type=int, default=3, help="runs to rank dashboard queries (3)")
    p.add_argument("--top", type=int, default=8, help="heaviest dashboard queries timed (8)")
    p.add_argument(
        "--query-budget",
        type=_duration,
        default=30.0,
        help="seconds per query before stopping short of --runs (at least 3 runs; default 30s)",
    )
    p.add_argument("--churn-period", type=_duration, default=30.0, help="process lifetime (30s)")
    p.add_argument("--churn-window", type=_duration, default=90.0, help="churn measured (90s)")
    p.add_argument("--no-mig", action="store_true", help="skip the MIG variant of the host")
    p.add_argument("--target-hosts", type=int, default=100, help="hosts per live target (100)")
    p.add_argument("--head-interval", type=int, default=30, help="live scrape interval, s (30)")
    p.add_argument("--head-scrapes", type=int, default=6, help="live scrapes timed (6)")
    p.add_argument("--min-free", type=float, default=3.0, help="GiB left before head stops (3)")
    p.add_argument("--compaction-timeout", type=_duration, default=1200.0)
    p.add_argument(
        "--no-compaction-wait",
        dest="compaction_wait",
        action="store_false",
        help="query the overlapping blocks as they are, merged at query time, instead of waiting "
        "for Prometheus to compact them (it does each minute): for quick runs, not for figures",
    )
    p.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (TSDB included)")
    p.add_argument("--reuse", metavar="DIR", help="query the TSDB a --keep run left in DIR")
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    args = p.parse_args(argv)
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if any(x not in PHASES for x in args.phases):
        p.error(f"--phases takes {', '.join(PHASES)}")
    if args.hosts < 1 or args.hours <= 0 or args.step < 1 or args.runs < 1:
        p.error("--hosts, --step and --runs must be at least 1 and --hours above 0")
    if args.reuse and "tsdb" in args.phases:
        p.error("--reuse queries a kept TSDB: leave tsdb out of --phases")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = args.keep or args.reuse or tempfile.mkdtemp(prefix="gpu-exporter-scale-")
    os.makedirs(folder, exist_ok=True)
    reaper = Reaper()
    previous = signal.signal(signal.SIGTERM, _terminate)
    report: dict[str, Any] = {"options": {k: v for k, v in vars(args).items()}}
    try:
        report["machine"] = f"{machine()}; {prometheus_version()}"
        print(f"machine: {report['machine']}", flush=True)
        run(args, folder, reaper, report)
    except KeyboardInterrupt:
        log("scale: interrupted; stopping everything it started")
        return 130
    except RuntimeError as exc:
        log(f"scale: {exc}")
        return 1
    finally:
        reaper.stop_all()
        signal.signal(signal.SIGTERM, previous)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
        if not (args.keep or args.reuse):
            shutil.rmtree(folder, ignore_errors=True)
    return 0


def run(args: argparse.Namespace, folder: str, reaper: Reaper, report: dict[str, Any]) -> None:
    model: list[Family] = []  # the agent's series
    model_file = os.path.join(folder, "scrapes.json")
    if "host" in args.phases or ("tsdb" in args.phases or "head" in args.phases):
        host = run_host_phase(reaper, folder, mig=not args.no_mig)
        report["host"] = [asdict(r) for r in host.readings]
        print("\n== one host (Slurm and kubelet attribution off)")
        print(host_table(host.readings), flush=True)
        first, second = host.openmetrics
        Path(model_file).write_text(
            json.dumps({"scrapes": [first.decode(), second.decode()], "between": host.between_s})
        )
        model = fleet_model(first, second, host.between_s, host.first_at)
    scraped = model + target_families(sum(len(f.series) for f in model))
    if "churn" in args.phases:
        churn = run_churn_phase(reaper, folder, args.churn_period, args.churn_window, 1.0)
        report["churn"] = asdict(churn)
        print(f"\n== PID churn: 8 x 16 processes, each replaced every {churn.period_s:g}s")
        rows = [[k.replace("_", " "), v] for k, v in asdict(churn).items()]
        print(table(rows, ["", "value"]), flush=True)
    state_file = os.path.join(folder, "tsdb.json")
    state: dict[str, Any] = {}
    if "tsdb" in args.phases:
        grid = make_grid(args.hours, args.step, args.lead)
        log(
            f"tsdb: {args.hosts} hosts x {sum(len(f.series) for f in scraped)} series, "
            f"{grid.samples} samples each ({args.hours:g} h at {args.step} s, +{args.lead:g} s)"
        )
        build = build_tsdb(
            reaper, scraped, args.hosts, grid, args.chunk_hosts, args.jobs, folder, time.time()
        )
        state = {"build": asdict(build), "step": args.step, "hours": args.hours}
        Path(state_file).write_text(json.dumps(state))
    elif args.reuse:
        state = json.loads(Path(state_file).read_text())
    if "query" in args.phases and state:
        query_phase(args, folder, reaper, report, state)
    elif "tsdb" in args.phases:
        report["tsdb"] = state["build"]
    if "head" in args.phases:
        head = run_head_phase(
            reaper,
            folder,
            model,
            args.hosts,
            args.target_hosts,
            args.head_interval,
            args.head_scrapes,
            args.min_free,
        )
        report["head"] = asdict(head)
        print(
            f"\n== live Prometheus: {head.hosts} hosts in {head.targets} targets, "
            f"scraped every {head.interval_s}s"
        )
        print(table([[k.replace("_", " "), v] for k, v in asdict(head).items()], ["", "value"]))
    sys.stdout.flush()


def query_phase(
    args: argparse.Namespace,
    folder: str,
    reaper: Reaper,
    report: dict[str, Any],
    state: dict[str, Any],
) -> None:
    build = TsdbBuild(**state["build"])
    step, hours = int(state["step"]), float(state["hours"])
    tsdb = os.path.join(folder, "tsdb")
    prom = Prometheus(reaper, tsdb, folder)
    servers = [prom]
    try:
        build.ready_s = prom.wait_ready()
        build.compaction_s, build.blocks = wait_compacted(
            prom, args.compaction_timeout, args.compaction_wait
        )
        build.disk_bytes = disk_bytes(tsdb)
        build.prometheus_rss_mb = prom.rss_mb()
        report["tsdb"] = asdict(build)
        print(
            f"\n== TSDB: {build.hosts} hosts, {build.series:,} series, {build.samples:,} samples "
            f"({hours:g} h at {step} s)"
        )
        rows = [[k.replace("_", " "), v] for k, v in asdict(build).items() if k != "grid"]
        print(table(rows, ["", "value"]), flush=True)
        at = min(int(time.time()) // step * step, build.grid["end"])
        if build.grid["end"] < time.time():
            log(f"query: the samples end {time.time() - at:.0f}s ago; instant queries at their end")
        fleet_phase(args, prom, report, at)  # first: it asks at Prometheus' now
        interval = f"{4 * step}s"  # Grafana's $__rate_interval: 4 scrape intervals
        range_s = int(hours * 3600)
        range_step = max(step, math.ceil(range_s / MAX_POINTS))
        ranked = []
        for title, expr in dashboard_exprs(interval):
            ranked.append(time_query(prom, Timing(title, expr, "instant"), args.rank_runs, at, 30))
        ranked.sort(key=lambda t: -(t.median_ms if not math.isnan(t.median_ms) else 1e12))
        report["dashboard_all"] = [asdict(t) for t in ranked]
        print(
            f"\n== the dashboard's {len(ranked)} queries, instant at the end, all instances "
            f"({args.rank_runs} runs; $__rate_interval = {interval}), slowest first"
        )
        print(timing_table(ranked), flush=True)
        heavy = []
        for t in ranked[: args.top]:
            label, expr = t.label, t.expr
            heavy.append(
                time_query(prom, Timing(label, expr, "instant"), args.runs, at, args.query_budget)
            )
            heavy.append(
                time_query(
                    prom,
                    Timing(label, expr, f"range {hours:g}h, all"),
                    args.runs,
                    at,
                    args.query_budget,
                    range_s,
                    range_step,
                )
            )
            heavy.append(
                time_query(
                    prom,
                    Timing(label, one_instance(expr), f"range {hours:g}h, one host"),
                    args.runs,
                    at,
                    args.query_budget,
                    range_s,
                    range_step,
                )
            )
            log(
                f"query: {label}: {heavy[-3].median_ms:.0f} / {heavy[-2].median_ms:.0f} / "
                f"{heavy[-1].median_ms:.0f} ms"
            )
        report["dashboard_heavy"] = [asdict(t) for t in heavy]
        print(f"\n== the {args.top} heaviest, {args.runs} runs (range step {range_step}s)")
        print(timing_table(heavy), flush=True)
        report["prometheus_after_queries"] = {
            "rss_mb": prom.rss_mb(),
            "head_series": prom.metric("prometheus_tsdb_head_series"),
            "heap_inuse_mb": (prom.metric("go_memstats_heap_inuse_bytes") or 0) / 1e6,
        }
        print(f"\nprometheus after the queries: {report['prometheus_after_queries']}")
        if fleet_asked():
            servers.append(rules_step(args, folder, reaper, report, prom, at))
    finally:
        for server in servers:
            server.stop()


def rules_step(
    args: argparse.Namespace,
    folder: str,
    reaper: Reaper,
    report: dict[str, Any],
    prom: Prometheus,
    at: int,
) -> Prometheus:
    """Backfill fleet_rules() around ``at`` from ``prom`` (promtool tsdb create-blocks-from
    rules), restart Prometheus with their blocks and time the queries that read them. Returns
    the Prometheus now running."""
    text, recorded = fleet_rules(fleet_asked())
    rules = os.path.join(folder, "fleet-rules.yml")
    Path(rules).write_text(text, encoding="utf-8")
    out = tempfile.mkdtemp(prefix="rules-", dir=folder)
    started = time.monotonic()
    argv = [*PROMTOOL[:3], "rules", f"--start={at - 600}", f"--end={at + 60}"]
    argv += [f"--url={prom.url}", f"--output-dir={out}", "--eval-interval=60s", rules]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"promtool could not backfill the rules:\n{done.stderr[-2000:]}")
    backfill_s = time.monotonic() - started
    prom.stop()
    for block in Path(out).iterdir():
        if (block / "meta.json").exists():
            shutil.move(str(block), prom.tsdb)
    shutil.rmtree(out, ignore_errors=True)
    prom = Prometheus(reaper, prom.tsdb, folder)
    prom.wait_ready()
    compaction_s, _ = wait_compacted(prom, args.compaction_timeout, args.compaction_wait)
    timings = [
        time_query(prom, Timing(name, expr, "instant"), args.runs, at, args.query_budget)
        for name, expr in recorded
    ]
    report["fleet"]["recorded"] = {
        "rules": text,
        "backfill_s": backfill_s,
        "compaction_s": compaction_s,
        "queries": [asdict(t) for t in timings],
    }
    print(
        f"\n== with recording rules (bench/scale.py fleet_rules(), backfilled in "
        f"{backfill_s:.0f}s): the queries a recommend would ask instead, {args.runs} runs"
    )
    print(timing_table(timings), flush=True)
    return prom


def fleet_phase(
    args: argparse.Namespace, prom: Prometheus, report: dict[str, Any], at: int
) -> None:
    """The fleet recommend end to end and in this process, then each of its queries."""
    ok, missing = fleet_status()
    fleet: dict[str, Any] = {"available": ok, "missing": missing}
    report["fleet"] = fleet
    rows: list[list[Any]] = []
    if ok:
        seconds, problems, printed = time_fleet_command(prom.url, args.runs, 1)
        fleet |= {"command_s": seconds, "problems": problems, "printed": printed}
        rows.append(["recommend --prometheus URL --count 1 (a new process)", *_stats(seconds)])
        if not problems:
            inner = time_fleet_in_process(prom.url, args.runs)
            fleet["in_process_s"] = inner
            rows.append(["  fleet.read_fleet() in this process", *_stats(inner["read_fleet"])])
            rows.append(["  fleet.recommend_fleet() in this process (queries, ranking)"])
            rows[-1] += _stats(inner["recommend_fleet"])
        print(f"\n== fleet recommend at {prom.url}: printed {printed!r}")
        print(table(rows, ["", "median ms", "p95 ms", "runs"]))
        for problem in problems:
            print(f"problem: {problem}")
    else:
        print(f"\n== fleet recommend: not measured end to end: {missing}")
    timings = [
        time_query(prom, Timing(name, expr, "instant"), args.runs, at, args.query_budget)
        for name, expr in fleet_queries()
    ]
    fleet["queries"] = [asdict(t) for t in timings]
    print(f"== the fleet recommend's queries, each alone, instant, {args.runs} runs")
    print(timing_table(timings), flush=True)
    parts = [
        time_query(prom, Timing(name, expr, "instant"), args.runs, at, args.query_budget)
        for name, expr in fleet_variants(fleet_asked())
    ]
    fleet["parts"] = [asdict(t) for t in parts]
    if parts:
        print(f"== where the gauges and flags queries spend their time, {args.runs} runs")
        print(timing_table(parts), flush=True)


def _stats(seconds: list[float]) -> list[Any]:
    if not seconds:
        return [math.nan, math.nan, 0]
    return [statistics.median(seconds) * 1e3, _percentile(seconds, 0.95) * 1e3, len(seconds)]


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
