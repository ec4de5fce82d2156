"""MIG: each MIG device of a GPU in MIG mode sampled with the GPU (exporter/core/nvml.py,
core/mig.py), its series, its processes, a new layout within one interval, GPM per GPU instance,
and a process on a MIG device holding the parent GPU for the zombie reaper.
"""

from __future__ import annotations

import os

import pytest

from exporter.config.yamlconf import ConfigError
from exporter.exposition.metrics import render
from exporter.sampling.stats import SelfStats
from tests.helpers import one, samples
from tests.test_reaper import CLASSES, audit_lines, counts, make_reaper, start_job

A, B = "MIG-aaaaaaaa-0000-4000-8000-000000000001", "MIG-bbbbbbbb-0000-4000-8000-000000000002"
C = "MIG-cccccccc-0000-4000-8000-000000000003"
#: An H100 split in a 3g.40gb device (one process, SM and tensor activity from GPM) and a
#: 1g.10gb device (two processes); from 10 s on, the 3g.40gb one is re-partitioned as C.
LAYOUT = f"""
gpus:
  - gpm: true
    fields: {{sm_active: 0.5}}
    mig_devices:
      - uuid: {A}
        profile: 3g.40gb
        gpu_instance: 1
        compute_instance: 0
        memory_total: 40GiB
        memory_used: 1GiB
        until: 10s
        fields: {{sm_active: 0.6, tensor_active: 0.3}}
      - {{uuid: {B}, profile: 1g.10gb, gpu_instance: 9, memory_total: 10GiB,
          fields: {{sm_active: 0.2}}}}
      - {{uuid: {C}, profile: 2g.20gb, gpu_instance: 3, memory_total: 20GiB, from: 10s}}
    processes:
      - {{pid: self, memory: 4GiB, mig: {A}, until: 10s}}
      - {{pid: parent, memory: 2GiB, mig: {B}}}
      - {{pid: 1, memory: 1GiB, mig: {B}}}
  - {{}}
"""


def _found(snap):
    return samples(render(snap, SelfStats(interval_seconds=1)))


def test_each_mig_device_is_sampled_with_its_instances_profile_and_memory(
    simulated, collector, clock
):
    driver = simulated(LAYOUT)
    snap = collector.sample()
    gpu = snap.gpus[0]
    devices = {d.uuid: d for d in gpu.mig_devices}
    assert set(devices) == {A, B}
    assert (devices[A].gpu_instance, devices[A].compute_instance, devices[A].profile) == (
        1,
        0,
        "3g.40gb",
    )
    assert devices[A].memory_total_bytes == 40 << 30
    assert devices[A].memory_used_bytes == 5 << 30  # its own 1 GiB and its process's 4
    assert devices[B].memory_used_bytes == 3 << 30
    found = _found(snap)
    info = {s.labels["mig_uuid"]: s.labels for s in found["gpu_mig_info"]}
    assert info[A] == {
        "gpu": "0",
        "uuid": gpu.uuid,
        "mig_uuid": A,
        "gpu_instance": "1",
        "compute_instance": "0",
        "profile": "3g.40gb",
    }
    assert one(found, "gpu_mig_memory_free_bytes", mig_uuid=B) == 7 << 30
    assert {s.labels["gpu"] for s in found["gpu_mig_info"]} == {"0"}  # GPU 1: no MIG
    # processes: listed on the parent, joined to their MIG device by gpu_process_mig_info
    joined = {s.labels["pid"]: s.labels["mig_uuid"] for s in found["gpu_process_mig_info"]}
    assert joined == {str(os.getpid()): A, str(os.getppid()): B, "1": B}
    memory = {s.labels["pid"] for s in found["gpu_process_memory_used_bytes"]}
    assert memory == set(joined)  # no new label on the process series
    # no per-process utilization call in MIG mode: NVML has none
    assert driver.calls["nvmlDeviceGetProcessUtilization"] == 0
    assert driver.calls.get("nvmlDeviceGetProcessesUtilizationInfo", 0) == 0


