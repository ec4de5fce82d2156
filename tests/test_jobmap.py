"""Slurm jobs of the GPUs (exporter/core/jobmap.py, the collector): the job-mapping directory a
prolog writes, in the formats sites use, the one job of a GPU's processes otherwise, and a
directory or file that cannot be used: absent, said once, counted, and sampling goes on."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from exporter.core.jobmap import read_job_dir
from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.core.snapshot import Allocation
from exporter.exposition.metrics import render
from exporter.sampling.collect import Collector
from exporter.sampling.stats import SelfStats
from tests.helpers import samples
from tests.test_procfs import FakeProc

UUID = "GPU-11111111-2222-3333-4444-555555555555"
MIG = "MIG-aaaaaaaa-0000-4000-8000-000000000001"


def _dir(tmp_path: Path, files: dict[str, str | bytes]) -> Path:
    folder = tmp_path / "jobs"
    folder.mkdir()
    for name, text in files.items():
        data = text.encode() if isinstance(text, str) else text
        (folder / name).write_bytes(data)
    return folder


def test_the_formats_sites_write(tmp_path):
    folder = _dir(
        tmp_path,
        {
            "0": "4242 1000\n",  # Princeton's jobstats: "<jobid> <uid>"
            "1": "77\n78\n",  # dcgm-exporter's HPC job mapping: a job a line (a shared GPU)
            UUID: "123_4",  # an array job's task, named by UUID, without a newline
            MIG: "9\n",
            "2": "",  # the job ended, the file not yet removed: no job
            ".3.tmp": "garbage",  # a prolog's file being written
        },
    )
    found = read_job_dir(str(folder))
    assert found.problem == ""
    assert found.jobs == {"0": ("4242",), "1": ("77", "78"), UUID: ("123_4",), MIG: ("9",)}


@pytest.mark.parametrize(
    "content",
    ["job 42\n", "42 1000 extra\n", b"\xff\xfe", "4" * 5000, "42;rm -rf\n"],
    ids=["words", "three-fields", "binary", "too-large", "not-an-id"],
)
def test_a_file_in_no_known_format_is_skipped_and_named(tmp_path, content):
    folder = _dir(tmp_path, {"0": "7\n", "1": content})
    found = read_job_dir(str(folder))
    assert found.jobs == {"0": ("7",)}
    assert found.problem == f"{folder}: not a job-mapping file: 1"


def test_links_and_odd_names_are_not_followed(tmp_path):
    folder = _dir(tmp_path, {"0": "7\n", "notes.txt": "42\n"})
    secret = tmp_path / "secret"
    secret.write_text("1\n")
    (folder / "1").symlink_to(secret)
    (folder / "2").mkdir()
    found = read_job_dir(str(folder))
    assert found.jobs == {"0": ("7",)}
    assert found.problem.endswith("not a job-mapping file: 1, 2, notes.txt")


@pytest.mark.parametrize("kind", ["missing", "file", "link"])
def test_a_directory_that_cannot_be_used_gives_nothing_and_says_why(tmp_path, kind):
    target = tmp_path / "jobs"
    if kind == "file":
        target.write_text("0\n")
    elif kind == "link":
        (tmp_path / "elsewhere").mkdir()
        target = tmp_path / "link"
        target.symlink_to(_dir(tmp_path / "elsewhere", {"0": "7\n"}))
    found = read_job_dir(str(target))
    assert found.jobs == {}
    why = {"missing": "No such file", "file": "not a directory", "link": "symbolic link"}[kind]
    assert why in found.problem, found.problem


# -- in the Snapshot and the metrics ----------------------------------------------------------


def _collector(simulated, clock, proc: Path, jobs: Path | None) -> Collector:
    return Collector(
        Nvml(library=simulated.library),
        ProcFs(str(proc)),
        monotonic=clock,
        slurm_job_dir=str(jobs) if jobs else None,
    )


def _owner_process(fake: FakeProc, pid: int, job: str) -> None:
    cgroup = f"0::/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0\n".encode()
    fake.add(pid, cgroup=cgroup)


def test_gpu_allocation_info_from_the_directory_and_else_from_the_processes(
    simulated, clock, tmp_path
):
    (tmp_path / "proc").mkdir()
    fake = FakeProc(tmp_path / "proc")
    _owner_process(fake, 4001, "77")
    _owner_process(fake, 4002, "77")
    _owner_process(fake, 4003, "78")
    simulated(
        f"""
        gpus:
          - {{}}
          - {{uuid: {UUID}}}
          - processes: [{{pid: 4001}}, {{pid: 4002}}]
          - processes: [{{pid: 4001}}, {{pid: 4003}}]
        """
    )
    jobs = _dir(tmp_path, {"0": "4242 1000\n", UUID: "9\n"})
    collector = _collector(simulated, clock, fake.root, jobs)
    try:
        snap = collector.sample()
    finally:
        collector.close()
    assert [g.allocations for g in snap.gpus] == [
        (Allocation("4242"),),
        (Allocation("9"),),
        (Allocation("77", source="processes"),),  # no file: its processes' one job
        (),  # two jobs' processes: no allocation can be told
    ]
    found = samples(render(snap, SelfStats(5)))["gpu_allocation_info"]
    assert {(s.labels["gpu"], s.labels["slurm_job"], s.labels["mig_uuid"]) for s in found} == {
        ("0", "4242", ""),
        ("1", "9", ""),
        ("2", "77", ""),
    }
    assert set(found[0].labels) == {
        "gpu",
        "uuid",
        "mig_uuid",
        "namespace",
        "pod",
        "container",
        "slurm_job",
    }
    owners = samples(render(snap, SelfStats(5)))["gpu_process_owner_info"]
    assert {(s.labels["gpu"], s.labels["pid"], s.labels["slurm_job"]) for s in owners} == {
        ("2", "4001", "77"),
        ("2", "4002", "77"),
        ("3", "4001", "77"),
        ("3", "4003", "78"),
    }


def test_a_broken_directory_is_counted_said_once_and_sampling_goes_on(
    simulated, clock, tmp_path, caplog
):
    simulated("gpus: [{}]\n")
    missing = tmp_path / "nowhere"
    collector = _collector(simulated, clock, Path("/proc"), missing)
    caplog.set_level(logging.WARNING)
    try:
        for _ in range(3):
            snap = collector.sample()
            assert snap.gpus[0].up and snap.gpus[0].allocations == ()
            assert [(e.source, e.error) for e in snap.errors] == [("slurm", "JobMapping")]
        os.mkdir(missing)  # the prolog made it: read from the next sample on
        (missing / "0").write_text("5\n")
        snap = collector.sample()
    finally:
        collector.close()
    assert snap.errors == () and snap.gpus[0].allocations == (Allocation("5"),)
    said = [r for r in caplog.records if "Slurm job mapping" in r.getMessage()]
    assert len(said) == 1


# -- the shipped prolog/epilog (deploy/slurm/job-mapping.sh) --------------------------------------

SCRIPT = Path(__file__).resolve().parent.parent / "deploy" / "slurm" / "job-mapping.sh"
#: nvidia-smi's answer on a host whose minor numbers are not NVML's indices (index, minor, uuid).
GPUS = [
    (0, 2, "GPU-aaaa0000-0000-4000-8000-000000000000"),
    (1, 0, UUID),
    (2, 1, "GPU-cccc0000-0000-4000-8000-000000000000"),
]


def _script(tmp_path: Path, step: str, job: str, gpus: str, **env: str):
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    rows = "\\n".join(f"{i}, {m}, {u}" for i, m, u in GPUS)
    smi.write_text(
        "#!/bin/sh\n"  # answers --query-gpu=<minor_number|index>,uuid as nvidia-smi does
        f'case "$1" in *minor_number*) col=2 ;; *) col=1 ;; esac\n'
        f'printf "{rows}\\n" | awk -F", " -v c="$col" \'{{print $c ", " $3}}\'\n'
    )
    smi.chmod(0o755)
    return subprocess.run(
        ["sh", str(SCRIPT), step],
        capture_output=True,
        text=True,
        env={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "SLURM_JOB_ID": job,
            "SLURM_JOB_UID": "1000",
            "SLURM_JOB_GPUS": gpus,
            "GPU_EXPORTER_SLURM_JOB_DIR": str(tmp_path / "jobs"),
            **env,
        },
    )


def test_the_prolog_writes_a_file_per_gpu_by_uuid_and_the_epilog_removes_only_its_own(tmp_path):
    ran = _script(tmp_path, "prolog", "4242", "0,2")  # minor numbers 0 and 2
    assert ran.returncode == 0 and ran.stderr == "", ran.stderr
    assert _script(tmp_path, "prolog", "77", "1").returncode == 0
    found = read_job_dir(str(tmp_path / "jobs"))
    assert found.problem == ""
    assert found.jobs == {UUID: ("4242",), GPUS[0][2]: ("4242",), GPUS[2][2]: ("77",)}
    assert _script(tmp_path, "epilog", "4242", "0,2").returncode == 0
    assert read_job_dir(str(tmp_path / "jobs")).jobs == {GPUS[2][2]: ("77",)}


def test_the_prolog_reads_nvml_indices_when_told_and_never_fails_a_job(tmp_path):
    ran = _script(tmp_path, "prolog", "5", "0", GPU_EXPORTER_GPU_NUMBERS="index")
    assert ran.returncode == 0
    assert read_job_dir(str(tmp_path / "jobs")).jobs == {GPUS[0][2]: ("5",)}
    for step, job, gpus, env, said in (
        ("prolog", "6", "9", {}, "GPU 9 (minor number) not found"),
        ("prolog", "", "0", {}, "no usable SLURM_JOB_ID"),
        ("prolog", "7", "0", {"GPU_EXPORTER_GPU_NUMBERS": "pci"}, "must be minor or index"),
        ("prolog", "8", "0", {"NVIDIA_SMI": "false"}, "nvidia-smi failed"),
        ("sideways", "9", "0", {}, "usage"),
    ):
        ran = _script(tmp_path, step, job, gpus, **env)
        assert ran.returncode == 0 and said in ran.stderr, (said, ran.stderr)


def test_a_process_on_a_gpu_its_job_was_not_given_is_found_and_said_once(
    simulated, clock, tmp_path, caplog
):
    (tmp_path / "proc").mkdir()
    fake = FakeProc(tmp_path / "proc")
    _owner_process(fake, 4001, "77")
    _owner_process(fake, 4002, "77")
    _owner_process(fake, 4003, "78")
    _owner_process(fake, 4004, "79")
    simulated(
        """
        gpus:
          - processes: [{pid: 4001}, {pid: 4003}]
          - processes: [{pid: 4002}]
          - processes: [{pid: 4004}]
        """
    )
    jobs = _dir(tmp_path, {"0": "77 1000\n"})
    collector = _collector(simulated, clock, fake.root, jobs)
    caplog.set_level(logging.WARNING)
    try:
        for _ in range(2):
            snap = collector.sample()
    finally:
        collector.close()
    outside = {(g.index, p.pid) for g in snap.gpus for p in g.processes if p.outside_allocation}
    # 77 was given GPU 0 only; 78 nothing, on 77's GPU; 79 nothing, on a GPU no file names
    assert outside == {(1, 4002), (0, 4003)}
    found = samples(render(snap, SelfStats(5)))["gpu_processes_outside_allocation"]
    assert {s.labels["gpu"]: s.value for s in found} == {"0": 1, "1": 1, "2": 0}
    said = [r.getMessage() for r in caplog.records if "was not given" in r.getMessage()]
    assert sorted(said) == [
        f"process 4002 (python3) runs on GPU 1 ({snap.gpus[1].uuid}), which its job 77 was not "
        "given",
        f"process 4003 (python3) runs on GPU 0 ({snap.gpus[0].uuid}), which its job 78 was not "
        "given",
    ]


def test_without_a_job_mapping_directory_nothing_is_judged(simulated, clock, tmp_path):
    (tmp_path / "proc").mkdir()
    fake = FakeProc(tmp_path / "proc")
    _owner_process(fake, 4001, "77")
    simulated("gpus: [{processes: [{pid: 4001}]}, {}]\n")
    collector = _collector(simulated, clock, fake.root, None)
    try:
        snap = collector.sample()
    finally:
        collector.close()
    assert not snap.gpus[0].allocations_known and not snap.gpus[0].processes[0].outside_allocation
    assert "gpu_processes_outside_allocation" not in samples(render(snap, SelfStats(5)))
