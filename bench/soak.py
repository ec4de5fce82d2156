#!/usr/bin/env python3
"""Soak: the real agent on a simulated host whose processes churn, scraped for a long time.

    .venv/bin/python bench/soak.py             # 8 GPUs, 10,000 samples at 20 ms, 100,000 scrapes
    .venv/bin/python bench/soak.py --quick     # the CI version: 600 samples, 5,000 scrapes
    .venv/bin/python bench/soak.py --samples 50000 --scrapes 500000 --json soak.json

It starts ``gpu-exporter serve --simulate SCENARIO`` (this interpreter, ``-m exporter``) on a
free loopback port with a short ``--interval``, a lock directory of its own, the simulation's
device stand-ins as ``paths.dev``, and a config that runs the four actions every second
(``--actions-every``; the reaper in its default dry run, with an audit log file), so that
they run hundreds of times over the churning PIDs, not a few. The scenario (written per run,
in a temporary folder) gives every GPU moving values and four processes NVML lists:

- a long-lived real process (``sleep``, a child of the agent holding its GPU's device file);
- a real process that is killed, reaped and started again every ``--real-every`` samples
  (``churn`` in docs/simulate.md), staggered across GPUs so that with the default (one per GPU)
  one real process ends and another starts on the host every sample;
- a PID this host cannot see (above ``pid_max``, like another container's process) that is a
  new PID every interval (every sample while the sampler keeps time), and another that is a
  new PID every five intervals.

Churn follows scenario time, not the agent's samples: a sampler that falls behind meets more
new processes per sample, never fewer.

Client threads scrape ``/metrics`` on fresh connections until both ``--samples`` samples
(``gpu_exporter_samples_total``) and ``--scrapes`` scrapes are done, keeping pace with the
samples (scrapes per sample as the two targets say) so that neither finishes long before the
other and the scrapers do not starve the sampler. At checkpoints the
clients pause, and the agent is read from outside while no request is in flight: VmRSS,
threads (``/proc/PID/status``), open descriptors (``/proc/PID/fd``, pidfds left out: the reaper
holds one per GPU process it watches; the sampler's kept procfs descriptors of GPU processes
counted apart, bounded by the processes listed) and its children, live and
defunct. A monitor client parses the per-process series of ``/metrics`` every 100 ms. At the
end, ``/metrics`` and ``/snapshot`` of the same sample are compared, and the agent is stopped
and must leave no process behind.

The table it prints has each figure, its goal and whether it was met; the exit code is 1 when
a goal was missed, 2 for bad options. See docs/benchmarks.md ("Soak") for a run's results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark import (
    REPO,
    Reaper,
    _free_port,
    _percentile,
    cpu_seconds,
    machine,
    scenario_yaml,
    scrape,
)

#: PIDs above Linux's largest pid_max (4194304) never exist here: processes NVML lists that
#: this host cannot see. GPU g's two churning entries count up from these.
INVISIBLE_BASE = 10_000_000
INVISIBLE_STRIDE = 1_000_000  # per GPU; the second entry starts half-way
ENTRIES_PER_GPU = 4
#: The real processes: a week's sleep, told apart from bench/benchmark.py's (a day's).
SLEEP = ["sleep", "604800"]
#: The agent keeps this many Snapshots (its default ``--history``); warm-up lasts at least this.
HISTORY = 120
QUICK = {"samples": 600, "scrapes": 5_000}
FULL = {"samples": 10_000, "scrapes": 100_000}
_SAMPLES = re.compile(rb"^gpu_exporter_samples_total (\S+)$", re.M)
_TIMESTAMP = re.compile(rb"^gpu_exporter_last_sample_timestamp_seconds (\S+)$", re.M)
_PROCESS_SERIES = re.compile(rb"^gpu_process_memory_used_bytes\{([^}]*)\}", re.M)
_LABEL = re.compile(rb'(\w+)="((?:[^"\\]|\\.)*)"')
_PROCESS_LINE = b"\ngpu_process_memory_used_bytes{"
_ACTION = re.compile(rb'^gpu_exporter_action_(runs|failures)_total\{action="(\w+)"\} (\S+)$', re.M)


# -- the host ----------------------------------------------------------------------------------


def soak_scenario(gpus: int, interval: float, real_every: int) -> str:
    """The scenario: bench/benchmark.py's moving GPUs (no driver latency), each with the four
    processes described in the module's docstring."""
    uuids = [f"GPU-50a1{g:04x}-0000-4000-8000-{g:012x}" for g in range(gpus)]
    data = yaml.safe_load(scenario_yaml([[] for _ in range(gpus)], uuids, "0s"))
    for g, gpu in enumerate(data["gpus"]):
        base = INVISIBLE_BASE + g * INVISIBLE_STRIDE
        memory = {"base": "1GiB", "amplitude": "256MiB", "period": f"{10 + g}s"}
        gpu["processes"] = [
            {"spawn": SLEEP, "memory": memory},
            {
                "spawn": SLEEP,
                "memory": memory,
                "churn": f"{real_every * interval:g}s",
                "from": f"{(g % real_every) * interval:g}s",  # staggered across the GPUs
            },
            {"pid": base, "memory": "512MiB", "churn": f"{interval:g}s"},
            {
                "pid": base + INVISIBLE_STRIDE // 2,
                "memory": "256MiB",
                "churn": f"{5 * interval:g}s",
            },
        ]
    header = "# Written by bench/soak.py: processes churn every sample.\n"
    return header + yaml.safe_dump(data, sort_keys=False)


