#!/usr/bin/env python3
"""Scrape latency, agent overhead and NVML calls of gpu-exporter and nvitop-exporter.

Both exporters run in the same invocation, one after the other, on the same simulated host:
``--gpus`` simulated GPUs, each listing ``--processes`` real processes (``sleep`` children of this
script, each holding its GPUs' stand-in device files open), with every NVML call costing 50 us
(``driver: {call_latency: 50us, unimplemented: NotSupported}``: the functions the simulation does
not implement answer NotSupported and cost a call too, so neither exporter is favoured).

Each exporter runs through ``bench/run_simulated.py``, which installs the simulated pynvml
functions in the exporter's own process before the exporter (or nvitop) is imported and reports
the simulated NVML call counters on SIGUSR1. gpu-exporter runs with this interpreter (run the
script with the project's virtual environment: ``.venv/bin/python bench/benchmark.py``);
nvitop-exporter runs in a virtual environment of its own, created on first use (see
``--nvitop-venv``), so that it never touches the project's.

    .venv/bin/python bench/benchmark.py                 # 8 GPUs x 16 processes, both exporters
    .venv/bin/python bench/benchmark.py --scaling       # 1/8/64 GPUs x 16, 8 GPUs x 0/16/128
    .venv/bin/python bench/benchmark.py --quick --exporters ours    # a smoke run (seconds)

Everything it starts is stopped at the end, also on Ctrl-C and on errors. See
docs/benchmarks.md for what each figure means and for the results.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WRAPPER = REPO / "bench" / "run_simulated.py"
OURS, NVITOP = "ours", "nvitop"
LABELS = {OURS: "gpu-exporter", NVITOP: "nvitop-exporter"}
NVITOP_REQUIREMENT = "nvitop-exporter==1.7.*"
#: At most this many distinct processes are started; beyond, they serve several GPUs in turn.
MAX_POOL = 1024
#: Every simulated NVML call costs this (a busy wait, like a driver call).
CALL_LATENCY = "50us"
#: (GPUs, processes per GPU) of --scaling: GPUs at 16 processes, processes at 8 GPUs.
SCALING = ((1, 16), (8, 16), (64, 16), (8, 0), (8, 128))

# The rows of the table, in order: key, name (printed), unit, whether nvitop/ours means much.
ROWS: tuple[tuple[str, str, bool], ...] = (
    ("first_scrape_s", "time to first scrape (s)", True),
    ("seq_p50_ms", "scrape p50, sequential (ms)", True),
    ("seq_p99_ms", "scrape p99, sequential (ms)", True),
    ("conc_p50_ms", "scrape p50, concurrent (ms)", True),
    ("conc_p99_ms", "scrape p99, concurrent (ms)", True),
    ("conc_max_ms", "scrape max, concurrent (ms)", True),
    ("conc_rps", "scrapes/s, concurrent", True),
    ("conc_cpu_percent", "agent CPU, concurrent (%)", True),
    ("conc_samples", "samples taken, concurrent", False),
    ("listen_overflows", "listen queue overflows, concurrent", False),
    ("errors", "errors (non-200 or exception)", False),
    ("cpu_percent", "agent CPU, scraped 1/s (%)", True),
    ("samples", "samples taken, scraped 1/s", False),
    ("calls_per_sample", "NVML calls per sample", True),
    ("burst_calls", "burst: NVML calls (samples)", False),
    ("burst_calls_per_scrape", "burst: NVML calls/scrape beyond sampling", False),
    ("burst_reads_per_scrape", "burst: file reads/scrape, request threads", False),
    ("rss_mb", "peak RSS (MB)", True),
    ("age_s", "exporter's age at the end (s)", False),
    ("metrics_bytes", "/metrics size (bytes)", True),
    ("series", "series", True),
    ("gpu_fields", "GPU fields (families with a value)", True),
    ("process_fields", "process fields (families with a value)", True),
    ("gpu_values", "values per GPU (series of GPU 0)", True),
    ("process_values", "values per process (series of one)", True),
)
ROW_NAMES = tuple(name for _, name, _ in ROWS)


# -- processes ---------------------------------------------------------------------------------


def _parent_death_signal() -> None:  # between fork and exec: die with this script
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Reaper:
    """Every process this script starts, stopped by ``stop_all`` (also on Ctrl-C and errors)."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen[bytes]] = []

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        child = subprocess.Popen(argv, preexec_fn=_parent_death_signal, **kwargs)
        self.children.append(child)
        return child

    def stop(self, child: subprocess.Popen[bytes], sig: int = signal.SIGTERM, wait: float = 10.0):
        if child.poll() is None:
            with contextlib.suppress(OSError):
                child.send_signal(sig)
            try:
                child.wait(wait)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        with contextlib.suppress(ValueError):
            self.children.remove(child)

    def stop_all(self) -> None:
        for child in self.children:
            if child.poll() is None:
                with contextlib.suppress(OSError):
                    child.kill()
        for child in self.children:
            with contextlib.suppress(Exception):
                child.wait(5)
        self.children.clear()


