"""Collector: NVML lifecycle, lost GPUs, process enrichment and vanished processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.sampling.collect import Collector

TWO_GPUS = """
gpus:
  - name: GPU A
    processes: [{pid: self, memory: 1GiB}]
  - name: GPU B
    errors: [{field: "*", error: GpuIsLost, from: 10s, until: 20s}]
"""


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_snapshot_has_gpus_processes_and_host(simulated, collector):
    simulated(TWO_GPUS)
    snap = collector.sample()
    assert snap.nvml_up and snap.seq == 1
    assert [g.info.name for g in snap.gpus] == ["GPU A", "GPU B"]
    (proc,) = snap.gpus[0].processes
    assert proc.pid == os.getpid() and proc.visible
    assert proc.user and proc.name
    assert proc.cmdline == ()  # argv may hold secrets: only with expose_cmdline (test_security)
    assert proc.ppid == os.getppid()
    assert proc.start_time is not None and proc.start_time <= time.time() + 1
    assert snap.gpus[1].processes == ()
    assert snap.host.driver_version == "550.54.15"
    assert snap.nvml_calls > 0


def test_lost_gpu_is_down_others_keep_reporting_and_it_comes_back(simulated, collector, clock):
    driver = simulated(TWO_GPUS)
    first = collector.sample()
    uuid_b = first.gpus[1].uuid
    static_reads = driver.calls["nvmlDeviceGetUUID"]
    clock.advance(10)
    lost = collector.sample()
    assert lost.gpus[0].up and lost.gpus[0].memory_used_bytes == 1024**3
    assert not lost.gpus[1].up and lost.gpus[1].uuid == uuid_b
    assert "GpuIsLost" in lost.gpus[1].error
    assert [(e.source, e.error, e.gpu) for e in lost.errors] == [("gpu", "GpuIsLost", 1)]
    clock.advance(10)
    back = collector.sample()
    assert back.gpus[1].up and back.gpus[1].uuid == uuid_b
    # statics of GPU A were not read again; GPU B's were, once, after it came back
    assert driver.calls["nvmlDeviceGetUUID"] == static_reads + 1


def test_static_facts_are_read_once(simulated, collector):
    driver = simulated(TWO_GPUS)
    for _ in range(5):
        collector.sample()
    assert driver.calls["nvmlDeviceGetTemperatureThreshold"] == 2 * 4
    assert driver.calls["nvmlDeviceGetSerial"] == 2
    # every field value in one call per GPU per sample, and the NVLink link count once
    assert driver.calls["nvmlDeviceGetFieldValues"] == 2 * (5 + 1)
    assert driver.calls["nvmlDeviceGetPowerUsage"] == 0  # the field answers: no fallback


def test_no_driver_then_recovery_with_backoff(simulated, clock):
    driver = simulated(
        """
        driver: {errors: [{field: init, error: DriverNotLoaded, until: 5s}]}
        gpus: [{name: GPU A}]
        """
    )
    collector = Collector(
        Nvml(library=driver), ProcFs(), monotonic=clock, backoff_initial=1, backoff_max=4
    )
    attempts = []
    up_at = None
    for step in range(20):
        before = collector.nvml.calls
        snap = collector.sample()
        attempts.append(collector.nvml.calls > before and not snap.nvml_up)
        if snap.nvml_up:
            up_at = step
            break
        assert snap.gpus == ()
        assert "DriverNotLoaded" in snap.nvml_error
        clock.advance(0.5)
    # tries at 0, 1, 3 (backoff 1, 2), then 7 (4, the cap) succeeds: 3 failed tries in 7 s
    assert sum(attempts) == 3
    assert up_at == 14  # t = 7 s
    assert collector.sample().gpus[0].up
    collector.close()


def test_nvml_lost_mid_run_reinitialises_and_rereads_statics(simulated, collector, clock):
    driver = simulated(
        """
        gpus:
          - name: GPU A
            errors: [{field: memory, error: Uninitialized, from: 5s, until: 6s}]
        """
    )
    assert collector.sample().nvml_up
    clock.advance(5)
    down = collector.sample()
    assert not down.nvml_up and down.gpus == ()
    assert driver.calls["nvmlShutdown"] == 1
    clock.advance(1)
    up = collector.sample()
    assert up.nvml_up and up.gpus[0].up
    assert driver.calls["nvmlInit"] == 2
    assert driver.calls["nvmlDeviceGetUUID"] == 2


def test_process_that_is_not_visible_stays_in_the_snapshot(simulated, collector):
    pid = _dead_pid()
    simulated(
        f"gpus: [{{processes: [{{pid: {pid}, memory: 3GiB}}, {{pid: self, memory: 1GiB}}]}}]\n"
    )
    snap = collector.sample()
    procs = {p.pid: p for p in snap.gpus[0].processes}
    assert not procs[pid].visible
    assert procs[pid].used_memory_bytes == 3 * 1024**3
    assert procs[pid].user == "" and procs[pid].name == ""
    assert procs[os.getpid()].visible
    assert snap.errors == ()


def test_process_that_exits_between_nvml_and_procfs(simulated, collector):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        simulated(f"gpus: [{{processes: [{{pid: {child.pid}, memory: 1GiB}}]}}]\n")
        real_process = collector.procfs.process

        def exits_first(pid, keep=False):  # the process ends right after NVML listed it
            child.kill()
            child.wait()
            return real_process(pid, keep)

        collector.procfs.process = exits_first
        snap = collector.sample()
    finally:
        child.kill()
        child.wait()
    (proc,) = snap.gpus[0].processes
    assert proc.pid == child.pid and not proc.visible
    assert snap.errors == ()


def test_gpu_count_change_rereads_identities(simulated, collector, clock):
    simulated(
        """
        gpus:
          - {name: GPU A}
          - {name: GPU B, present: {until: 10s}}
          - {name: GPU C}
        """
    )
    assert [g.info.name for g in collector.sample().gpus] == ["GPU A", "GPU B", "GPU C"]
    clock.advance(10)
    after = collector.sample()
    assert [(g.index, g.info.name) for g in after.gpus] == [(0, "GPU A"), (1, "GPU C")]
    assert all(g.up for g in after.gpus)


@pytest.mark.parametrize("fails_at", ["10s", "20s"])
def test_failed_gpu_after_renumbering_does_not_borrow_another_uuid(
    simulated, collector, clock, fails_at
):
    simulated(
        f"""
        gpus:
          - {{name: GPU A}}
          - {{name: GPU B, present: {{until: 10s}}}}
          - {{name: GPU C}}
          - name: GPU D
            errors: [{{field: "*", error: GpuIsLost, from: {fails_at}}}]
        """
    )
    uuids = {g.info.name: g.uuid for g in collector.sample().gpus}
    clock.advance(10)
    collector.sample()  # B left: C is now index 1, D index 2
    clock.advance(10)
    after = collector.sample()
    assert [(g.index, g.up) for g in after.gpus] == [(0, True), (1, True), (2, False)]
    assert after.gpus[1].uuid == uuids["GPU C"]
    if fails_at == "20s":  # seen at its new index before it failed: identity kept
        assert after.gpus[2].uuid == uuids["GPU D"] and after.gpus[2].info.name == "GPU D"
    else:  # failed at the renumbering itself: unknown, never GPU C's
        assert after.gpus[2].uuid == "" and after.gpus[2].info is None


def test_gpu_failing_after_its_uuid_was_read_is_labelled(simulated, collector):
    simulated("gpus: [{name: GPU A, errors: [{field: name, error: GpuIsLost}]}]\n")
    gpu = collector.sample().gpus[0]
    assert not gpu.up and gpu.uuid.startswith("GPU-")


def test_process_sm_utilization_is_merged_by_pid(simulated, clock):
    pid = _dead_pid()
    driver = simulated(
        f"""
        gpus:
          - name: GPU A
            processes:
              - {{pid: self, memory: 1GiB, sm_utilization: 0.3}}
              - {{pid: self, memory: 1GiB, type: graphics}}
              - {{pid: {pid}, memory: 3GiB, sm_utilization: 0.8}}
              - {{pid: parent, memory: 1GiB}}
          - name: GPU B
            unsupported: [process_utilization]
            processes: [{{pid: self, memory: 1GiB, sm_utilization: 0.9}}]
        """
    )
    collector = Collector(Nvml(library=driver, wall=driver.wall), ProcFs(), monotonic=clock)
    try:
        snap = collector.sample()
    finally:
        collector.close()
    found = {(p.pid, p.type): p.sm_utilization_ratio for p in snap.gpus[0].processes}
    assert found == {
        (os.getpid(), "compute"): 0.3,
        (os.getpid(), "graphics"): 0.3,  # NVML's samples are per PID, not per list
        (pid, "compute"): 0.8,  # not visible here, still known to NVML
        (os.getppid(), "compute"): 0.0,
    }
    (unsupported,) = snap.gpus[1].processes
    assert unsupported.sm_utilization_ratio is None
    assert snap.errors == ()
    assert snap.to_dict()["gpus"][0]["processes"][0]["sm_utilization_ratio"] == 0.3


def test_to_gpu_process_fills_every_field_by_name() -> None:
    """to_gpu_process gives GpuProcess its fields in order: each lands where its name says."""
    import dataclasses

    from exporter.core.nvml import ProcessUtilization
    from exporter.core.procfs import ProcessInfo
    from exporter.core.snapshot import GpuProcess
    from exporter.sampling.collect import to_gpu_process

    info = ProcessInfo(
        pid=7, name="trainer", state="R", ppid=11, pgid=12, sid=13, start_ticks=14,
        start_time=15.5, uid=16, user="alice", cmdline=("python", "train.py"),
        container_id="c0ffee", pod_uid="pod-uid", script="train.py", slurm_job="42",
        slurm_step="3",
    )  # fmt: skip
    usage = ProcessUtilization(0.1, 0.2, 0.3, 0.4)
    made = to_gpu_process(7, "compute", 1024, info, True, usage, 9.5, ("MIG-a",))
    assert made == GpuProcess(
        pid=7, type="compute", used_memory_bytes=1024, visible=True, name="trainer",
        user="alice", uid=16, cmdline=("python", "train.py"), state="R", ppid=11, pgid=12,
        sid=13, start_time=15.5, container_id="c0ffee", pod_uid="pod-uid", slurm_job="42",
        slurm_step="3", script="train.py", sm_utilization_ratio=0.1,
        memory_utilization_ratio=0.2, encoder_utilization_ratio=0.3,
        decoder_utilization_ratio=0.4, mig_uuids=("MIG-a",), gpu_idle_seconds=9.5,
    )  # fmt: skip
    assert to_gpu_process(7, "compute", 1024, info, False, usage).cmdline == ()
    hidden = to_gpu_process(8, "graphics", None, None, True, usage, 1.0)
    defaults = GpuProcess(pid=8, type="graphics", used_memory_bytes=None, visible=False)
    changed = {"sm_utilization_ratio": 0.1, "memory_utilization_ratio": 0.2}
    changed |= {"encoder_utilization_ratio": 0.3, "decoder_utilization_ratio": 0.4}
    assert hidden == dataclasses.replace(defaults, **changed, gpu_idle_seconds=1.0)