def agent_config(actions_every: float, audit_log: str) -> str:
    """The agent's config: the actions every ``actions_every`` seconds (0: their defaults), so
    that they run hundreds of times over churning PIDs, not a few; the reaper (dry run, its
    default) writes its audit log to ``audit_log``."""
    every = {"every": f"{actions_every:g}s"} if actions_every else {}
    actions = {
        "zombie_reaper": {**every, "audit_log": audit_log},
        "thermal": dict(every),
        "health": dict(every),
        "recommend": dict(every),
    }
    return yaml.safe_dump({"actions": actions}, sort_keys=False)


def proc_status(pid: int) -> dict[str, str]:
    """``/proc/PID/status`` as a dict (empty when the process is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as handle:
            return dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)
    except OSError:
        return {}


#: A GPU process's procfs directory or ``stat`` as the sampler keeps them (``(deleted)`` once
#: the process has ended and before the next sample lets it go).
_KEPT_PROCFS = re.compile(r"/proc/\d+(/stat)?( \(deleted\))?")


def open_fds(pid: int) -> tuple[int, int]:
    """Open file descriptors of ``pid``: (the rest, the kept ``/proc/PID`` directories and
    ``stat`` files). Neither count has its pidfds: the zombie reaper holds one on each GPU
    process it watches (the evidence that a job ended). The sampler keeps a GPU process's
    procfs directory and ``stat`` open while the process is listed and lets them go at the
    sample after it vanished: those follow the churning processes too, and are counted apart
    so that a replacement caught between two samples does not read as two descriptors fewer."""
    rest = kept = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target == "anon_inode:[pidfd]":
            continue
        if _KEPT_PROCFS.fullmatch(target):
            kept += 1
        else:
            rest += 1
    return rest, kept


def is_simulation_guard(pid: int) -> bool:
    """Whether ``pid`` is the simulation's guard (a child of the agent while processes it
    spawned run; docs/simulate.md), not one of the scenario's processes."""
    from exporter.simulate.processes import GUARD_MARK

    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as handle:
        return handle.read().split(b"\0")[-2:-1] == [GUARD_MARK.encode()]
    return False