@dataclass
class Host:
    """The simulated host: device stand-ins, the processes NVML lists and the scenario file."""

    gpus: int
    per_gpu: int
    folder: str
    scenario: str
    dev: str
    pids: list[list[int]]  # pids[gpu][slot]
    distinct: int
    uuids: list[str]


def _uuid(index: int) -> str:
    return f"GPU-b3ac{index:04x}-0000-4000-8000-{index:012x}"


def make_host(
    reaper: Reaper, gpus: int, per_gpu: int, folder: str, call_latency: str = CALL_LATENCY
) -> Host:
    """Start the processes and write the scenario: GPUs x per_gpu processes, distinct PIDs up
    to MAX_POOL, then round-robin. Each process holds its GPUs' device files open, as a CUDA
    process holds /dev/nvidiaN, so gpu-exporter's zombie reaper sees them as real holders."""
    dev = os.path.join(folder, "dev")
    os.makedirs(dev, exist_ok=True)
    for g in range(gpus):
        Path(dev, f"nvidia{g}").touch()
    total = gpus * per_gpu
    distinct = min(total, MAX_POOL)
    serves: list[set[int]] = [set() for _ in range(distinct)]
    slots = [[(g * per_gpu + p) % max(distinct, 1) for p in range(per_gpu)] for g in range(gpus)]
    for g, row in enumerate(slots):
        for k in row:
            serves[k].add(g)
    pool = []
    for k in range(distinct):
        fds = [os.open(os.path.join(dev, f"nvidia{g}"), os.O_RDONLY) for g in sorted(serves[k])]
        try:
            child = reaper.popen(
                ["sleep", "86400"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=fds,
            )
        finally:
            for fd in fds:
                os.close(fd)
        pool.append(child.pid)
    pids = [[pool[k] for k in row] for row in slots]
    uuids = [_uuid(g) for g in range(gpus)]
    scenario = os.path.join(folder, "scenario.yaml")
    Path(scenario).write_text(scenario_yaml(pids, uuids, call_latency), encoding="utf-8")
    return Host(gpus, per_gpu, folder, scenario, dev, pids, distinct, uuids)


def scenario_yaml(pids: list[list[int]], uuids: list[str], call_latency: str) -> str:
    """The scenario: values that move (waves of different periods), memory per process."""
    lines = [
        "# Written by bench/benchmark.py.",
        "driver:",
        f"  call_latency: {call_latency}",
        "  unimplemented: NotSupported",
        "gpus:",
    ]
    for g, row in enumerate(pids):
        mib = min(2048, (40 * 1024) // max(len(row), 1))  # processes' memory <= 50 GiB of 80
        lines += [
            f"  - uuid: {uuids[g]}",
            "    memory_total: 80GiB",
            f"    memory_used: {{base: 2GiB, amplitude: 1GiB, period: {40 + g % 7}s}}",
            f"    utilization: {{base: 0.5, amplitude: 0.4, period: {20 + g % 11}s}}",
            f"    memory_utilization: {{base: 0.3, amplitude: 0.2, period: {25 + g % 13}s}}",
            f"    temperature: {{base: 62, amplitude: 12, period: {30 + g % 17}s}}",
            f"    memory_temperature: {{base: 70, amplitude: 8, period: {35 + g % 19}s}}",
            f"    power: {{base: 420, amplitude: 200, period: {15 + g % 5}s}}",
            f"    fan_speed: {{base: 0.5, amplitude: 0.2, period: {45 + g % 3}s}}",
            f"    clocks_mhz: {{sm: {{base: 1600, amplitude: 150, period: {12 + g % 9}s}}}}",
            "    nvlink: {links: 18}",  # an H100 SXM's: 18 links in the one field-value call
            # Hopper's GPU Performance Monitoring: SM and tensor activity, two calls a sample
            "    gpm: true",
            f"    fields: {{sm_active: {{base: 0.4, amplitude: 0.3, period: {20 + g % 11}s}}, "
            "tensor_active: 0.3}",
            # Ampere and newer remap rows instead of retiring pages: not counted as families
            "    unsupported: [retired_pages_single_bit, retired_pages_double_bit, "
            "retired_pages_pending]",
        ]
        if row:
            lines.append("    processes:")
        for p, pid in enumerate(row):
            lines.append(
                f"      - {{pid: {pid}, memory: {{base: {mib}MiB, amplitude: {mib // 4}MiB, "
                f"period: {10 + p % 23}s}}}}"
            )
    return "\n".join(lines) + "\n"


# -- reading an exporter from outside ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int, timeout: float = 60.0) -> tuple[int, bytes, float]:
    """GET /metrics on a fresh connection: (status, body, seconds). Raises on network errors."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        body = response.read()
        return response.status, body, time.perf_counter() - started
    finally:
        conn.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid``, in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_syscalls(pid: int) -> int | None:
    """Read syscalls (syscr of /proc/PID/io: read, readv, pread; not socket receives)."""
    try:
        with open(f"/proc/{pid}/io", "rb") as handle:
            for line in handle:
                if line.startswith(b"syscr:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def thread_reads(pid: int) -> tuple[int | None, dict[str, int]]:
    """syscr of the whole process (exited threads included) and of each live thread."""
    per_thread = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(OSError, ValueError, IndexError),
                open(f"/proc/{pid}/task/{tid}/io", "rb") as handle,
            ):
                for line in handle:
                    if line.startswith(b"syscr:"):
                        per_thread[tid] = int(line.split()[1])
    return read_syscalls(pid), per_thread


def reads_of_gone_threads(
    before: tuple[int | None, dict[str, int]], after: tuple[int | None, dict[str, int]]
) -> int | None:
    """Read syscalls between two readings by threads that are gone at the second: the
    exporter's per-request threads (both serve HTTP with a thread per request). The sampler
    and scheduler threads live on, and their reads are left out."""
    if before[0] is None or after[0] is None:
        return None
    live = sum(count - before[1].get(tid, 0) for tid, count in after[1].items())
    return after[0] - before[0] - live


def listen_overflows() -> int | None:
    """The host's TCP listen queue overflows so far (TcpExt ListenOverflows)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, numbers in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], numbers.split()[1:], strict=False))
            if "ListenOverflows" in table:
                return int(table["ListenOverflows"])
    return None


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM of ``pid`` in MB (10^6 bytes)."""
    with open(f"/proc/{pid}/status", "rb") as handle:
        for line in handle:
            if line.startswith(b"VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    return None


@dataclass
class Stats:
    calls: int
    by_function: dict[str, int]
    at: float  # this script's perf_counter when read
    symbols: dict[str, int] = field(default_factory=dict)  # C symbols looked up


def read_stats(pid: int, path: str, timeout: float = 10.0) -> Stats:
    """Ask the wrapper for its NVML counters (SIGUSR1) and wait for the new file."""
    before = _stats_seq(path)
    asked = time.perf_counter()
    os.kill(pid, signal.SIGUSR1)
    while time.perf_counter() - asked < timeout:
        if _stats_seq(path) != before:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
            return Stats(data["calls"], data["by_function"], asked, data.get("symbols", {}))
        time.sleep(0.005)
    raise RuntimeError(f"the exporter (pid {pid}) did not write {path} within {timeout:g}s")


def _stats_seq(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as handle:
            return int(json.load(handle)["seq"])
    except (OSError, ValueError, KeyError):
        return -1


def samples_between(a: Stats, b: Stats, gpus: int) -> float:
    """Samples taken between two readings, counted: both exporters read utilization once per
    GPU per sample."""
    util = "nvmlDeviceGetUtilizationRates"
    return (b.by_function.get(util, 0) - a.by_function.get(util, 0)) / max(gpus, 1)


# -- the exposition ----------------------------------------------------------------------------


def describe_exposition(body: bytes, uuid: str, pid: int | None) -> dict[str, Any]:
    """Series; the families with a value per GPU (a uuid label) or per process (and a pid
    label); the series with a value of GPU ``uuid`` and of process ``pid`` on it."""
    from prometheus_client.parser import text_string_to_metric_families

    text = body.decode("utf-8", "replace")
    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    gpu, process = [], []
    gpu_values = process_values = 0
    for family in text_string_to_metric_families(text):
        valued = [s for s in family.samples if not math.isnan(s.value)]
        if any("pid" in s.labels and "uuid" in s.labels for s in valued):
            process.append(family.name)
        elif any("uuid" in s.labels for s in valued):
            gpu.append(family.name)
        for sample in valued:
            if sample.labels.get("uuid") != uuid:
                continue
            if "pid" not in sample.labels:
                gpu_values += 1
            elif sample.labels["pid"] == str(pid):
                process_values += 1
    return {
        "series": series,
        "gpu_fields": sorted(gpu),
        "process_fields": sorted(process),
        "gpu_values": gpu_values,
        "process_values": process_values,
    }


# -- one exporter --------------------------------------------------------------------------------


@dataclass
class Settings:
    sequential: int = 300
    threads: int = 16
    per_thread: int = 100
    burst: int = 1000
    cpu_seconds: float = 30.0
    settle: float = 130.0  # run at least this long before the CPU window ends and RSS is read
    interval: float = 1.0
    phase_timeout: float = 90.0
    start_timeout: float = 180.0
    show_fields: bool = False


@dataclass
class Result:
    exporter: str
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    fields: dict[str, list[str]] = field(default_factory=dict)
    calls: dict[str, float] = field(default_factory=dict)  # per function, per sample taken
    symbols: dict[str, float] = field(default_factory=dict)  # C symbol lookups, per sample


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Load:
    """Scrapes with fresh connections, bounded in count and in time; counts errors."""

    def __init__(self, port: int, deadline_s: float) -> None:
        self.port = port
        self.deadline_s = deadline_s
        self.errors = 0
        self.error_examples: list[str] = []
        self._lock = threading.Lock()

    def _one(self, latencies: list[float]) -> None:
        try:
            status, _, seconds = scrape(self.port)
        except Exception as exc:
            self._error(f"{type(exc).__name__}: {exc}")
            return
        if status != 200:
            self._error(f"HTTP {status}")
        latencies.append(seconds)

    def _error(self, what: str) -> None:
        with self._lock:
            self.errors += 1
            if len(self.error_examples) < 3:
                self.error_examples.append(what)

    def sequential(self, count: int) -> tuple[list[float], float]:
        latencies: list[float] = []
        started = time.perf_counter()
        end = started + self.deadline_s
        for _ in range(count):
            if time.perf_counter() > end:
                break
            self._one(latencies)
        return latencies, time.perf_counter() - started

    def concurrent(self, threads: int, total: int) -> tuple[list[float], float]:
        """``total`` scrapes shared by ``threads`` threads; (latencies, wall seconds)."""
        latencies: list[float] = []
        left = [total]
        started = time.perf_counter()
        end = started + self.deadline_s

        def worker() -> None:
            mine: list[float] = []
            while time.perf_counter() < end:
                with self._lock:
                    if left[0] <= 0:
                        break
                    left[0] -= 1
                self._one(mine)
            with self._lock:
                latencies.extend(mine)

        pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        return latencies, time.perf_counter() - started


def command(exporter: str, python: str, host: Host, stats: str, port: int, interval: float):
    common = [python, str(WRAPPER), host.scenario, stats, "--"]
    if exporter == OURS:
        return [
            *common,
            "gpu-exporter",
            "--listen",
            f"127.0.0.1:{port}",
            "--interval",
            f"{interval:g}s",
            "--dev",
            host.dev,
        ]
    return [
        *common,
        "nvitop-exporter",
        "--bind-address",
        "127.0.0.1",
        "--port",
        str(port),
        "--interval",
        f"{interval:g}",
        "--hostname",
        "bench-host",
    ]


def measure(
    exporter: str, python: str, host: Host, settings: Settings, reaper: Reaper, log: Callable
) -> Result:
    """Start one exporter on ``host``, measure it, stop it."""
    result = Result(exporter)
    values = result.values
    port = _free_port()
    stats = os.path.join(host.folder, f"stats-{exporter}.json")
    log_path = os.path.join(host.folder, f"{exporter}.log")
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as out:
        started = time.perf_counter()
        child = reaper.popen(
            command(exporter, python, host, stats, port, settings.interval),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=host.folder,
        )
    try:
        # Time to first scrape: from the start of the process to the first 200 whose body has
        # series of every GPU.
        wanted = [f'uuid="{uuid}"'.encode() for uuid in host.uuids]
        while True:
            if child.poll() is not None:
                raise RuntimeError(
                    f"{LABELS[exporter]} exited ({child.returncode}); see below\n" + _tail(log_path)
                )
            if time.perf_counter() - started > settings.start_timeout:
                raise RuntimeError(
                    f"{LABELS[exporter]}: no full /metrics within "
                    f"{settings.start_timeout:g}s\n" + _tail(log_path)
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, body, _ = scrape(port, timeout=10)
                if status == 200 and all(w in body for w in wanted):
                    values["first_scrape_s"] = time.perf_counter() - started
                    break
            time.sleep(0.02)
        log(f"  {LABELS[exporter]}: first full scrape after {values['first_scrape_s']:.2f}s")

        load = Load(port, settings.phase_timeout)
        latencies, seconds = load.sequential(settings.sequential)
        _short(result, "sequential", len(latencies), settings.sequential, seconds)
        values["seq_p50_ms"] = _percentile(latencies, 0.50) * 1e3
        values["seq_p99_ms"] = _percentile(latencies, 0.99) * 1e3
        log(f"  {LABELS[exporter]}: sequential done ({len(latencies)} scrapes, {seconds:.1f}s)")

        total = settings.threads * settings.per_thread
        before, cpu_before = read_stats(child.pid, stats), cpu_seconds(child.pid)
        overflows_before = listen_overflows()
        latencies, seconds = load.concurrent(settings.threads, total)
        after, cpu_after = read_stats(child.pid, stats), cpu_seconds(child.pid)
        overflows_after = listen_overflows()
        _short(result, "concurrent", len(latencies), total, seconds)
        values["conc_p50_ms"] = _percentile(latencies, 0.50) * 1e3
        values["conc_p99_ms"] = _percentile(latencies, 0.99) * 1e3
        values["conc_max_ms"] = max(latencies, default=math.nan) * 1e3
        values["conc_rps"] = len(latencies) / seconds if seconds > 0 else math.nan
        values["conc_cpu_percent"] = (cpu_after - cpu_before) / (after.at - before.at) * 100
        values["conc_samples"] = (
            f"{samples_between(before, after, host.gpus):.0f} in {after.at - before.at:.1f}s"
        )
        values["listen_overflows"] = (
            overflows_after - overflows_before
            if overflows_before is not None and overflows_after is not None
            else None
        )
        log(f"  {LABELS[exporter]}: concurrent done ({len(latencies)} scrapes, {seconds:.1f}s)")

        # The burst: does scraping call NVML or read files, beyond what sampling does?
        burst_before, reads_before = read_stats(child.pid, stats), thread_reads(child.pid)
        latencies, seconds = load.concurrent(settings.threads, settings.burst)
        time.sleep(0.2)  # the last request threads exit after their response is sent
        burst_after, reads_after = read_stats(child.pid, stats), thread_reads(child.pid)
        _short(result, "burst", len(latencies), settings.burst, seconds)
        burst_scrapes = max(len(latencies), 1)
        reads = reads_of_gone_threads(reads_before, reads_after)
        values["burst_reads_per_scrape"] = reads / burst_scrapes if reads is not None else math.nan
        log(f"  {LABELS[exporter]}: burst done ({len(latencies)} scrapes, {seconds:.1f}s)")

        # Scraped once a second, as Prometheus would, until the exporter has run ``settle``
        # seconds (gpu-exporter keeps ``history`` samples: its memory grows until that many
        # were taken); the CPU window is the last ``cpu_seconds`` of it.
        stop = threading.Event()

        def once_a_second() -> None:
            while not stop.wait(1.0):
                load._one([])

        scraper = threading.Thread(target=once_a_second, daemon=True)
        scraper.start()
        age = time.perf_counter() - started
        settle = max(0.0, settings.settle - age - settings.cpu_seconds)
        if settle:
            log(f"  {LABELS[exporter]}: settling for {settle:.0f}s (scraped once a second)")
            time.sleep(settle)
        before, cpu_before = read_stats(child.pid, stats), cpu_seconds(child.pid)
        t0 = time.perf_counter()
        time.sleep(settings.cpu_seconds)
        stop.set()
        scraper.join()
        after, cpu_after = read_stats(child.pid, stats), cpu_seconds(child.pid)
        elapsed = time.perf_counter() - t0
        values["cpu_percent"] = (cpu_after - cpu_before) / elapsed * 100
        # Samples in the window: counted (each exporter reads utilization once per GPU per
        # sample); elapsed / interval when none were (no GPU answered).
        window_samples = elapsed / settings.interval
        counted = samples_between(before, after, host.gpus)
        calls = after.calls - before.calls
        values["calls_per_sample"] = calls / (counted or window_samples)
        values["samples"] = f"{counted:.0f} in {elapsed:.1f}s"
        if counted and abs(counted - window_samples) > 0.1 * window_samples:
            result.notes.append(
                f"{LABELS[exporter]} took {counted:.0f} samples in the {elapsed:.0f}s window, "
                f"not {window_samples:.0f}: calls / (elapsed / interval) would be "
                f"{calls / window_samples:.1f} NVML calls per sample"
            )
        calls_per_taken = calls / counted if counted else math.nan
        result.calls = {
            name: (count - before.by_function.get(name, 0)) / counted
            for name, count in sorted(after.by_function.items())
            if counted and count > before.by_function.get(name, 0)
        }
        result.symbols = {
            name: (count - before.symbols.get(name, 0)) / counted
            for name, count in sorted(after.symbols.items())
            if counted and count > before.symbols.get(name, 0)
        }
        log(f"  {LABELS[exporter]}: CPU window done ({elapsed:.1f}s)")

        taken = samples_between(burst_before, burst_after, host.gpus)
        calls = burst_after.calls - burst_before.calls
        values["burst_calls"] = f"{calls} ({taken:.0f})"
        values["burst_calls_per_scrape"] = (calls - taken * calls_per_taken) / burst_scrapes
        values["age_s"] = time.perf_counter() - started

        status, body, _ = scrape(port)
        if status != 200:
            load.errors += 1
        values["metrics_bytes"] = len(body)
        first_pid = host.pids[0][0] if host.pids[0] else None
        described = describe_exposition(body, host.uuids[0], first_pid)
        for key in ("series", "gpu_values", "process_values"):
            values[key] = described[key]
        values["gpu_fields"] = len(described["gpu_fields"])
        values["process_fields"] = len(described["process_fields"])
        result.fields = {k: described[k] for k in ("gpu_fields", "process_fields")}
        values["rss_mb"] = peak_rss_mb(child.pid)
        values["errors"] = load.errors
        if load.error_examples:
            result.notes.append(
                f"{LABELS[exporter]} errors, for example: {'; '.join(load.error_examples)}"
            )
        if child.poll() is not None:
            raise RuntimeError(f"{LABELS[exporter]} died during the run\n" + _tail(log_path))
    finally:
        reaper.stop(child, signal.SIGINT)
    return result


def _short(result: Result, phase: str, done: int, wanted: int, seconds: float) -> None:
    if done < wanted:
        result.notes.append(
            f"{LABELS[result.exporter]}: the {phase} phase stopped at its time limit after "
            f"{done} of {wanted} scrapes ({seconds:.0f}s)"
        )


def _tail(path: str, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    return ""


# -- the nvitop-exporter environment -------------------------------------------------------------


def default_nvitop_venv() -> str:
    cache = os.environ.get("XDG_CACHE_HOME")
    if cache:
        return os.path.join(cache, "gpu-exporter-bench", "venv-nvitop")
    return "/tmp/gpu-exporter-bench-venv"


def nvitop_python(venv: str, log: Callable) -> str:
    """The interpreter of a virtual environment with nvitop-exporter and PyYAML; created when
    missing. Raises RuntimeError when it cannot be made."""
    python = os.path.join(venv, "bin", "python")
    check = [python, "-c", "import nvitop_exporter, nvitop, pynvml, yaml"]
    if os.path.exists(python) and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    log(f"creating {venv} with {NVITOP_REQUIREMENT} (once)")
    steps = [
        [sys.executable, "-m", "venv", venv],
        [python, "-m", "pip", "install", "--quiet", NVITOP_REQUIREMENT, "pyyaml"],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(step)} failed:\n{done.stdout}{done.stderr}".strip())
    if subprocess.run(check, capture_output=True).returncode != 0:
        raise RuntimeError(f"{venv} lacks nvitop-exporter after installing it")
    return python


# -- the table -----------------------------------------------------------------------------------


def _fmt(value: Any, grouped: bool = False) -> str:
    """A table cell: numbers to a few significant digits, thousands grouped with ``grouped``."""
    if value is None:
        return "n/a"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return f"{value:,}" if grouped else str(value)
    if math.isnan(value):
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}" if grouped else f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _ratio(a: Any, b: Any) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return ""
    if math.isnan(a) or math.isnan(b) or b == 0:
        return ""
    return f"{a / b:.1f}x"


def table(results: dict[str, Result]) -> str:
    """The aligned table: one column per exporter, and nvitop/ours where both ran."""
    columns = [e for e in (OURS, NVITOP) if e in results]
    both = len(columns) == 2
    header = ["", *(LABELS[e] for e in columns)] + (["nvitop/ours"] if both else [])
    rows = [header]
    for key, name, ratio in ROWS:
        cells = [name, *(_fmt(results[e].values.get(key)) for e in columns)]
        if both:
            cells.append(
                _ratio(results[NVITOP].values.get(key), results[OURS].values.get(key))
                if ratio
                else ""
            )
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    out = []
    for row in rows:
        first = row[0].ljust(widths[0])
        rest = [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        out.append("  ".join([first, *rest]).rstrip())
    return "\n".join(out)


def targets(results: dict[str, Result]) -> list[str]:
    """The issue's targets, each met or missed with its numbers."""
    if OURS not in results:
        return []
    ours = results[OURS].values
    lines = []

    def verdict(ok: bool, text: str) -> None:
        lines.append(f"  [{'met' if ok else 'MISSED'}] {text}")

    rss = ours.get("rss_mb")
    if rss is not None:
        verdict(rss <= 45, f"peak RSS at most 45 MB: {rss:.1f} MB")
    verdict(
        abs(ours["burst_calls_per_scrape"]) < 0.05,
        f"scrapes call no NVML: {ours['burst_calls_per_scrape']:.3f} calls per scrape beyond "
        f"sampling ({ours['burst_calls']} in a burst)",
    )
    reads = ours["burst_reads_per_scrape"]
    verdict(
        not math.isnan(reads) and reads < 0.05,
        f"scrapes read no files (procfs included): {_fmt(reads)} read syscalls per scrape in "
        "the request threads (glibc reads /sys/devices/system/cpu/online when it makes a "
        "malloc arena for a new thread)",
    )
    if NVITOP not in results:
        return lines
    theirs = results[NVITOP].values
    for key, what in (("seq_p99_ms", "sequential"), ("conc_p99_ms", "concurrent")):
        factor = theirs[key] / ours[key]
        verdict(
            factor >= 10,
            f"scrape p99 {what} at least 10x lower: {ours[key]:.2f} vs {theirs[key]:.2f} ms "
            f"({factor:.1f}x)",
        )
    factor = ours["conc_rps"] / theirs["conc_rps"]
    verdict(
        factor >= 10,
        f"throughput at least 10x higher: {ours['conc_rps']:.0f} vs {theirs['conc_rps']:.0f} "
        f"scrapes/s ({factor:.1f}x)",
    )
    verdict(
        ours["cpu_percent"] <= theirs["cpu_percent"] / 3,
        f"agent CPU at most a third: {ours['cpu_percent']:.2f}% vs {theirs['cpu_percent']:.2f}% "
        f"(ours is {ours['cpu_percent'] / theirs['cpu_percent']:.2f} of theirs)",
    )
    verdict(
        ours["cpu_percent"] <= theirs["cpu_percent"] / 4,
        f"agent CPU at most 0.25x nvitop-exporter's, GPM and per-process utilization on "
        f"(issue 19): {ours['cpu_percent']:.2f}% vs {theirs['cpu_percent']:.2f}%",
    )
    calls = ours["calls_per_sample"] / theirs["calls_per_sample"]
    families = ours["gpu_fields"] / max(theirs["gpu_fields"], 1)
    verdict(
        calls <= 0.75 and families >= 2,
        f"NVML calls per sample at most 0.75x nvitop-exporter's while exporting at least 2x its "
        f"per-GPU metric families: {ours['calls_per_sample']:.1f} vs "
        f"{theirs['calls_per_sample']:.1f} calls ({calls:.2f}x), {ours['gpu_fields']} vs "
        f"{theirs['gpu_fields']} per-GPU families ({families:.1f}x)",
    )
    return lines


def scaling_table(
    runs: list[tuple[tuple[int, int], dict[str, Result]]], exporter: str, vary: str
) -> str:
    """How each figure of one exporter grows over a sweep; the last column is last / first."""
    names = [f"{g}x{p}" for (g, p), _ in runs]
    header = [f"{LABELS[exporter]}, {vary}", *names, "last/first"]
    rows = [header]
    for key, name, _ in ROWS:
        if key in ("burst_calls",):
            continue
        cells = [r[exporter].values.get(key) if exporter in r else None for _, r in runs]
        growth = _ratio(cells[-1], cells[0]) if key not in ("errors",) else ""
        rows.append([name, *(_fmt(c) for c in cells), growth])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            [
                row[0].ljust(widths[0]),
                *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)),
            ]
        ).rstrip()
        for row in rows
    )


