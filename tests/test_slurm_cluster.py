"""gpu-exporter beside a real one-node Slurm cluster on loopback (tests/slurm.py): each GPU
process is attributed to its Slurm job from its real cgroup, and the shipped prolog and epilog
(deploy/slurm/job-mapping.sh) name each GPU's job while the job lasts.

Real: munged, slurmctld, slurmd and slurmstepd (Debian's Slurm), the jobs and their processes,
the cgroup (v1) proctrack/cgroup puts each in, the prolog and epilog as Slurm runs them, and the
agent (``gpu-exporter serve``) reading the processes from /proc. Simulated: the GPUs. NVML is
the simulated driver, which lists on a GPU every process that holds the GPU's stand-in device
file open (``holders: true``), as the real driver lists a CUDA process; nvidia-smi, which the
prolog asks for the GPUs' minor numbers and UUIDs, is a script that prints the scenario's.

The stand-ins ``nvidia0``..``nvidia3`` are the GPUs of Slurm's gres.conf too, and Slurm takes
only character devices: four harmless ones, /dev/null's, /dev/zero's, /dev/full's and
/dev/urandom's numbers. Four different ones, because the simulated driver tells a device file by
its device number (core.procfs.file_identity): four nodes of one device would be one GPU. The
GPUs' minor numbers (which SLURM_JOB_GPUS numbers, by the nvidiaN files of gres.conf) are not
their NVML indices, as on a host whose PCI order differs: the prolog has to go by UUID.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.agent import healthz_until, http_get, serve, stderr_of
from tests.helpers import one, samples, until
from tests.slurm import Cluster, ClusterDown, unusable

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
JOB_MAPPING = ROOT / "deploy" / "slurm" / "job-mapping.sh"
#: The GPUs in NVML's (index) order: (minor number, UUID).
GPUS = [
    (2, "GPU-5100a000-0000-4000-8000-000000000002"),
    (0, "GPU-5100a000-0000-4000-8000-000000000000"),
    (3, "GPU-5100a000-0000-4000-8000-000000000003"),
    (1, "GPU-5100a000-0000-4000-8000-000000000001"),
]
INDEX = {minor: index for index, (minor, _) in enumerate(GPUS)}
UUID = dict(GPUS)
MINOR = {uuid: minor for minor, uuid in GPUS}
#: The character device behind each stand-in, by minor number: null, zero, full, urandom.
DEVICES = {0: (1, 3), 1: (1, 5), 2: (1, 7), 3: (1, 9)}
#: A job's process: it opens the stand-ins of its job's GPUs (SLURM_JOB_GPUS), or with
#: ``other`` the first that is neither its job's nor one of the numbers after it; says what it
#: did, and holds them.
HOLD = """\
import json, os, sys, time
dev, mode, avoid = sys.argv[1], sys.argv[2], {int(n) for n in sys.argv[3:]}
own = [int(n) for n in os.environ.get("SLURM_JOB_GPUS", "").split(",") if n]
if mode == "own":
    opened = own
else:
    opened = [next(n for n in range(4) if n not in own and n not in avoid)]