def test_gpm_per_gpu_instance_and_a_lone_process_gets_its_devices_activity(
    simulated, collector, clock
):
    simulated(LAYOUT)
    first = collector.sample()
    assert all(not d.fields for d in first.gpus[0].mig_devices)  # GPM's first sample
    clock.advance(1)
    snap = collector.sample()
    found = _found(snap)
    assert one(found, "gpu_mig_sm_active_ratio", mig_uuid=A) == pytest.approx(0.6)
    assert one(found, "gpu_mig_tensor_active_ratio", mig_uuid=A) == pytest.approx(0.3)
    assert one(found, "gpu_mig_sm_active_ratio", mig_uuid=B) == pytest.approx(0.2)
    assert one(found, "gpu_sm_active_ratio", gpu="0") == pytest.approx(0.5)  # the whole GPU
    processes = {p.pid: p for p in snap.gpus[0].processes}
    assert processes[os.getpid()].sm_utilization_ratio == pytest.approx(0.6)  # alone on A
    assert processes[os.getppid()].sm_utilization_ratio is None  # B is shared: unknown
    assert processes[1].sm_utilization_ratio is None
    sm = {s.labels["pid"] for s in found["gpu_process_sm_utilization_ratio"]}
    assert sm == {str(os.getpid())}


def test_a_new_layout_is_seen_at_the_next_sample(simulated, collector, clock):
    driver = simulated(LAYOUT)
    collector.sample()
    clock.advance(1)
    collector.sample()
    clock.advance(9)  # 10 s: A is gone, C is there
    snap = collector.sample()
    assert {d.uuid for d in snap.gpus[0].mig_devices} == {B, C}
    assert snap.gpus[0].mig_uuids() == (B, C)
    found = _found(snap)
    assert {s.labels["mig_uuid"] for s in found["gpu_mig_info"]} == {B, C}
    active = found.get("gpu_mig_sm_active_ratio", [])
    assert [s.labels["mig_uuid"] for s in active] == [B]  # C's GPU instance: a first sample
    assert not collector.nvml.incomplete
    clock.advance(1)
    found = _found(collector.sample())
    assert one(found, "gpu_mig_sm_active_ratio", mig_uuid=C) == 0  # the scenario's default
    assert driver.calls["nvmlDeviceGetGpuInstanceId"] == 3  # once per device, A, B and C


def test_a_process_on_an_unknown_mig_device_is_a_scenario_error(simulated):
    with pytest.raises(ConfigError) as raised:
        simulated(f"gpus: [{{mig_devices: [{A}], processes: [{{pid: 1, mig: {B}}}]}}]\n")
    assert "is none of this GPU's mig_devices" in str(raised.value)


