"""The ``status`` table: free memory, launcher-lock holders, Python jobs by script, no GPUs; and
read-only commands leave the lock directory as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from exporter.core.procfs import ProcFs, python_script
from exporter.core.snapshot import (
    Allocation,
    Gpu,
    GpuInfo,
    GpuProcess,
    HostInfo,
    LinkReadings,
    Snapshot,
)
from exporter.status import format_status
from tests.agent import exporter_cli
from tests.helpers import until


@pytest.mark.parametrize(
    ("cmdline", "script"),
    [
        (("python3", "train.py", "--lr", "3e-4"), "train.py"),
        (("/usr/bin/python3.11", "-u", "/home/me/jobs/train.py"), "train.py"),
        (("python", "-X", "dev", "-W", "ignore", "run.py"), "run.py"),
        (
            ("python3", "-m", "torch.distributed.run", "--nproc-per-node", "8"),
            "torch.distributed.run",
        ),
        (("python3", "-c", "import time; time.sleep(9)", "train.py"), ""),
        (("python3",), ""),
        (("bash", "train.py"), ""),
        ((), ""),
    ],
)
def test_the_script_of_a_python_process(cmdline, script):
    assert python_script(cmdline) == script


def snapshot(*gpus: Gpu) -> Snapshot:
    return Snapshot(1, 1.7e9, 1.0, 0.01, True, HostInfo("host", "550.54.15", "12.4"), gpus)


def gpu(**values) -> Gpu:
    info = GpuInfo(0, "GPU-0", "NVIDIA A100-SXM4-40GB", memory_total_bytes=40 << 30)
    return Gpu(
        0, "GPU-0", True, info, memory_used_bytes=8 << 30, memory_free_bytes=31 << 30, **values
    )


def test_status_shows_free_memory_the_lock_holder_and_the_script():
    proc = GpuProcess(42, "compute", 8 << 30, True, name="python3", user="alice", script="train.py")
    text = format_status(snapshot(gpu(processes=(proc,), reserved_by=4242, reserved_by_user="bob")))
    assert "FREE" in text and "31.0GiB" in text
    assert "reserved by a launcher lock: bob (pid 4242)" in text
    assert "python3 train.py" in text
    exposed = replace(proc, cmdline=("python3", "train.py", "--token", "x"))
    assert "--token" in format_status(snapshot(gpu(processes=(exposed,))))  # only when exposed


def test_status_names_who_holds_each_gpu_and_process():
    trainer = GpuProcess(
        42,
        "compute",
        1 << 30,
        True,
        name="python3",
        namespace="ml",
        pod="train-0",
        container="trainer",
    )
    stray = GpuProcess(
        43,
        "compute",
        1 << 30,
        True,
        name="python3",
        slurm_job="77",
        slurm_step="batch",
        outside_allocation=True,
    )
    allocations = (
        Allocation(source="kubelet", namespace="ml", pod="train-0", container="trainer"),
        Allocation("78", mig_uuid="MIG-1"),
    )
    text = format_status(snapshot(gpu(processes=(trainer, stray), allocations=allocations)))
    assert "allocated to pod ml/train-0 (trainer), job 78 on MIG-1" in text
    assert "python3  [pod ml/train-0 (trainer)]" in text
    assert "python3  [job 77.batch, OUTSIDE ITS ALLOCATION]" in text


def test_status_shows_memory_no_listed_process_holds():
    proc = GpuProcess(42, "compute", 1 << 30, True, name="python3")
    text = format_status(snapshot(gpu(processes=(proc,))))  # 8 GiB used, 1 GiB listed
    assert "7.0GiB of used memory held by no listed process" in text
    small = replace(gpu(processes=(proc,)), memory_used_bytes=(1 << 30) + (1 << 29))
    assert "held by no listed process" not in format_status(snapshot(small))


def test_status_with_no_gpus_says_so():
    assert "no GPUs: the driver answers but lists none" in format_status(snapshot())


def test_a_python_job_is_named_by_its_script_in_the_snapshot(tmp_path, simulated, collector):
    script = tmp_path / "train.py"
    script.write_text("import time\ntime.sleep(60)\n")
    job = subprocess.Popen([sys.executable, str(script), "--secret", "s3cr3t"])
    try:
        # until it has exec'd: before, its command line is still this process's
        until(lambda: str(script).encode() in Path(f"/proc/{job.pid}/cmdline").read_bytes())
        simulated(f"gpus:\n  - processes: [{{pid: {job.pid}, memory: 1GiB}}]\n")
        (found,) = collector.sample().gpus[0].processes
        assert found.script == "train.py" and found.cmdline == ()  # no argument leaks
        assert ProcFs().process(job.pid).script == "train.py"
    finally:
        job.kill()
        job.wait()


@pytest.mark.parametrize(
    "command",
    [("status", "--simulate"), ("recommend", "--simulate"), ("status", "--simulate", "--json")],
    ids=" ".join,
)
def test_read_only_commands_write_nothing_in_the_lock_directory(tmp_path, command):
    locks = tmp_path / "locks"
    locks.mkdir(mode=0o755)
    done = exporter_cli(*command, "--lock-dir", str(locks))
    assert done.returncode == 0, done.stderr
    assert os.listdir(locks) == []


def test_run_refuses_an_unsafe_lock_directory_and_leaves_it_as_it_was(tmp_path):
    locks = tmp_path / "open"
    locks.mkdir()
    os.chmod(locks, 0o777)  # world-writable, not sticky
    done = exporter_cli("run", "--simulate", "--lock-dir", str(locks), "--", "true")
    assert done.returncode == 1 and "lock" in done.stderr, done.stderr
    assert os.listdir(locks) == []


def test_the_health_column_names_what_needs_attention():
    from exporter.core.xid import XidEvent
    from exporter.status import health_notes

    now = 1.7e9
    old = XidEvent(now - 4000, 13, "restart_app")
    recent = (XidEvent(now - 60, 79, "reboot"), XidEvent(now - 30, 48, "reset_gpu"))
    info = GpuInfo(0, "GPU-0", "NVIDIA H100", fields={"pcie_link_width_max": 16})
    sick = replace(
        gpu(),
        info=info,
        xids=(old, *recent),
        fields={"row_remap_pending": 1, "recovery_action": 1, "pcie_link_width": 8},
        nvlink=LinkReadings({0: {"nvlink_up": 1}, 1: {"nvlink_up": 0}}),
        uuid="GPU-1",
    )
    assert health_notes(sick, now) == [
        "XID 48,79 (2/1h)",
        "remap pending",
        "needs gpu_reset",
        "PCIe x8/x16",
        "NVLink 1/2 down",
    ]
    failed = replace(gpu(), fields={"row_remap_pending": 1, "row_remap_failed": 1})
    assert health_notes(failed, now) == ["remap failed"]
    text = format_status(Snapshot(1, now, 1.0, 0.01, True, HostInfo("h"), (gpu(), sick)))
    header, healthy, unhealthy = text.splitlines()[1:4]
    assert header.endswith("HEALTH") and healthy.endswith(" ok")
    # the verdict one Snapshot supports leads: remap pending and the recovery action are
    # critical (the link that is down was never seen up by a one-shot status)
    assert "CRITICAL XID 48,79 (2/1h), remap pending" in unhealthy
    assert unhealthy.endswith("NVLink 1/2 down")
