"""XID errors: NVIDIA's catalog as data, and the thread NVML pushes XIDs to (delivered once per
event, registered again after NVML or a GPU comes back, quick to stop, never spinning)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.core.xid import RESOLUTIONS, XidLog, catalog, describe_xid
from exporter.exposition.metrics import render
from exporter.sampling.collect import Collector
from exporter.sampling.events import LOG_PER_MINUTE, XidWatcher
from exporter.sampling.stats import SelfStats
from tests.helpers import one, samples, until

ROOT = Path(__file__).resolve().parent.parent
TWO = """
gpus:
  - name: GPU A
    xids: [{at: 0s, code: 13}]
  - name: GPU B
"""


# -- the catalog --------------------------------------------------------------------------------


def test_catalog_lines_are_complete_and_map_buckets_one_way():
    entries = catalog()
    assert len(entries) >= 160 and set(entries) == set(range(1, len(entries) + 1))
    by_bucket: dict[str, set[str]] = {}
    for info in entries.values():
        assert info.resolution in RESOLUTIONS and info.resolution != "unknown"
        assert info.mnemonic and info.bucket
        by_bucket.setdefault(info.bucket, set()).add(info.resolution)
    assert all(len(resolutions) == 1 for resolutions in by_bucket.values()), by_bucket
    assert by_bucket["RESTART_APP"] == {"restart_app"}
    assert by_bucket["RESET_GPU"] == by_bucket["WORKFLOW_XID_48"] == {"reset_gpu"}
    assert by_bucket["RESTART_BM"] == {"reboot"} and by_bucket["IGNORE"] == {"ignore"}


@pytest.mark.parametrize(
    ("code", "resolution"),
    [
        (13, "restart_app"),
        (31, "restart_app"),
        (43, "ignore"),
        (48, "reset_gpu"),
        (63, "ignore"),
        (74, "check_workflow"),
        (79, "reboot"),
        (94, "restart_app"),
        (95, "reset_gpu"),
        (119, "reset_gpu"),
        (154, "check_workflow"),
        (999, "unknown"),
    ],
)
def test_resolution_is_a_fixed_function_of_the_code(code, resolution):
    assert describe_xid(code).resolution == resolution


def test_catalog_is_package_data():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"core/*.csv"' in text


# -- the thread -------------------------------------------------------------------------------


@pytest.fixture
def agent(simulated, clock):
    """A collector with the XID thread on the test's simulated driver (started by the test's
    first ``simulated(...)``)."""
    nvml = Nvml(library=simulated.library)
    watcher = XidWatcher(nvml, XidLog(), timeout_ms=200, backoff_initial=0.05)
    collector = Collector(nvml, ProcFs(), monotonic=clock, xids=watcher)
    watcher.start()
    yield collector
    assert watcher.stop(2.0)
    collector.close()


def _counts(collector: Collector, index: int = 0) -> dict[int, int]:
    return dict(collector.sample().gpus[index].xid_counts)


def test_each_xid_is_delivered_once_counted_and_kept(simulated, agent, caplog):
    driver = simulated(TWO)
    snap = agent.sample()  # registers both GPUs
    until(lambda: agent.sample().gpus[1].xid_events_supported, "registration")
    driver.inject_xid(1, 79)
    driver.inject_xid(1, 79)
    driver.inject_xid(1, 48, gpu_instance=2, compute_instance=0)
    until(lambda: sum(_counts(agent, 1).values()) == 3, "three XIDs")
    snap = agent.sample()
    gpu = snap.gpus[1]
    assert dict(gpu.xid_counts) == {79: 2, 48: 1}
    assert [(x.xid, x.resolution) for x in gpu.xids] == [
        (79, "reboot"),
        (79, "reboot"),
        (48, "reset_gpu"),
    ]
    assert gpu.xids[-1].gpu_instance == 2 and gpu.xids[-1].compute_instance == 0
    assert gpu.xids[0].mnemonic == "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS"
    assert abs(gpu.xids[0].timestamp - time.time()) < 60
    found = samples(render(snap, SelfStats(interval_seconds=5)))
    uuid = gpu.uuid
    assert one(found, "gpu_xid_errors_total", uuid=uuid, xid="79", resolution="reboot") == 2
    assert one(found, "gpu_xid_errors_total", gpu="1", xid="48", resolution="reset_gpu") == 1
    assert one(found, "gpu_xid_events_supported", gpu="1") == 1
    # the XID of GPU A at scenario time 0 came before the agent registered: NVML never shows it
    assert _counts(agent, 0) == {}
    assert [r.getMessage() for r in caplog.records if "XID 79" in r.getMessage()] == [
        f"GPU 1 ({uuid}): XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS, resolution reboot"
    ] * 2
    body = snap.to_dict()["gpus"][1]
    assert body["xid_counts"] == {"79": 2, "48": 1} and body["xids"][0]["xid"] == 79
    # nothing more comes: each event was delivered once
    time.sleep(0.3)
    assert dict(agent.sample().gpus[1].xid_counts) == {79: 2, 48: 1}


def test_scenario_xids_arrive_at_their_time(simulated, agent, clock):
    simulated("gpus: [{xids: [{at: 5s, code: 31}, {at: 10s, code: 119}]}]\n")
    until(lambda: agent.sample().gpus[0].xid_events_supported, "registration")
    clock.advance(5)
    until(lambda: _counts(agent) == {31: 1}, "the first XID")
    clock.advance(5)
    until(lambda: _counts(agent) == {31: 1, 119: 1}, "the second XID")


def test_registered_again_after_nvml_comes_back(simulated, agent, clock):
    driver = simulated(
        """
        driver: {errors: [{field: count, error: DriverNotLoaded, from: 5s, until: 6s}]}
        gpus: [{}]
        """
    )
    until(lambda: agent.sample().gpus[0].xid_events_supported, "registration")
    generation = agent.nvml.generation
    driver.inject_xid(0, 13)
    until(lambda: _counts(agent) == {13: 1}, "an XID")
    clock.advance(5)
    assert not agent.sample().nvml_up  # lost: shut down, the thread's set went with it
    clock.advance(5)
    until(lambda: agent.sample().nvml_up, "NVML back")
    assert agent.nvml.generation == generation + 1
    registrations = driver.calls["nvmlDeviceRegisterEvents"]
    until(lambda: driver.calls["nvmlDeviceRegisterEvents"] > registrations, "registered again")
    driver.inject_xid(0, 13)
    until(lambda: _counts(agent) == {13: 2}, "an XID after the re-initialisation")


def test_registered_again_when_a_gpu_comes_back(simulated, agent, clock):
    driver = simulated(
        "gpus: [{}, {errors: [{field: '*', error: GpuIsLost, from: 5s, until: 6s}]}]\n"
    )
    until(lambda: agent.sample().gpus[1].xid_events_supported, "registration")
    registrations = driver.calls["nvmlDeviceRegisterEvents"]
    clock.advance(5)
    assert not agent.sample().gpus[1].up
    until(lambda: driver.calls["nvmlDeviceRegisterEvents"] > registrations, "GPU 0 alone")
    clock.advance(1)
    assert agent.sample().gpus[1].up
    before = driver.calls["nvmlDeviceRegisterEvents"]
    until(lambda: driver.calls["nvmlDeviceRegisterEvents"] >= before + 2, "both again")
    driver.inject_xid(1, 95)
    until(lambda: _counts(agent, 1) == {95: 1}, "an XID of the GPU that came back")


def test_a_gpu_without_events_says_so_and_the_thread_sleeps(simulated, agent):
    driver = simulated("gpus: [{unsupported: [xid_events]}]\n")
    until(lambda: agent.sample().gpus[0].xid_events_supported is False, "registration")
    found = samples(render(agent.sample(), SelfStats(interval_seconds=5)))
    assert one(found, "gpu_xid_events_supported", gpu="0") == 0
    waits = driver.calls["nvmlEventSetWait_v2"]
    time.sleep(0.5)  # nothing to wait on: the thread must not call NVML meanwhile
    assert driver.calls["nvmlEventSetWait_v2"] == waits
    assert agent.xids.errors == 0


def test_a_failing_wait_backs_off_instead_of_spinning(simulated, agent):
    driver = simulated("gpus: [{}]\n")
    until(lambda: agent.sample().gpus[0].xid_events_supported, "registration")
    import pynvml

    def broken(event_set, timeout):
        raise pynvml.NVMLError_Unknown()

    driver.nvmlEventSetWait_v2 = broken
    until(lambda: agent.xids.errors >= 2, "two failed waits")
    time.sleep(0.5)
    assert agent.xids.errors < 10  # 0.05 s doubling: a handful, not thousands


def test_stop_takes_less_than_2s_and_the_idle_thread_uses_no_cpu(simulated, clock):
    simulated("gpus: [{}, {}]\n")
    nvml = Nvml(library=simulated.library)
    watcher = XidWatcher(nvml, XidLog())  # the agent's: 1 s waits
    collector = Collector(nvml, ProcFs(), monotonic=clock, xids=watcher)
    watcher.start()
    try:
        until(lambda: collector.sample().gpus[1].xid_events_supported, "registration")
        tid = watcher.native_id
        assert tid is not None
        before = _thread_cpu(tid)
        time.sleep(2.0)  # measuring the idle thread's CPU over a span of time, not waiting
        used = _thread_cpu(tid) - before
        # on the test's clock the simulated wait looks at it every 20 ms; a real one blocks in the
        # driver: either way, well under 5 % of a CPU
        assert used < 0.1, f"the idle XID thread used {used:.3f} s of CPU in 2 s"
        started = time.monotonic()
        assert watcher.stop(2.0)
        assert time.monotonic() - started < 2.0
    finally:
        watcher.stop(2.0)
        collector.close()


def _thread_cpu(tid: int) -> float:
    """CPU seconds (user + system) of thread ``tid`` of this process."""
    with open(f"/proc/self/task/{tid}/stat") as handle:
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_xid_storm_is_counted_whole_and_logged_in_moderation(simulated, agent, caplog):
    driver = simulated("gpus: [{}]\n")
    until(lambda: agent.sample().gpus[0].xid_events_supported, "registration")
    caplog.set_level(logging.WARNING, "exporter.sampling.events")
    for _ in range(50):
        driver.inject_xid(0, 13)
    until(lambda: _counts(agent) == {13: 50}, "fifty XIDs")
    lines = [r for r in caplog.records if "XID 13" in r.getMessage()]
    assert 1 <= len(lines) <= LOG_PER_MINUTE * 2  # at most two minutes' worth


def test_a_gpu_that_failed_to_register_is_registered_again_and_the_old_set_freed(simulated, clock):
    import pynvml

    driver = simulated("gpus: [{}, {}]\n")
    real = driver.nvmlDeviceRegisterEvents
    failed = []

    def once_busy(handle, types, event_set):
        if handle.index == 1 and not failed:
            failed.append(1)
            raise pynvml.NVMLError_Timeout()
        return real(handle, types, event_set)

    driver.nvmlDeviceRegisterEvents = once_busy
    nvml = Nvml(library=driver)
    watcher = XidWatcher(nvml, XidLog(), timeout_ms=100, backoff_max=0.3)
    collector = Collector(nvml, ProcFs(), monotonic=clock, xids=watcher)
    watcher.start()
    try:
        until(lambda: collector.sample().gpus[1].xid_events_supported, "GPU 1 registered later")
        assert failed and driver.calls["nvmlEventSetFree"] >= 1  # the first set was freed
        driver.inject_xid(1, 31)
        until(lambda: dict(collector.sample().gpus[1].xid_counts) == {31: 1}, "its XID")
    finally:
        assert watcher.stop(2.0)
        collector.close()
