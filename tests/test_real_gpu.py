"""Checks on a real NVIDIA GPU; skipped wherever a real NVML does not answer."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.exposition.metrics import render
from exporter.sampling.collect import Collector
from exporter.sampling.stats import SelfStats


def _real_nvml() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _real_nvml(), reason="no real NVML here (no NVIDIA driver or GPU)"),
]
UUID = re.compile(r"^(GPU|MIG)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@pytest.fixture
def real_collector():
    collector = Collector(Nvml(), ProcFs())
    yield collector
    collector.close()


def test_real_snapshot_is_sane(real_collector):
    snap = real_collector.sample()
    assert snap.nvml_up and snap.gpus, snap.nvml_error
    assert snap.host.driver_version
    for gpu in snap.gpus:
        assert gpu.up, gpu.error
        assert UUID.match(gpu.uuid), gpu.uuid
        total = gpu.info.memory_total_bytes
        assert 0 <= gpu.memory_used_bytes <= total
        assert (
            gpu.memory_used_bytes + gpu.memory_free_bytes + (gpu.memory_reserved_bytes or 0)
            <= total
        )
        if gpu.temperature_celsius is not None:
            assert 0 < gpu.temperature_celsius < 120
        if gpu.utilization_ratio is not None:
            assert 0 <= gpu.utilization_ratio <= 1
    assert b"gpu_up" in render(snap, SelfStats(5))
    # a second sample reuses static facts: fewer calls
    second = real_collector.sample()
    assert second.nvml_calls < snap.nvml_calls


def test_a_process_that_allocates_gpu_memory_appears(real_collector):
    pytest.importorskip("torch")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch, time; x = torch.empty(512 * 2**20, dtype=torch.uint8, device='cuda');"
            " torch.cuda.synchronize(); print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        found = None
        for _ in range(20):
            snap = real_collector.sample()
            found = [p for gpu in snap.gpus for p in gpu.processes or () if p.pid == child.pid]
            if found:
                break
            time.sleep(0.5)
        assert found, "the child's process did not appear in NVML's list"
        proc = found[0]
        assert proc.visible and proc.name.startswith("python")
        if proc.used_memory_bytes is not None:
            assert proc.used_memory_bytes >= 512 * 2**20
        # nvmlDeviceGetProcessUtilization: a ratio while the driver reports it, else absent;
        # an idle, allocated process reads 0 and its idle time grows between samples
        if proc.sm_utilization_ratio is not None:
            assert 0 <= proc.sm_utilization_ratio <= 1
            time.sleep(1.1)
            again = [
                p
                for gpu in real_collector.sample().gpus
                for p in gpu.processes or ()
                if p.pid == child.pid
            ]
            assert again and again[0].gpu_idle_seconds is not None
    finally:
        child.kill()
        child.wait()
