"""The benchmark runs: a quick gpu-exporter-only smoke run prints the whole table.

No timing is asserted: the figures depend on the machine. nvitop-exporter is left out so that
the test needs nothing beyond the project's own environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script, pids_running

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
BENCHMARK = REPO / "bench" / "benchmark.py"


def _row_names() -> tuple[str, ...]:
    return load_script(BENCHMARK).ROW_NAMES


def _pool_processes() -> set[int]:
    """PIDs of processes that look like the benchmark's (``sleep 86400``)."""
    return pids_running(b"sleep\x0086400\x00")


def test_quick_run_prints_every_row_and_stops_what_it_started() -> None:
    rows = _row_names()
    assert "scrape p99, sequential (ms)" in rows and "NVML calls per sample" in rows
    before = _pool_processes()
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", "--exporters", "ours"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    header = next((line for line in lines if line.strip().startswith("gpu-exporter")), None)
    assert header is not None, done.stdout
    assert "nvitop-exporter" not in header
    for name in rows:
        assert any(line.startswith(name) for line in lines), (name, done.stdout)
    assert "2 GPUs x 2 processes per GPU: 4 distinct real processes" in done.stdout
    assert not (_pool_processes() - before), "the benchmark left its processes running"


HTTP_BENCH = REPO / "bench" / "http_bench.py"


@pytest.mark.skipif(
    shutil.which("wrk") is None or shutil.which("nginx") is None,
    reason="wrk or nginx not installed (Debian: apt-get install wrk nginx-light)",
)
def test_http_bench_quick_run_prints_the_table_and_stops_what_it_started() -> None:
    before, nginx_before = _pool_processes(), _nginx_processes()
    done = subprocess.run(
        [sys.executable, str(HTTP_BENCH), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for row in (
        "keep-alive: requests/s",
        "keep-alive: p99 (ms)",
        "Connection: close: requests/s",
        "Connection: close: p99 (ms)",
        "targets:",
    ):
        assert row in done.stdout, (row, done.stdout)
    assert "keep-alive: errors                             0" in done.stdout, done.stdout
    assert not (_pool_processes() - before), "the benchmark left its processes running"
    assert not (_nginx_processes() - nginx_before), "nginx left running"


def _nginx_processes() -> set[int]:
    """PIDs of nginx masters and workers (they rename themselves ``nginx: ...``)."""
    found = set()
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                if handle.read().startswith(b"nginx: "):
                    found.add(int(name))
        except (OSError, ValueError):
            continue
    return found


def test_the_startup_benchmark_prints_its_table():
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "startup.py"), "--runs", "1", "--skip-nvisel"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = ("simulation alone (ours)", "gpu-exporter --version", "gpu-exporter recommend")
    for row in (*rows, "gpu-exporter status"):
        assert row in done.stdout
