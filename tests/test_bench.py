"""The benchmark runs: a quick gpu-exporter-only smoke run prints the whole table.

No timing is asserted: the figures depend on the machine. nvitop-exporter is left out so that
the test needs nothing beyond the project's own environment.
"""

from __future__ import annotations

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