def test_an_orphan_on_a_mig_device_holds_the_parent_gpu(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    """The reaper's evidence and descriptors are the parent's: a worker left on a MIG device by
    its dead job leader is an orphan of GPU 0."""
    job = start_job(subreaper, f"{dev}/nvidia0")
    listed = [
        f"{{pid: {job.leader.pid}, memory: 1GiB, until: 1s, mig: {A}}}",
        f"{{pid: {job.worker}, memory: 2GiB, mig: {A}}}",
    ]
    processes = ", ".join(listed)
    simulated(f"gpus:\n  - minor_number: 0\n    mig_devices: [{A}]\n    processes: [{processes}]\n")
    reaper = make_reaper(dev, tmp_path)
    reaper.run([collector.sample()], clock.now)
    job.end()
    clock.advance(1)
    reaper.run([collector.sample()], clock.now)
    clock.advance(60)
    snap = collector.sample()
    reaper.run([snap], clock.now)
    assert counts(reaper) == {**dict.fromkeys(CLASSES, 0), "orphan": 1}
    (worker,) = snap.gpus[0].processes
    assert worker.mig_uuids == (A,)
    assert audit_lines(tmp_path)[0]["pid"] == job.worker


def test_every_mig_metric_is_in_docs_metrics_md(simulated, collector, clock):
    from pathlib import Path

    simulated(LAYOUT)
    collector.sample()
    clock.advance(1)
    names = {n for n in _found(collector.sample()) if "mig" in n}
    doc = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    for name in names:  # GPM's as gpu_mig_* beside their GPU metric's row
        assert f"`{name}`" in doc or f"`gpu_{name[len('gpu_mig_') :]}`" in doc, name
    assert {"gpu_mig_info", "gpu_process_mig_info", "gpu_mig_sm_active_ratio"} <= names


# -- choosing MIG devices: recommend, run and /recommend with mig ----------------------------------

#: An H100 in MIG mode: a 3g.40gb device with a job, a 1g.10gb and a 2g.20gb one free.
MIG_HOST = f"""
gpus:
  - name: NVIDIA H100 80GB HBM3
    mig_devices:
      - {{uuid: {A}, profile: 3g.40gb, gpu_instance: 1, memory_total: 40GiB}}
      - {{uuid: {B}, profile: 1g.10gb, gpu_instance: 9, memory_total: 10GiB}}
      - {{uuid: {C}, profile: 2g.20gb, gpu_instance: 3, memory_total: 20GiB}}
    processes: [{{pid: self, memory: 4GiB, mig: {A}}}]
  - name: NVIDIA A100-SXM4-80GB
"""


def test_recommend_with_mig_chooses_a_free_mig_device_with_enough_memory(simulated, collector):
    from exporter.core.selection import Policy, recommend

    simulated(MIG_HOST)
    snap = collector.sample()
    rec = recommend(Policy("p", mig=True, min_free_memory=15 << 30), [snap])
    assert [c.uuid for c in rec.chosen] == [C]  # the most free memory of those that qualify
    assert rec.indexes[C] == 0  # the parent's index
    assert "not exclusive" in rec.rejected[A]  # a MIG device with a process is taken
    assert "below" in rec.rejected[B]  # 10 GiB
    assert snap.gpus[1].uuid not in rec.rejected and snap.gpus[1].uuid not in rec.scores
    whole = recommend(Policy("p"), [snap], locked={C})
    assert "a MIG device of it is reserved" in whole.rejected[snap.gpus[0].uuid]
    taken = recommend(Policy("p", mig=True), [snap], locked={C})
    assert [c.uuid for c in taken.chosen] == [B] and "reserved" in taken.rejected[C]


def test_run_with_mig_locks_the_mig_device_and_hands_it_to_the_job(tmp_path):
    import subprocess
    import sys

    from exporter.core.locks import held_locks
    from tests.agent import clean_env
    from tests.agent import exporter_cli as cli
    from tests.helpers import until

    scenario, locks = tmp_path / "mig.yaml", tmp_path / "locks"
    scenario.write_text(MIG_HOST)
    locks.mkdir()
    sleeper = (
        "import os, time; print(os.environ['CUDA_VISIBLE_DEVICES'], flush=True); time.sleep(30)"
    )
    args = ("run", "--simulate", str(scenario), "--lock-dir", str(locks), "--mig")
    first = subprocess.Popen(
        [sys.executable, "-m", "exporter", *args, "--", sys.executable, "-c", sleeper],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(TMPDIR=str(tmp_path)),
    )
    try:
        assert first.stdout is not None
        taken = first.stdout.readline().strip()
        assert taken in (B, C)  # a free MIG device, named to CUDA by its UUID
        until(lambda: taken in held_locks(str(locks)), "the MIG device's lock")
        # the next one gets the other free device; then none is left
        second = cli(
            *args,
            "--",
            sys.executable,
            "-c",
            "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])",
        )
        assert second.returncode == 0, second.stderr
        assert second.stdout.strip() == ({B, C} - {taken}).pop()
        recommended = cli(
            "recommend", "--simulate", str(scenario), "--lock-dir", str(locks), "--mig"
        )
        assert recommended.returncode == 0 and recommended.stdout.strip() in (B, C)
    finally:
        first.kill()
        first.wait()


def test_the_agents_recommend_takes_mig(tmp_path):
    import json

    from tests.agent import exporter_cli as cli
    from tests.agent import healthz_until, http_get, serve

    scenario = tmp_path / "mig.yaml"
    scenario.write_text(MIG_HOST)
    with serve(tmp_path, "--simulate", str(scenario)) as (agent, port):
        healthz_until(agent, port)
        status, body = http_get(f"http://127.0.0.1:{port}/recommend?mig=true&min_free_memory=15GiB")
        assert status == 200, body
        assert [c["uuid"] for c in json.loads(body)["chosen"]] == [C]
        status, body = http_get(f"http://127.0.0.1:{port}/recommend?mig=maybe")
        assert status == 400 and "mig" in body
        # run --from: the agent chooses two MIG devices, run checks and locks them here
        locks = tmp_path / "locks"
        locks.mkdir()
        job = ("--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
        url = f"http://127.0.0.1:{port}"
        ran = cli(
            "run",
            "--from",
            url,
            "--simulate",
            str(scenario),
            "--lock-dir",
            str(locks),
            "--mig",
            "--count",
            "2",
            *job,
        )
        assert ran.returncode == 0, ran.stderr
        assert sorted(ran.stdout.strip().split(",")) == sorted([B, C])
        agent.terminate()
        agent.wait(timeout=5)