def children_of(pid: int) -> dict[int, str]:
    """The children of ``pid`` and their states (``S``, ``R``, ``Z``, ...), from each of its
    threads' ``children`` file: one read per thread, where a scan of all of /proc would miss
    the children that are replaced while it runs."""
    pids: set[int] = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                pids.update(map(int, Path(f"/proc/{pid}/task/{tid}/children").read_text().split()))
    found = {}
    for child in pids:
        with contextlib.suppress(OSError, IndexError), open(f"/proc/{child}/stat", "rb") as handle:
            found[child] = handle.read().rsplit(b")", 1)[1].split()[0].decode()
    return found


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), which tells a reused PID apart; None when
    there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return int(handle.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


# -- the clients -------------------------------------------------------------------------------


def process_series(body: bytes) -> list[dict[str, str]]:
    """The labels of every ``gpu_process_memory_used_bytes`` series of an exposition."""
    return [
        {k.decode(): v.decode() for k, v in _LABEL.findall(labels)}
        for labels in _PROCESS_SERIES.findall(body)
    ]


def _number(pattern: re.Pattern[bytes], body: bytes) -> float | None:
    match = pattern.search(body)
    return float(match.group(1)) if match else None


class Clients:
    """Scraper threads and one monitor thread, which can all be paused between requests."""

    def __init__(self, port: int, scrapers: int, per_gpu_limit: int, per_sample: float) -> None:
        self.port = port
        self.per_gpu_limit = per_gpu_limit
        #: Scrapes per sample the scrapers keep to (with some slack), so that both targets are
        #: reached together and the scrapers do not starve the sampler of the CPU.
        self.per_sample = per_sample
        self.scrapes = 0
        self.failures = 0
        self.failure_examples: list[str] = []
        self.samples = 0.0
        self.max_process_series = 0
        self.latencies: list[float] = []
        self.monitored = 0
        self.over_limit = 0  # monitored scrapes with more per-process series on a GPU than listed
        self.invisible_pids: set[int] = set()
        self.visible_pids: set[int] = set()
        self._lock = threading.Lock()  # the counters
        self._changed = threading.Condition()  # pausing: the flags and requests in flight
        self._paused = False
        self._stopped = False
        self._busy = 0
        self._threads = [
            threading.Thread(target=self._scraper, name=f"scraper-{i}", daemon=True)
            for i in range(scrapers)
        ]
        self._threads.append(threading.Thread(target=self._monitor, name="monitor", daemon=True))

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def get(self, path: str = "/metrics") -> bytes | None:
        """One counted request; its body when it answered 200."""
        try:
            if path == "/metrics":
                status, body, seconds = scrape(self.port)
            else:
                status, body, seconds = _get(self.port, path)
        except Exception as exc:
            self._failed(f"{path}: {type(exc).__name__}: {exc}")
            return None
        with self._lock:
            self.scrapes += 1
            self.latencies.append(seconds)
        if status != 200:
            self._failed(f"{path}: HTTP {status}")
            return None
        if path == "/metrics":
            samples = _number(_SAMPLES, body)
            series = body.count(_PROCESS_LINE)
            with self._lock:
                self.samples = max(self.samples, samples or 0.0)
                self.max_process_series = max(self.max_process_series, series)
        return body

    def _failed(self, what: str) -> None:
        with self._lock:
            self.failures += 1
            if len(self.failure_examples) < 5:
                self.failure_examples.append(what)

    def _begin(self) -> bool:
        """Wait while paused, then count one request in flight; False once stopped."""
        with self._changed:
            while self._paused and not self._stopped:
                self._changed.wait()
            if self._stopped:
                return False
            self._busy += 1
            return True

    def _end(self) -> None:
        with self._changed:
            self._busy -= 1
            self._changed.notify_all()

    def _scraper(self) -> None:
        while not self._stopped:
            if self.scrapes > (self.samples + 10) * self.per_sample:
                time.sleep(0.002)  # ahead of the samples: let the sampler catch up
                continue
            if not self._begin():
                break
            try:
                self.get()
            finally:
                self._end()

    def _monitor(self) -> None:
        while self._begin():
            try:
                body = self.get()
            finally:
                self._end()
            if body is not None:
                self._look(body)
            time.sleep(0.1)

    def _look(self, body: bytes) -> None:
        per_gpu: dict[str, int] = {}
        invisible, visible = set(), set()
        for labels in process_series(body):
            per_gpu[labels["gpu"]] = per_gpu.get(labels["gpu"], 0) + 1
            pid = int(labels["pid"])
            (invisible if pid >= INVISIBLE_BASE else visible).add(pid)
        with self._lock:
            self.monitored += 1
            self.over_limit += any(n > self.per_gpu_limit for n in per_gpu.values())
            self.invisible_pids |= invisible
            self.visible_pids |= visible

    def pause(self, timeout: float = 30.0) -> None:
        """Let no new request start, and wait until none is in flight."""
        deadline = time.monotonic() + timeout
        with self._changed:
            self._paused = True
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError("the clients did not pause (a request hangs?)")
                self._changed.wait(left)

    def resume(self) -> None:
        with self._changed:
            self._paused = False
            self._changed.notify_all()

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join(60)


def _get(port: int, path: str, timeout: float = 60.0) -> tuple[int, bytes, float]:
    import http.client

    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read(), time.perf_counter() - started
    finally:
        conn.close()


# -- readings from outside ---------------------------------------------------------------------


@dataclass
class Checkpoint:
    """The agent read from outside while no request was in flight."""

    at_s: float  # since the agent started
    samples: float
    scrapes: int
    rss_mb: float
    threads: int
    fds: int
    #: kept procfs descriptors of GPU processes (``open_fds``), the most of the readings
    procfs_fds: int
    children: int
    defunct: int
    cpu_s: float


def quiet_reading(pid: int, reads: int = 10) -> tuple[float, int, int, int, int, int]:
    """(VmRSS MB, threads, fds, kept procfs fds, live children, defunct children) once the
    agent's request threads have ended: threads are read until the same count comes five
    times in a row.
    The agent goes on meanwhile: the sampler may be starting a process (a descriptor or two
    and a child more, or one less, for a few ms), the reaper scanning /proc (a descriptor more
    for a while). So each figure is the least of ``reads`` readings over half a second (the
    most, for live children and kept procfs descriptors): what stays, not what comes and goes.
    The simulation's guard is not counted among the children."""
    deadline, same, last = time.monotonic() + 5, 0, -1
    while same < 5 and time.monotonic() < deadline:
        threads = int(proc_status(pid).get("Threads", "0"))
        same, last = (same + 1, last) if threads == last else (1, threads)
        time.sleep(0.01)
    rows = []
    for _ in range(reads):
        status = proc_status(pid)
        kids = {c: s for c, s in children_of(pid).items() if not is_simulation_guard(c)}
        rows.append(
            (
                int(status["VmRSS"].split()[0]) * 1024 / 1e6,
                int(status["Threads"]),
                *open_fds(pid),
                sum(1 for state in kids.values() if state != "Z"),
                sum(1 for state in kids.values() if state == "Z"),
            )
        )
        time.sleep(0.05)
    rss, threads, fds, _, _, defunct = (min(column) for column in zip(*rows, strict=True))
    kept = max(row[3] for row in rows)
    live = max(row[4] for row in rows)  # a churning child is briefly missing while replaced
    return rss, threads, fds, kept, live, defunct


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Options:
    gpus: int
    samples: int
    scrapes: int
    interval: float
    scrapers: int
    real_every: int
    warmup: float
    checkpoints: int
    rss_limit_mb: float
    timeout: float
    actions_every: float = 1.0  # 0: the agent's defaults (30 s, 5 s, 10 s)
    json: str | None = None


@dataclass
class Outcome:
    options: Options
    seconds: float = 0.0
    samples: float = 0.0
    scrapes: int = 0
    failures: int = 0
    failure_examples: list[str] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    warmup_index: int = 0
    max_process_series: int = 0
    series_limit: int = 0
    over_limit: int = 0
    monitored: int = 0
    invisible_pids_seen: int = 0
    visible_pids_seen: int = 0
    last_invisible_pid_per_sample: int = 0  # how far the every-sample entry has counted
    final_metrics_pids: int = 0
    final_extra_in_metrics: list[str] = field(default_factory=list)
    final_missing_from_metrics: list[str] = field(default_factory=list)
    final_shape_errors: list[str] = field(default_factory=list)
    left_after_stop: int = 0
    action_runs: dict[str, list[int]] = field(default_factory=dict)  # name: [runs, failures]
    audit_lines: int = 0
    exit_code: int | None = None
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    log_tail: str = ""

    @property
    def warm(self) -> Checkpoint:
        return self.checkpoints[self.warmup_index]

    @property
    def end(self) -> Checkpoint:
        return self.checkpoints[-1]

    def rss_growth_mb(self) -> float:
        return max(c.rss_mb for c in self.checkpoints[self.warmup_index :]) - self.warm.rss_mb

    def rss_slope_mb(self) -> float:
        """Least-squares RSS growth per 10,000 samples over the checkpoints after warm-up."""
        points = [(c.samples, c.rss_mb) for c in self.checkpoints[self.warmup_index :]]
        if len(points) < 2:
            return 0.0
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        var = sum((x - mx) ** 2 for x, _ in points)
        return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in points) / var * 10_000