# -- the run ---------------------------------------------------------------------------------


def run_config(
    gpus: int,
    per_gpu: int,
    exporters: list[str],
    pythons: dict[str, str],
    settings: Settings,
    reaper: Reaper,
    log: Callable,
) -> dict[str, Result]:
    folder = tempfile.mkdtemp(prefix="gpu-exporter-bench-")
    try:
        host = make_host(reaper, gpus, per_gpu, folder)
        listed = gpus * per_gpu
        reuse = f", reused round-robin for {listed} listed" if host.distinct < listed else ""
        print(
            f"\n== {gpus} GPUs x {per_gpu} processes per GPU: {host.distinct} distinct real "
            f"processes{reuse}; NVML calls cost {CALL_LATENCY}; sample interval "
            f"{settings.interval:g}s",
            flush=True,
        )
        results = {}
        for exporter in exporters:
            results[exporter] = measure(exporter, pythons[exporter], host, settings, reaper, log)
        print(table(results))
        for result in results.values():
            for note in result.notes:
                print(f"note: {note}")
        lines = targets(results)
        if lines:
            print("targets:")
            print("\n".join(lines))
        if settings.show_fields:
            for result in results.values():
                for kind, names in result.fields.items():
                    print(f"{LABELS[result.exporter]} {kind} ({len(names)}): {', '.join(names)}")
                calls = ", ".join(f"{name} {n:.1f}" for name, n in result.calls.items())
                print(f"{LABELS[result.exporter]} NVML calls per sample taken: {calls}")
                if result.symbols:
                    looked = ", ".join(f"{name} {n:.1f}" for name, n in result.symbols.items())
                    print(f"{LABELS[result.exporter]} C symbols looked up per sample: {looked}")
        sys.stdout.flush()
        return results
    finally:
        reaper.stop_all()
        shutil.rmtree(folder, ignore_errors=True)