held = [open(os.path.join(dev, "nvidia%d" % n), "rb") for n in opened]
print(json.dumps({"pid": os.getpid(), "gpus": own, "opened": opened,
                  "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}), flush=True)
time.sleep(600)
"""


@dataclass
class Site:
    """The cluster, the agent beside it on the same (simulated) GPUs, and their files."""

    cluster: Cluster
    agent: Any  # subprocess.Popen[str]
    port: int
    dev: Path  # the stand-ins nvidia0..3
    job_dir: Path  # the prolog's job-mapping directory, the agent's --slurm-job-dir
    hold: Path  # HOLD

    def snapshot(self) -> dict[str, Any]:
        status, body = http_get(f"http://127.0.0.1:{self.port}/snapshot")
        assert status == 200, (status, body)
        return json.loads(body)

    def metrics(self) -> dict[str, list[Any]]:
        status, body = http_get(f"http://127.0.0.1:{self.port}/metrics")
        assert status == 200, (status, body)
        return samples(body.encode())

    def mapping(self) -> dict[str, str]:
        """The job-mapping directory: file name -> content."""
        return {path.name: path.read_text() for path in sorted(self.job_dir.iterdir())}

    def diagnosis(self) -> str:
        """What helps when a wait times out: jobs, mapping files, the jobs' outputs, logs."""
        jobs = self.cluster.run("squeue", check=False).stdout
        outputs = {p.name: p.read_text()[-2000:] for p in self.cluster.root.glob("job-*.out")}
        agent = stderr_of(self.agent)[-3000:]
        return (
            f"squeue:\n{jobs}\nmapping: {self.mapping()}\noutputs: {outputs}\n"
            f"agent:\n{agent}\n{self.cluster.logs()}"
        )

    def wait(self, check: Callable[[], Any], what: str, timeout: float = 20) -> Any:
        """:func:`until`, with the diagnosis when it times out."""
        try:
            return until(check, what, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnosis()}") from None

    def said(self, job: str) -> dict[str, Any]:
        """The JSON line a HOLD job prints once it holds its stand-ins."""

        def line() -> dict[str, Any] | None:
            for text in self.cluster.output(job).splitlines():
                if text.startswith("{"):
                    return json.loads(text)
            return None

        return self.wait(line, f"job {job} to hold its GPUs", timeout=30)

    def hold_job(self, name: str, gpus: int, *args: str) -> tuple[str, dict[str, Any]]:
        """A HOLD job (``args``: its mode and numbers) on ``gpus`` GPUs, started; (id, said)."""
        command = shlex.join([sys.executable, str(self.hold), str(self.dev), *args])
        job = self.cluster.submit(f"--job-name={name}", f"--gres=gpu:{gpus}", "--wrap", command)
        return job, self.said(job)

    def cancel(self, job: str) -> None:
        """scancel ``job``; wait until Slurm has forgotten it and its mapping files are gone."""
        if self.cluster.stopped:
            return
        self.cluster.run("scancel", job)
        self.wait(lambda: job not in self.cluster.jobs(), f"job {job} to end")
        self.wait(lambda: not self.files_of(job), f"the epilog to remove job {job}'s files")

    def files_of(self, job: str) -> list[str]:
        """The mapping files that name ``job``."""
        return [name for name, text in self.mapping().items() if text.split()[:1] == [job]]


def _on(snap: dict[str, Any], pid: int) -> dict[str, dict[str, Any]]:
    """UUID -> the process entry of ``pid`` on each GPU the Snapshot lists it on."""
    return {
        gpu["uuid"]: proc
        for gpu in snap["gpus"]
        for proc in gpu["processes"] or ()
        if proc["pid"] == pid
    }


def _gpu(snap: dict[str, Any], uuid: str) -> dict[str, Any]:
    (gpu,) = [g for g in snap["gpus"] if g["uuid"] == uuid]
    return gpu


def _allocations(gpu: dict[str, Any]) -> list[tuple[str, str]]:
    """(job, source) of each allocation of the whole GPU."""
    return [(a["slurm_job"], a["source"]) for a in gpu["allocations"] if a["mig_uuid"] == ""]


def _stand_ins(dev: Path) -> list[Path]:
    dev.mkdir()
    paths = []
    for minor, (major, number) in DEVICES.items():
        path = dev / f"nvidia{minor}"
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, number))
        path.chmod(0o666)  # past the umask
        paths.append(path)
    try:
        for path in paths:
            with path.open("rb"):
                pass
    except OSError as exc:
        pytest.skip(f"device nodes made in {dev} cannot be opened (a nodev mount?): {exc}")
    return paths


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """The cluster and the agent, started once for the module; at the end every job cancelled,
    the daemons and the agent stopped, and nothing of theirs may be left running."""
    why = unusable()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    dev = root / "dev"
    stand_ins = _stand_ins(dev)
    job_dir = root / "jobs"
    job_dir.mkdir()
    hooks = root / "hooks"
    hooks.mkdir()
    cluster = Cluster(root / "cluster", stand_ins, hooks / "prolog", hooks / "epilog")
    smi = _script(
        hooks / "nvidia-smi",
        "#!/bin/sh\n# the simulated GPUs, as nvidia-smi answers the prolog's question\n"
        'case "$*" in *--query-gpu=minor_number,uuid*) ;; *) echo "not faked: $*" >&2; exit 2;; '
        "esac\n" + "".join(f"echo '{minor}, {uuid}'\n" for minor, uuid in GPUS),
    )
    for step in ("prolog", "epilog"):  # Slurm's Prolog= and Epilog= take a program, no settings
        _script(
            hooks / step,
            "#!/bin/sh\n"
            f"export GPU_EXPORTER_SLURM_JOB_DIR={job_dir} NVIDIA_SMI={smi}\n"
            f"exec /bin/sh {JOB_MAPPING} {step} 2>>{cluster.logs_dir}/{step}.log\n",
        )
    scenario = root / "scenario.yaml"
    scenario.write_text(
        f"driver: {{device_folder: {dev}}}\ngpus:\n"
        + "".join(
            f"  - {{uuid: {uuid}, minor_number: {minor}, "
            "processes: [{holders: true, memory: 1GiB}]}\n"
            for minor, uuid in GPUS
        )
    )
    (root / "locks").mkdir()
    down = ""
    try:
        cluster.start()  # stops what it started when the node does not come up
    except ClusterDown as exc:
        down = str(exc)
    if down:  # root, with the packages: a cluster that does not come up is a failure
        pytest.fail(down, pytrace=False)
    try:
        agent_args = ["--simulate", str(scenario), "--slurm-job-dir", str(job_dir)]
        agent_args += ["--interval", "0.25", "--lock-dir", str(root / "locks")]
        with serve(root, *agent_args) as (agent, port):
            healthz_until(agent, port)
            yield Site(cluster, agent, port, dev, job_dir, _script(root / "hold.py", HOLD))
            cluster.stop()  # before the agent
    finally:
        left = cluster.stop()  # the same answer, or the first stop: the agent did not start
    assert left == [], f"left running after the cluster stopped: {left}"


@pytest.fixture(scope="module")
def job_a(site: Site) -> Iterator[tuple[str, dict[str, Any]]]:
    """Job A: two GPUs, a process that holds both; (its id, what it said). It lasts the module:
    job C runs beside it."""
    job, said = site.hold_job("a", 2, "own")
    yield job, said
    with contextlib.suppress(AssertionError):  # the module's end cancels it anyway
        site.cancel(job)


def test_a_jobs_process_is_attributed_to_it_from_its_cgroup(
    site: Site, job_a: tuple[str, dict[str, Any]]
) -> None:
    job, said = job_a
    pid, minors = said["pid"], said["gpus"]
    assert len(minors) == 2 and said["opened"] == minors, said
    # ConstrainDevices=no: the job's devices are not renumbered, CUDA sees Slurm's numbers
    assert said["cuda_visible_devices"] == ",".join(map(str, minors)), said
    cgroups = dict(
        line.split(":", 2)[1:] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    )
    freezer = rf"/slurm(_{re.escape(site.cluster.node)})?/uid_0/job_{job}/step_batch"
    assert re.fullmatch(freezer, cgroups["freezer"]), cgroups
    wanted = {UUID[minor] for minor in minors}
    files = {name: site.mapping()[name] for name in site.files_of(job)}
    assert files == {uuid: f"{job} 0\n" for uuid in wanted}  # "<jobid> <uid>"

    def attributed() -> dict[str, Any] | None:
        snap = site.snapshot()
        on = _on(snap, pid)
        if set(on) == wanted and all(p["slurm_job"] == job for p in on.values()):
            return snap
        return None

    snap = site.wait(attributed, f"the agent to list job {job}'s process {pid} on {wanted}")
    for uuid, proc in _on(snap, pid).items():
        assert (proc["slurm_step"], proc["uid"]) == ("batch", 0), proc
        assert _allocations(_gpu(snap, uuid)) == [(job, "job_dir")]
    found = site.metrics()
    owners = {
        (s.labels["gpu"], s.labels["uuid"], s.labels["slurm_job"])
        for s in found["gpu_process_owner_info"]
        if s.labels["pid"] == str(pid)
    }
    assert owners == {(str(INDEX[MINOR[uuid]]), uuid, job) for uuid in wanted}
    for uuid in wanted:
        assert one(found, "gpu_allocation_info", gpu=str(INDEX[MINOR[uuid]]), slurm_job=job) == 1


def test_the_prolog_names_the_job_of_a_gpu_without_a_process_and_the_epilog_removes_it(
    site: Site,
) -> None:
    job = site.cluster.submit(
        "--job-name=b", "--gres=gpu:1", "--wrap", "echo SLURM_JOB_GPUS=$SLURM_JOB_GPUS; sleep 300"
    )
    (uuid,) = site.wait(lambda: site.files_of(job), f"the prolog's file for job {job}")
    assert site.mapping()[uuid] == f"{job} 0\n"
    minor = MINOR[uuid]
    site.wait(lambda: f"SLURM_JOB_GPUS={minor}\n" in site.cluster.output(job), "job B to start")

    def allocated() -> dict[str, Any] | None:
        gpu = _gpu(site.snapshot(), uuid)
        return gpu if gpu["allocations"] else None

    gpu = site.wait(allocated, f"GPU {uuid} allocated")
    assert _allocations(gpu) == [(job, "job_dir")]
    assert gpu["processes"] == []  # the job is known before any process of it uses the GPU
    series = [s.labels for s in site.metrics()["gpu_allocation_info"] if s.labels["uuid"] == uuid]
    assert [(s["gpu"], s["slurm_job"]) for s in series] == [(str(INDEX[minor]), job)]

    site.cancel(job)  # waits until its file is gone

    def forgotten() -> bool:
        found = site.metrics().get("gpu_allocation_info", [])
        return all(s.labels["slurm_job"] != job for s in found)

    site.wait(forgotten, f"gpu_allocation_info of job {job} to go")
    assert _gpu(site.snapshot(), uuid)["allocations"] == []


def test_a_process_on_a_gpu_its_job_was_not_given_is_outside_its_allocation(
    site: Site, job_a: tuple[str, dict[str, Any]]
) -> None:
    a_job, a_said = job_a
    job, said = site.hold_job("c", 1, "other", *map(str, a_said["gpus"]))
    try:
        pid, (other,) = said["pid"], said["opened"]
        assert len(said["gpus"]) == 1 and other not in said["gpus"] + a_said["gpus"], said
        uuid = UUID[other]  # no job's GPU: the agent sees C's process there, and only there

        def seen() -> dict[str, Any] | None:
            snap = site.snapshot()
            on = _on(snap, pid)
            return snap if set(on) == {uuid} and on[uuid]["slurm_job"] == job else None

        site.wait(seen, f"job {job}'s process {pid} on GPU {uuid}")

        def flagged() -> dict[str, Any] | None:
            snap = site.snapshot()
            return snap if _on(snap, pid)[uuid].get("outside_allocation") is True else None

        snap = site.wait(flagged, f"process {pid} of job {job} outside its allocation", 5)
        for proc in _on(snap, a_said["pid"]).values():  # job A's, on its own GPUs: not flagged
            assert proc["slurm_job"] == a_job and proc["outside_allocation"] is False, proc
        found = site.metrics()
        assert one(found, "gpu_processes_outside_allocation", gpu=str(INDEX[other]), uuid=uuid) == 1
    finally:
        site.cancel(job)


def test_the_cluster_stops_leaving_nothing_running(site: Site) -> None:
    left = site.cluster.stop()  # cancels the jobs still running (job A), stops the daemons
    assert left == [], left
    assert all(proc.returncode is not None for _, proc in site.cluster.daemons)
    assert site.mapping() == {}  # the epilog of each job removed its files
    for step in ("prolog", "epilog"):  # and neither complained of anything
        log = site.cluster.logs_dir / f"{step}.log"
        assert not log.exists() or log.read_text() == "", log.read_text()