def run(opts: Options, log: Callable[[str], None]) -> Outcome:
    """Start the agent, load it until both targets are reached, read it, stop it."""
    outcome = Outcome(opts, series_limit=opts.gpus * ENTRIES_PER_GPU)
    folder = tempfile.mkdtemp(prefix="gpu-exporter-soak-")
    reaper = Reaper()
    clients: Clients | None = None
    try:
        scenario = os.path.join(folder, "scenario.yaml")
        Path(scenario).write_text(soak_scenario(opts.gpus, opts.interval, opts.real_every))
        locks = os.path.join(folder, "locks")
        os.mkdir(locks, 0o700)
        port = _free_port()
        log_path = os.path.join(folder, "agent.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_EXPORTER_")}
        config = os.path.join(folder, "config.yaml")
        audit = os.path.join(folder, "audit.jsonl")
        Path(config).write_text(agent_config(opts.actions_every, audit))
        argv = [
            *(sys.executable, "-m", "exporter", "serve", "--config", config),
            *("--simulate", scenario, "--listen", f"127.0.0.1:{port}"),
            *("--interval", f"{opts.interval:g}s", "--lock-dir", locks),
            *("--deadline", "1s"),  # a slow sample on a loaded host is not what this measures
        ]
        with open(log_path, "wb") as err:
            agent = reaper.popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
                cwd=REPO,
            )
        started = time.monotonic()
        clients = Clients(port, opts.scrapers, ENTRIES_PER_GPU, opts.scrapes / opts.samples)
        _first_sample(clients, agent, started, log_path)
        outcome.checkpoints.append(_checkpoint(clients, agent.pid, started))
        log(f"soak: agent pid {agent.pid} on port {port}, first sample taken; loading")
        clients.start()
        warm_at = max(opts.warmup, (HISTORY + 20) / opts.samples)
        marks = [warm_at + (1 - warm_at) * i / opts.checkpoints for i in range(opts.checkpoints)]
        marks.append(1.0)
        while marks:
            if agent.poll() is not None:
                raise RuntimeError(f"the agent exited ({agent.returncode}):\n{_tail(log_path)}")
            if time.monotonic() - started > opts.timeout:
                raise RuntimeError(f"not done after {opts.timeout:g}s (see --timeout)")
            progress = min(clients.samples / opts.samples, clients.scrapes / opts.scrapes)
            if progress >= marks[0]:
                if len(outcome.checkpoints) == 1:
                    outcome.warmup_index = 1
                marks.pop(0)
                clients.pause()
                outcome.checkpoints.append(_checkpoint(clients, agent.pid, started))
                point = outcome.checkpoints[-1]
                log(
                    f"soak: {point.samples:.0f} samples, {point.scrapes} scrapes, "
                    f"RSS {point.rss_mb:.2f} MB, {point.threads} threads, {point.fds} fds"
                )
                if marks:
                    clients.resume()
            time.sleep(0.05)
        outcome.seconds = time.monotonic() - started
        final_checks(outcome, clients, agent.pid)  # the clients are still paused
        clients.stop()
        children = {pid: start_ticks(pid) for pid in children_of(agent.pid)}
        outcome.exit_code = _stop(agent)
        outcome.left_after_stop = sum(
            1 for pid, ticks in children.items() if ticks is not None and start_ticks(pid) == ticks
        )
        _fill(outcome, clients)
        outcome.log_tail = _tail(log_path)
        with contextlib.suppress(OSError), open(audit, "rb") as handle:
            outcome.audit_lines = sum(1 for _ in handle)
        return outcome
    finally:
        if clients is not None:
            clients.stop()
        reaper.stop_all()
        shutil.rmtree(folder, ignore_errors=True)


