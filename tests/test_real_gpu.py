"""Checks on a real NVIDIA GPU; skipped wherever a real NVML does not answer."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter

import pytest

from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.exposition.metrics import render
from exporter.sampling.collect import Collector
from exporter.sampling.stats import SelfStats
from tests.helpers import until


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


class _Counting:
    """pynvml with a count of the calls of each of its functions (the real driver's)."""

    def __init__(self, library) -> None:
        self._library = library
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str):
        found = getattr(self._library, name)
        if not (name.startswith("nvml") and callable(found)):
            return found

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return found(*args, **kwargs)

        return counted


def test_real_health_readings_in_one_field_call_per_gpu():
    import pynvml

    library = _Counting(pynvml)
    collector = Collector(Nvml(library=library), ProcFs())
    try:
        snap = collector.sample()
        count = len(snap.gpus)
        before = library.calls["nvmlDeviceGetFieldValues"]
        again = collector.sample()
        assert library.calls["nvmlDeviceGetFieldValues"] - before == count
    finally:
        collector.close()
    assert not [e for e in again.errors if e.source in ("gpu", "nvml")], again.errors
    for gpu in again.gpus:
        fields, static = gpu.fields, gpu.info.fields
        if "power" in fields:
            assert 0 < fields["power"] < 2000
        if "energy" in fields:
            assert fields["energy"] >= snap.gpus[gpu.index].fields.get("energy", 0)
        if "memory_temperature" in fields:
            assert 0 < fields["memory_temperature"] < 130
        generation, most = (
            fields.get("pcie_link_generation"),
            static.get("pcie_link_generation_max"),
        )
        if generation is not None and most is not None:
            assert 1 <= generation <= most <= 7
        width, widest = fields.get("pcie_link_width"), static.get("pcie_link_width_max")
        if width is not None and widest is not None:
            assert 1 <= width <= widest <= 32
        for key in ("row_remap_pending", "row_remap_failed", "retired_pages_pending"):
            assert fields.get(key) in (None, 0.0, 1.0), key
        if "recovery_action" in fields:
            assert fields["recovery_action"] in range(8)
        assert len(gpu.nvlink) <= gpu.info.nvlink_links <= 18
        for values in gpu.nvlink.values():
            assert values.get("nvlink_up") in (None, 0.0, 1.0)
        for key, value in fields.items():
            if key.startswith("clock_event_seconds_"):
                assert 0 <= value < 10 * 365 * 86400, key  # ns scaled to s, not ns
        print(
            f"GPU {gpu.index}: {len(fields)} readings, {len(gpu.nvlink)} NVLink links, "
            f"{sum(len(v) for v in gpu.nvlink.values())} link readings; calls by function: "
            f"{dict(library.calls)}"
        )


def test_real_xid_registration_and_a_quick_stop():
    from exporter.core.xid import XidLog
    from exporter.sampling.events import XidWatcher

    nvml = Nvml()
    watcher = XidWatcher(nvml, XidLog())
    collector = Collector(nvml, ProcFs(), xids=watcher)
    watcher.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            snap = collector.sample()
            if all(g.xid_events_supported is not None for g in snap.gpus if g.up):
                break
            time.sleep(0.2)
        states = [g.xid_events_supported for g in snap.gpus]
        assert None not in states, states
        print(f"XID events supported per GPU: {states}")
        started = time.monotonic()
        assert watcher.stop(2.0)
        assert time.monotonic() - started < 2.0
    finally:
        watcher.stop(2.0)
        collector.close()


def _hopper_gpus(collector: Collector) -> list[int]:
    return [g.index for g in collector.sample().gpus if g.info and g.info.gpm_supported]


def _gpm_values(collector: Collector, index: int, key: str) -> float | None:
    """The GPM reading ``key`` of GPU ``index`` in a new sample, once it has one: the samples
    a fifth of a second apart, a window GPM can average over."""
    time.sleep(0.2)
    return collector.sample().gpus[index].fields.get(key)


def test_gpm_answers_on_hopper_and_later(real_collector):
    gpus = _hopper_gpus(real_collector)
    if not gpus:
        pytest.skip("no GPU here has GPM (Hopper and later)")
    for index in gpus:  # from the second sample on
        sm = until(lambda i=index: _gpm_values(real_collector, i, "sm_active") is not None)
        assert sm is not None and 0 <= _gpm_values(real_collector, index, "sm_active") <= 1
    snap = real_collector.sample()
    assert all(e.field != "gpm" for e in snap.errors), snap.errors
    for index in gpus:
        assert 0 <= snap.gpus[index].fields["graphics_engine_active"] <= 1


def test_a_matrix_multiplication_shows_tensor_activity(real_collector):
    pytest.importorskip("torch")
    gpus = _hopper_gpus(real_collector)
    if not gpus:
        pytest.skip("no GPU here has GPM (Hopper and later)")
    # half-precision matmuls on the first GPM GPU, for up to 30 s: tensor cores at work
    code = (
        "import time, torch\n"
        f"d = torch.device('cuda:{gpus[0]}')\n"
        "a = torch.randn(8192, 8192, device=d, dtype=torch.float16)\n"
        "print('ready', flush=True)\n"
        "end = time.time() + 30\n"
        "while time.time() < end:\n"
        "    a = (a @ a).clamp_(-1, 1)\n"
        "    torch.cuda.synchronize()\n"
    )
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        tensor = until(
            lambda: (_gpm_values(real_collector, gpus[0], "tensor_active") or 0) > 0,
            "tensor activity on the GPU",
            timeout=25,
        )
        assert tensor
        assert (_gpm_values(real_collector, gpus[0], "sm_active") or 0) > 0
    finally:
        child.kill()
        child.wait()


def test_mig_devices_of_a_gpu_in_mig_mode(real_collector):
    snap = real_collector.sample()
    in_mig = [g for g in snap.gpus if g.info and g.info.mig_slots]
    if not in_mig:
        pytest.skip("no GPU here is in MIG mode")
    for gpu in in_mig:
        assert gpu.mig_devices, "a GPU in MIG mode with no MIG device read"
        for device in gpu.mig_devices:
            assert UUID.match(device.uuid) and device.uuid.startswith("MIG-"), device
            assert device.gpu_instance is not None and device.profile, device
            assert 0 <= device.memory_used_bytes <= device.memory_total_bytes, device
        on = {uuid for p in gpu.processes or () for uuid in p.mig_uuids}
        assert on <= {d.uuid for d in gpu.mig_devices}