def machine() -> str:
    """CPUs, CPU model and memory, from /proc."""
    model, memory = "unknown CPU", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = f", {int(line.split()[1]) / 1024**2:.0f} GiB memory"
                break
    return f"{os.cpu_count()} CPUs ({model}){memory}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark gpu-exporter against nvitop-exporter on simulated GPUs."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 GPUs x 2 processes, "
        "few scrapes, a 3 s CPU window; nvitop-exporter only if it can be had",
    )
    parser.add_argument("--gpus", type=int, help="simulated GPUs (default 8)")
    parser.add_argument("--processes", type=int, help="processes per GPU (default 16)")
    parser.add_argument("--cpu-seconds", type=float, help="CPU window in seconds (default 30)")
    parser.add_argument(
        "--exporters", default="ours,nvitop", help="comma-separated: ours, nvitop (default both)"
    )
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="1, 8, 64 GPUs x 16 processes and 8 GPUs x 0, 16, 128 processes",
    )
    parser.add_argument("--sequential", type=int, help="sequential scrapes (default 300)")
    parser.add_argument("--threads", type=int, help="concurrent scrapers (default 16)")
    parser.add_argument("--per-thread", type=int, help="scrapes per concurrent scraper (100)")
    parser.add_argument("--burst", type=int, help="scrapes in the NVML/procfs burst (1000)")
    parser.add_argument(
        "--settle",
        type=float,
        help="scrape once a second until each exporter has run this many seconds before the "
        "CPU window ends and peak RSS is read (default 130: gpu-exporter's 120-sample history "
        "at 1 s is full by then; 0 with --quick)",
    )
    parser.add_argument(
        "--phase-timeout",
        type=float,
        default=90.0,
        help="each load phase stops after this many seconds (default 90)",
    )
    parser.add_argument(
        "--nvitop-venv",
        default=default_nvitop_venv(),
        help="virtual environment for nvitop-exporter, created when missing "
        "(default $XDG_CACHE_HOME/gpu-exporter-bench/venv-nvitop, else "
        "/tmp/gpu-exporter-bench-venv)",
    )
    parser.add_argument(
        "--show-fields",
        action="store_true",
        help="also list each exporter's GPU and process families and its NVML calls",
    )
    args = parser.parse_args(argv)
    exporters = [e.strip() for e in args.exporters.split(",") if e.strip()]
    if not exporters or any(e not in LABELS for e in exporters):
        parser.error("--exporters takes ours, nvitop or ours,nvitop")
    args.exporters = [e for e in (OURS, NVITOP) if e in exporters]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quick = args.quick
    settings = Settings(
        sequential=args.sequential or (20 if quick else 300),
        threads=args.threads or (4 if quick else 16),
        per_thread=args.per_thread or (10 if quick else 100),
        burst=args.burst or (50 if quick else 1000),
        cpu_seconds=args.cpu_seconds or (3.0 if quick else 30.0),
        phase_timeout=args.phase_timeout,
        settle=args.settle if args.settle is not None else (0.0 if quick else 130.0),
        show_fields=args.show_fields,
    )
    gpus = args.gpus if args.gpus is not None else (2 if quick else 8)
    per_gpu = args.processes if args.processes is not None else (2 if quick else 16)
    if gpus < 1 or per_gpu < 0:
        print("benchmark: --gpus must be at least 1 and --processes at least 0", file=sys.stderr)
        return 2

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        import prometheus_client  # noqa: F401  (describe_exposition parses with it)

        import exporter
    except ImportError as exc:
        print(
            f"benchmark: run me with the project's environment (.venv/bin/python): {exc}",
            file=sys.stderr,
        )
        return 2
    pythons = {OURS: sys.executable}
    exporters = list(args.exporters)
    if NVITOP in exporters:
        try:
            pythons[NVITOP] = nvitop_python(args.nvitop_venv, log)
        except RuntimeError as exc:
            if not quick:
                print(f"benchmark: nvitop-exporter is not available: {exc}", file=sys.stderr)
                return 1
            print(
                f"note: nvitop-exporter could not be installed, measuring gpu-exporter only "
                f"({str(exc).splitlines()[0]})"
            )
            exporters.remove(NVITOP)

    print(
        f"machine: {machine()}, Python {sys.version.split()[0]}; scrapes: "
        f"{settings.sequential} sequential, {settings.threads} threads x "
        f"{settings.per_thread} concurrent, burst {settings.burst}; CPU window "
        f"{settings.cpu_seconds:g}s scraped once a second"
    )
    reaper = Reaper()
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        configs = list(SCALING) if args.scaling else [(gpus, per_gpu)]
        runs = []
        for g, p in configs:
            runs.append(((g, p), run_config(g, p, exporters, pythons, settings, reaper, log)))
        if args.scaling:
            sweeps = (
                ("GPUs (16 processes each)", [r for r in runs if r[0][1] == 16]),
                ("processes per GPU (8 GPUs)", [r for r in runs if r[0][0] == 8]),
            )
            for vary, chosen in sweeps:
                chosen.sort(key=lambda r: r[0][0] if "GPUs (" in vary else r[0][1])
                for exporter in exporters:
                    print(f"\n== growth with {vary}")
                    print(scaling_table(chosen, exporter, vary.split(" (")[0]))
    except KeyboardInterrupt:
        print("\nbenchmark: interrupted; stopping everything it started", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"benchmark: {exc}", file=sys.stderr)
        return 1
    finally:
        reaper.stop_all()
        signal.signal(signal.SIGTERM, previous)
    return 0


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