def _first_sample(clients: Clients, agent: subprocess.Popen[bytes], started: float, log_path: str):
    while clients.samples < 2:
        if agent.poll() is not None:
            raise RuntimeError(f"the agent exited ({agent.returncode}):\n{_tail(log_path)}")
        if time.monotonic() - started > 60:
            raise RuntimeError(f"no sample within 60 s:\n{_tail(log_path)}")
        with contextlib.suppress(Exception):
            status, body, _ = scrape(clients.port, timeout=5)
            if status == 200:
                clients.samples = _number(_SAMPLES, body) or 0.0
        time.sleep(0.05)


def _checkpoint(clients: Clients, pid: int, started: float) -> Checkpoint:
    rss, threads, fds, kept, live, defunct = quiet_reading(pid)
    cpu = cpu_seconds(pid)
    return Checkpoint(
        at_s=time.monotonic() - started,
        samples=clients.samples,
        scrapes=clients.scrapes,
        rss_mb=rss,
        threads=threads,
        fds=fds,
        procfs_fds=kept,
        children=live,
        defunct=defunct,
        cpu_s=cpu,
    )


def final_checks(outcome: Outcome, clients: Clients, agent_pid: int) -> None:
    """No series left behind: /metrics against /snapshot of the same sample, and both against
    what the scenario lists on each GPU at any moment."""
    opts = outcome.options
    for _ in range(50):
        body = clients.get("/metrics")
        raw = clients.get("/snapshot")
        if body is None or raw is None:
            continue
        snapshot = json.loads(raw)
        if _number(_TIMESTAMP, body) == snapshot["timestamp"]:
            break
    else:
        outcome.final_shape_errors.append("no /metrics and /snapshot of the same sample")
        return
    for kind, action, count in _ACTION.findall(body):
        outcome.action_runs.setdefault(action.decode(), [0, 0])[kind == b"failures"] = int(
            float(count)
        )
    in_metrics = {(s["gpu"], s["pid"]) for s in process_series(body)}
    listed = {
        (str(g["index"]), str(p["pid"])): p for g in snapshot["gpus"] for p in g["processes"] or ()
    }
    outcome.final_metrics_pids = len(in_metrics)
    outcome.final_extra_in_metrics = sorted(f"gpu {g} pid {p}" for g, p in in_metrics - set(listed))
    outcome.final_missing_from_metrics = sorted(
        f"gpu {g} pid {p}" for g, p in set(listed) - in_metrics
    )
    for gpu in range(opts.gpus):
        base = INVISIBLE_BASE + gpu * INVISIBLE_STRIDE
        pids = [int(p) for g, p in in_metrics if g == str(gpu)]
        first = [p for p in pids if base <= p < base + INVISIBLE_STRIDE // 2]
        second = [p for p in pids if base + INVISIBLE_STRIDE // 2 <= p < base + INVISIBLE_STRIDE]
        real = [p for p in pids if p < INVISIBLE_BASE]
        children = [
            p
            for p in real
            if listed[(str(gpu), str(p))]["ppid"] == agent_pid
            and listed[(str(gpu), str(p))]["name"] == "sleep"
        ]
        if len(first) != 1 or len(second) != 1 or len(children) != 2 or len(real) != 2:
            outcome.final_shape_errors.append(
                f"GPU {gpu}: pids {sorted(pids)}, expected one of each churning entry and two "
                f"sleep children of the agent"
            )
        if gpu == 0 and first:
            outcome.last_invisible_pid_per_sample = first[0] - base


def _fill(outcome: Outcome, clients: Clients) -> None:
    outcome.samples = clients.samples
    outcome.scrapes = clients.scrapes
    outcome.failures = clients.failures
    outcome.failure_examples = clients.failure_examples
    outcome.max_process_series = clients.max_process_series
    outcome.over_limit = clients.over_limit
    outcome.monitored = clients.monitored
    outcome.invisible_pids_seen = len(clients.invisible_pids)
    outcome.visible_pids_seen = len(clients.visible_pids)
    outcome.p50_ms = _percentile(clients.latencies, 0.5) * 1000
    outcome.p99_ms = _percentile(clients.latencies, 0.99) * 1000
    outcome.max_ms = max(clients.latencies, default=math.nan) * 1000


def _stop(agent: subprocess.Popen[bytes]) -> int | None:
    agent.send_signal(signal.SIGTERM)
    try:
        return agent.wait(20)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()
        return None


def _tail(path: str, lines: int = 20) -> str:
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as handle:
        return "".join(handle.readlines()[-lines:])
    return ""


# -- the report --------------------------------------------------------------------------------


def rows(outcome: Outcome) -> list[tuple[str, str, str, bool | None]]:
    """(figure, value, goal, met: True/False, or None for a figure without a goal)."""
    o, opts = outcome, outcome.options
    first, warm, end = o.checkpoints[0], o.warm, o.end
    after = o.checkpoints[o.warmup_index :]
    growth = o.rss_growth_mb()
    cpu = (end.cpu_s - warm.cpu_s) / max(end.at_s - warm.at_s, 1e-9) * 100
    per_sample = (end.at_s - first.at_s) / max(end.samples - first.samples, 1) * 1000
    defunct = max(c.defunct for c in o.checkpoints)
    kept = max(c.procfs_fds for c in after)
    kept_limit = 2 * 3 * opts.gpus  # a steady and a churning real process, and one just ended
    seen = o.invisible_pids_seen + o.visible_pids_seen
    out: list[tuple[str, str, str, bool | None]] = [
        ("samples taken", f"{o.samples:.0f}", f">= {opts.samples}", o.samples >= opts.samples),
        ("scrapes answered", f"{o.scrapes}", f">= {opts.scrapes}", o.scrapes >= opts.scrapes),
        ("scrapes not 200 (or failed)", f"{o.failures}", "0", o.failures == 0),
        ("run time (s)", f"{o.seconds:.0f}", "", None),
        ("time per sample (ms)", f"{per_sample:.1f}", f"interval {opts.interval * 1000:g}", None),
        (
            "scrape p50 / p99 / max (ms)",
            f"{o.p50_ms:.1f} / {o.p99_ms:.1f} / {o.max_ms:.0f}",
            "",
            None,
        ),
        ("agent CPU after warm-up (%)", f"{cpu:.0f}", "", None),
        (
            "action runs: " + " / ".join(sorted(o.action_runs)),
            " / ".join(str(o.action_runs[name][0]) for name in sorted(o.action_runs)),
            "",
            None,
        ),
        (
            "action runs that failed",
            f"{sum(failed for _, failed in o.action_runs.values())}",
            "0",
            bool(o.action_runs) and not any(failed for _, failed in o.action_runs.values()),
        ),
        ("reaper audit log lines", f"{o.audit_lines}", "", None),
        (
            "warm-up ends at (samples)",
            f"{warm.samples:.0f}",
            f">= {HISTORY} (history full)",
            warm.samples >= HISTORY,
        ),
        (
            "RSS at start / warm-up / end (MB)",
            f"{first.rss_mb:.2f} / {warm.rss_mb:.2f} / {end.rss_mb:.2f}",
            "",
            None,
        ),
        (
            "RSS growth after warm-up, max (MB)",
            f"{growth:+.2f}",
            f"< {opts.rss_limit_mb:g}",
            growth < opts.rss_limit_mb,
        ),
        ("RSS trend after warm-up (MB/10k samples)", f"{o.rss_slope_mb():+.2f}", "", None),
        ("open fds, warm-up -> end", f"{warm.fds} -> {end.fds}", "equal", warm.fds == end.fds),
        (
            "kept procfs fds of GPU processes, most after warm-up",
            f"{kept}",
            f"<= {kept_limit} (2 per real process, one ended one a GPU)",
            kept <= kept_limit,
        ),
        (
            "threads, warm-up -> end",
            f"{warm.threads} -> {end.threads}",
            "equal",
            warm.threads == end.threads,
        ),
        (
            "fds / threads, most after warm-up",
            f"{max(c.fds for c in after)} / {max(c.threads for c in after)}",
            "",
            None,
        ),
        ("defunct children, most at a checkpoint", f"{defunct}", "0", defunct == 0),
        (
            "children of the agent at the end (the listed real ones)",
            f"{end.children}",
            f"{2 * opts.gpus} (an ended one left: more)",
            end.children == 2 * opts.gpus,
        ),
        (
            "PIDs the every-sample entry went through",
            f"{o.last_invisible_pid_per_sample + 1}",
            f"about the samples ({o.samples:.0f})",
            None,
        ),
        (
            "distinct PIDs seen by the monitor, invisible / real",
            f"{o.invisible_pids_seen} / {o.visible_pids_seen}",
            f"> {o.series_limit} (churn)",
            seen > o.series_limit,
        ),
        (
            "per-process series, most in one scrape",
            f"{o.max_process_series}",
            f"<= {o.series_limit}",
            o.max_process_series <= o.series_limit,
        ),
        (
            f"monitored scrapes with a GPU over {ENTRIES_PER_GPU} processes",
            f"{o.over_limit} of {o.monitored}",
            "0",
            o.over_limit == 0,
        ),
        (
            "end: series of processes not listed (left behind)",
            f"{len(o.final_extra_in_metrics)}",
            "0",
            not o.final_extra_in_metrics,
        ),
        (
            "end: listed processes without a series",
            f"{len(o.final_missing_from_metrics)}",
            "0",
            not o.final_missing_from_metrics,
        ),
        (
            "end: GPUs not listing what the scenario lists",
            f"{len(o.final_shape_errors)}",
            "0",
            not o.final_shape_errors,
        ),
        (
            "agent exit code / processes left after it",
            f"{o.exit_code} / {o.left_after_stop}",
            "0 / 0",
            o.exit_code == 0 and o.left_after_stop == 0,
        ),
    ]
    return out


def table(outcome: Outcome) -> str:
    lines = [("figure", "value", "goal", "")]
    for name, value, goal, met in rows(outcome):
        lines.append((name, value, goal, "" if met is None else ("met" if met else "MISSED")))
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    return "\n".join(
        f"{a.ljust(widths[0])}  {b.rjust(widths[1])}  {c.ljust(widths[2])}  {d}".rstrip()
        for a, b, c, d in lines
    )


def checkpoint_table(outcome: Outcome) -> str:
    head = (
        f"{'at (s)':>7} {'samples':>8} {'scrapes':>8} {'RSS (MB)':>9} {'threads':>7} {'fds':>4}"
        f" {'procfs':>6}"
    )
    out = [head]
    for i, c in enumerate(outcome.checkpoints):
        mark = "  <- warm-up" if i == outcome.warmup_index else ""
        out.append(
            f"{c.at_s:7.1f} {c.samples:8.0f} {c.scrapes:8d} {c.rss_mb:9.2f} {c.threads:7d} "
            f"{c.fds:4d} {c.procfs_fds:6d}{mark}"
        )
    return "\n".join(out)


def _duration(raw: str) -> float:
    from exporter.core.units import parse_duration

    try:
        seconds = parse_duration(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 0.01 <= seconds <= 10:
        raise argparse.ArgumentTypeError(f"{raw!r} is not from 10ms to 10s")
    return seconds


def _every(raw: str) -> float:
    from exporter.core.units import parse_duration

    try:
        seconds = parse_duration(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{raw!r} is negative")
    return seconds


def _at_least(least: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{raw} is less than {least}")
        return value

    return parse


def _fraction(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{raw} is not from 0 to below 1")
    return value


def _positive(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{raw} is not above 0")
    return value


def parse_args(argv: list[str] | None) -> Options:
    """The options; bad values end in exit code 2 with a message (argparse's)."""
    parser = argparse.ArgumentParser(
        description="Soak the real agent on a simulated host whose processes churn every sample."
    )
    add = parser.add_argument
    add("--quick", action="store_true", help="the CI version: 600 samples and 5,000 scrapes")
    add("--gpus", type=_at_least(1), default=8, help="simulated GPUs (default 8)")
    add(
        "--samples",
        type=_at_least(HISTORY + 20),
        help="samples to take at least (default 10,000; 600 with --quick)",
    )
    add(
        "--scrapes",
        type=_at_least(1),
        help="scrapes of /metrics to make at least (default 100,000; 5,000 with --quick)",
    )
    add("--interval", type=_duration, default=0.02, help="sample interval (default 20ms)")
    add("--scrapers", type=_at_least(1), default=4, help="scraping threads (default 4)")
    add(
        "--real-every",
        type=_at_least(1),
        help="samples a GPU's churning real process lives (default: the number of GPUs, so "
        "that one real process ends and one starts on the host every sample)",
    )
    add(
        "--warmup",
        type=_fraction,
        help="warm-up, a fraction of the run (default 0.15; 0.4 with --quick); at least "
        f"{HISTORY + 20} samples, so that the agent's history is full",
    )
    add("--checkpoints", type=_at_least(1), default=10, help="readings after warm-up (10)")
    add(
        "--rss-limit-mb",
        type=_positive,
        default=2.0,
        help="RSS growth allowed after warm-up, MB (default 2)",
    )
    add(
        "--actions-every",
        type=_every,
        default=1.0,
        help="run the agent's three actions this often (default 1s; 0: their own defaults, "
        "30s, 5s and 10s)",
    )
    add("--timeout", type=_positive, default=3600.0, help="give up after this many s (3600)")
    add("--json", metavar="FILE", help="also write every figure to FILE as JSON")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    return Options(
        gpus=args.gpus,
        samples=args.samples if args.samples is not None else preset["samples"],
        scrapes=args.scrapes if args.scrapes is not None else preset["scrapes"],
        interval=args.interval,
        scrapers=args.scrapers,
        real_every=args.real_every if args.real_every is not None else args.gpus,
        warmup=args.warmup if args.warmup is not None else (0.4 if args.quick else 0.15),
        checkpoints=args.checkpoints,
        rss_limit_mb=args.rss_limit_mb,
        timeout=args.timeout,
        actions_every=args.actions_every,
        json=args.json,
    )


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    print(
        f"machine: {machine()}, Python {sys.version.split()[0]}\n"
        f"soak: {opts.gpus} GPUs x {ENTRIES_PER_GPU} processes (1 steady real, 1 real replaced "
        f"every {opts.real_every} samples, 2 invisible replaced every 1 and 5 samples); "
        f"interval {opts.interval * 1000:g} ms; targets {opts.samples} samples and "
        f"{opts.scrapes} scrapes; {opts.scrapers} scrapers + 1 monitor; actions every "
        f"{f'{opts.actions_every:g}s' if opts.actions_every else '30s/5s/10s (defaults)'}",
        flush=True,
    )
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        outcome = run(opts, log)
    except KeyboardInterrupt:
        print("\nsoak: interrupted; stopped everything it started", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(checkpoint_table(outcome))
    print(table(outcome))
    for what, items in (
        ("failed requests", outcome.failure_examples),
        ("series left behind", outcome.final_extra_in_metrics),
        ("listed without a series", outcome.final_missing_from_metrics),
        ("scenario shape", outcome.final_shape_errors),
    ):
        for item in items[:5]:
            print(f"{what}: {item}")
    missed = [name for name, _, _, met in rows(outcome) if met is False]
    if opts.json:
        data = asdict(outcome)
        data["rows"] = [
            {"figure": n, "value": v, "goal": g, "met": m} for n, v, g, m in rows(outcome)
        ]
        data["rss_growth_mb"] = outcome.rss_growth_mb()
        data["missed"] = missed
        Path(opts.json).write_text(json.dumps(data, indent=1))
    if missed:
        print(f"soak: MISSED: {', '.join(missed)}\nagent log, last lines:\n{outcome.log_tail}")
        return 1
    return 0


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
