"""The zombie reaper with real processes that the test starts and reaps.

An orphan is made for real: a job leader in its own session starts a worker that opens a fake
device node (``<tmp>/dev/nvidia0``), then the leader exits. The test process is a child
subreaper, so the orphaned worker becomes its child and the test reaps it.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, replace

import pytest

from exporter.actions.audit import AuditLog
from exporter.actions.reaper import CLASSES, ReaperConfig, ZombieReaper, parse_reaper
from exporter.config.yamlconf import ConfigError, parse_document
from exporter.core.findings import Findings, ZombieHolders
from exporter.core.procfs import ProcFs

BASE = 1.7e9  # the collector fixture's wall clock is BASE + the fake clock


@dataclass
class Job:
    """A GPU job for real: a leader in its own session that holds the device (as a CUDA process
    holds ``/dev/nvidiaN``) and a worker it started that holds it too. ``end()`` makes the
    leader exit, leaving the worker behind: an orphan once the reaper has seen both."""

    leader: subprocess.Popen
    worker: int

    def listed(self, memory: str = "2GiB") -> list[str]:
        """The scenario's NVML entries: the leader until 1 s of scenario time, the worker."""
        return [f"{{pid: {self.leader.pid}, memory: 1GiB, until: 1s}}", self.entry(memory)]

    def entry(self, memory: str = "2GiB") -> str:
        return f"{{pid: {self.worker}, memory: {memory}}}"

    def end(self) -> None:
        self.leader.stdin.close()
        self.leader.wait()


def start_job(
    pids: list[int],
    device: str | None,
    ignore_term: bool = False,
    also: str | None = None,
    setup: str = "",
) -> Job:
    """A :class:`Job` whose worker holds ``device`` (and the file ``also``) open, having run
    the Python statement ``setup``."""
    hold = f"f = open({device!r})" if device else "pass"
    if also:
        hold += f"; g = open({also!r})"
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_term else "pass"
    worker = (
        f"import os, signal, time; {hold}; {ignore}; {setup or 'pass'}; "
        "print('ready', flush=True); time.sleep(60)"
    )
    leader = (
        "import os, subprocess, sys\n"
        f"d = open({device!r}) if {device!r} else None\n"
        f"w = subprocess.Popen([sys.executable, '-c', {worker!r}], stdout=subprocess.PIPE)\n"
        "w.stdout.readline()\n"
        "print(w.pid, flush=True)\n"
        "sys.stdin.read()\n"  # until the test ends the job
        "os._exit(0)\n"
    )
    job = subprocess.Popen(
        [sys.executable, "-c", leader],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    made = Job(job, int(job.stdout.readline()))
    pids.extend((made.worker, job.pid))
    return made


def orphan_worker(
    pids: list[int], device: str | None, ignore_term: bool = False, also: str | None = None
) -> int:
    """A worker whose job leader (its group and session leader) has exited, never having been
    seen on a GPU: a detached job, not an orphan on any evidence."""
    job = start_job(pids, device, ignore_term, also)
    job.end()
    return job.worker


def alive(pid: int) -> bool:
    info = ProcFs().process(pid)
    return info is not None and info.state != "Z"


def wait_exited(pid: int) -> None:
    deadline = time.monotonic() + 5
    while alive(pid):
        assert time.monotonic() < deadline, f"{pid} did not exit"
        time.sleep(0.01)


def scenario(*gpus: list[str]) -> str:
    lines = ["gpus:"]
    for minor, processes in enumerate(gpus):
        lines.append(f"  - minor_number: {minor}")
        lines.append("    memory_used: 0")
        lines.append(f"    processes: [{', '.join(processes)}]")
    return "\n".join(lines) + "\n"


def make_reaper(dev: str, tmp_path, **options) -> ZombieReaper:
    config = replace(
        ReaperConfig(protect_users=("nobody",)), audit_log=str(tmp_path / "audit.jsonl"), **options
    )
    return ZombieReaper(config, ProcFs(), dev)


def audit_lines(tmp_path) -> list[dict]:
    path = tmp_path / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def counts(reaper: ZombieReaper, gpu: str = "0") -> dict[str, float]:
    zombies = next(f for f in reaper.families() if f.name == "gpu_zombie_processes")
    return {s.labels["class"]: s.value for s in zombies.samples if s.labels["gpu"] == gpu}


def orphaned(reapers, collector, clock, *jobs: Job, age: float = 60) -> None:
    """Runs that make ``jobs``' workers orphans on the reapers' own evidence: one run sees each
    leader on the GPU, the leaders exit, the next run sees that, and one ``age`` seconds later
    (in a new Snapshot) decides. ``reapers``: one reaper or a tuple, run in turn each time."""
    reapers = reapers if isinstance(reapers, tuple) else (reapers,)

    def run_all() -> None:
        snapshot = collector.sample()
        for reaper in reapers:
            reaper.run([snapshot], clock.now)

    run_all()
    for job in jobs:
        job.end()
    clock.advance(1)
    run_all()
    clock.advance(age)
    run_all()


def run_twice(reaper, collector, clock, age: float = 60) -> None:
    """Two runs, ``age`` seconds and one Snapshot apart."""
    reaper.run([collector.sample()], clock.now)
    clock.advance(age)
    reaper.run([collector.sample()], clock.now)


def test_orphan_found_and_left_alone_in_dry_run(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0")
    pid = job.worker
    simulated(scenario(job.listed(), []))
    reaper = make_reaper(dev, tmp_path)
    reaper.run([collector.sample()], clock.now)  # the leader is seen on the GPU
    job.end()
    clock.advance(1)
    reaper.run([collector.sample()], clock.now)
    assert counts(reaper)["orphan"] == 0  # its job has just ended: not yet
    clock.advance(30)
    reaper.run([collector.sample()], clock.now)
    assert counts(reaper)["orphan"] == 0  # min_age not reached
    clock.advance(30)
    reaper.run([collector.sample()], clock.now)
    assert counts(reaper) == {**dict.fromkeys(CLASSES, 0), "orphan": 1}
    why = audit_lines(tmp_path)[0]["why"]
    assert f"its job's process {job.leader.pid} (parent) held this GPU" in why
    assert counts(reaper, "1") == dict.fromkeys(CLASSES, 0)
    assert alive(pid)
    events = [(e["event"], e.get("reason")) for e in audit_lines(tmp_path)]
    assert events == [("found", None), ("skipped", "dry_run")]
    first = audit_lines(tmp_path)[0]
    assert first["pid"] == pid and first["class"] == "orphan" and first["gpu"] == 0
    assert first["dry_run"] is True and first["action"] == "zombie_reaper"
    reaper.run([collector.sample()], clock.now + 5)  # decisions are written once
    assert len(audit_lines(tmp_path)) == 2
    assert reaper.actions_total[("skip", "dry_run")] == 2


def test_orphan_terminated_when_not_dry_run(simulated, collector, clock, dev, tmp_path, subreaper):
    job = start_job(subreaper, f"{dev}/nvidia0")
    pid = job.worker
    simulated(scenario([job.listed()[0], f"{{pid: {pid}, memory: 2GiB, until: 62s}}"]))
    reaper = make_reaper(dev, tmp_path, dry_run=False)
    orphaned(reaper, collector, clock, job)
    wait_exited(pid)
    clock.advance(1)
    reaper.run([collector.sample()], clock.now)  # sees it exited; NVML lists it no more
    clock.advance(1)
    reaper.run([collector.sample()], clock.now)
    clock.advance(60)
    reaper.run([collector.sample()], clock.now)  # nothing new to say about it
    events = [e["event"] for e in audit_lines(tmp_path)]
    assert events == ["found", "signalling", "exited", "memory_released"], events
    assert audit_lines(tmp_path)[1]["signal"] == "SIGTERM"
    assert reaper.actions_total[("signal", "sigterm")] == 1
    assert reaper.actions_total[("confirm", "memory_released")] == 1


def test_sigkill_after_grace_then_unkillable_is_reported(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0", ignore_term=True)
    pid = job.worker
    simulated(scenario(job.listed()))
    reaper = make_reaper(dev, tmp_path, dry_run=False, grace_period=10)
    orphaned(reaper, collector, clock, job)
    assert reaper.actions_total[("signal", "sigterm")] == 1
    assert alive(pid)  # it ignores SIGTERM (delivered, and ignored, at once)
    clock.advance(5)
    reaper.run([collector.sample()], clock.now)
    assert alive(pid)  # grace period not over
    clock.advance(5)
    reaper.run([collector.sample()], clock.now)
    wait_exited(pid)
    clock.advance(1)
    reaper.run([collector.sample()], clock.now)
    events = [(e["event"], e.get("signal")) for e in audit_lines(tmp_path)]
    assert events[:4] == [
        ("found", None),
        ("signalling", "SIGTERM"),
        ("signalling", "SIGKILL"),
        ("exited", None),
    ]


def test_unkillable_after_kill_timeout(simulated, collector, clock, dev, tmp_path, subreaper):
    job = start_job(subreaper, f"{dev}/nvidia0", ignore_term=True)
    simulated(scenario(job.listed()))
    # SIGKILL cannot end a process stuck in the kernel (D state); no test can make one, so the
    # exit check is what is held back here: its pidfd never becomes readable.
    config = replace(
        ReaperConfig(protect_users=("nobody",)),
        dry_run=False,
        grace_period=0,
        kill_timeout=60,
        audit_log=str(tmp_path / "audit.jsonl"),
    )
    reaper = ZombieReaper(config, ProcFs(), dev, exited=lambda fd: False)
    orphaned(reaper, collector, clock, job)
    clock.advance(1)
    reaper.run([collector.sample()], clock.now)  # SIGKILL
    clock.advance(60)
    reaper.run([collector.sample()], clock.now)
    events = [e["event"] for e in audit_lines(tmp_path)]
    assert events[:4] == ["found", "signalling", "signalling", "unkillable"], events
    assert reaper.actions_total[("signal", "unkillable")] == 1
    signals = reaper.actions_total[("signal", "sigterm")]
    clock.advance(60)
    reaper.run([collector.sample()], clock.now)
    assert reaper.actions_total[("signal", "sigterm")] == signals  # given up: not signalled again


def test_protected_processes_are_never_signalled(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0")
    pid = job.worker
    simulated(scenario(job.listed()))
    name = ProcFs().process(pid).name
    reaper = make_reaper(dev, tmp_path, dry_run=False, protect_names=("nvidia-*", f"{name[:3]}*"))
    user_reaper = make_reaper(dev, tmp_path, dry_run=False)
    user_reaper.reconfigure(replace(user_reaper.config, protect_users=(str(os.getuid()),)))
    orphaned((reaper, user_reaper), collector, clock, job)
    assert alive(pid) and counts(reaper)["orphan"] == 1
    reasons = [e.get("reason") for e in audit_lines(tmp_path)]
    assert reasons == [None, "protected_name", None, "protected_user"]
    assert user_reaper.actions_total[("skip", "protected_user")] == 1


def test_a_job_holding_a_launcher_lock_is_never_signalled(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / "GPU-some-gpu.lock").write_text("")
    job = start_job(subreaper, f"{dev}/nvidia0", also=str(locks / "GPU-some-gpu.lock"))
    simulated(scenario(job.listed()))
    config = replace(
        ReaperConfig(protect_users=()), dry_run=False, audit_log=str(tmp_path / "audit.jsonl")
    )
    locked = ZombieReaper(config, ProcFs(), dev, lock_dir=str(locks))
    free = ZombieReaper(config, ProcFs(), dev, lock_dir=None)  # without the lock: signalled
    orphaned((locked, free), collector, clock, job)
    assert locked.actions_total[("skip", "launcher_lock")] == 1
    assert ("signal", "sigterm") not in locked.actions_total
    assert free.actions_total[("signal", "sigterm")] == 1


def test_listed_process_without_descriptor_is_unverifiable_and_not_signalled(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    pid = orphan_worker(subreaper, None)  # orphaned, but holds no device
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    simulated(scenario([f"{{pid: {pid}, memory: 1GiB}}", f"{{pid: {gone.pid}, memory: 1GiB}}"]))
    reaper = make_reaper(dev, tmp_path, dry_run=False)
    run_twice(reaper, collector, clock)
    assert counts(reaper)["unverifiable"] == 2 and counts(reaper)["orphan"] == 0
    assert alive(pid)
    reasons = {e["pid"]: e["why"] for e in audit_lines(tmp_path)}
    assert "holds no descriptor" in reasons[pid] and "not visible" in reasons[gone.pid]
    assert not any(e["event"] == "signalling" for e in audit_lines(tmp_path))


def test_pid_reused_between_detection_and_kill_is_not_signalled(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0")
    pid = job.worker
    simulated(scenario(job.listed()))

    class Reused(ProcFs):
        """After detection, the PID belongs to a process started later (a new start time)."""

        checks = 0

        armed = False

        def credentials(self, wanted: int, start_ticks: int):
            found = super().credentials(wanted, start_ticks)
            Reused.armed = wanted == pid  # the PID changes hands right before the signal
            return found

        def process(self, wanted: int):
            info = super().process(wanted)
            if wanted == pid and info is not None and Reused.armed:
                Reused.checks += 1
                return replace(info, start_ticks=info.start_ticks + 100)
            return info

    config = replace(
        ReaperConfig(protect_users=()), dry_run=False, audit_log=str(tmp_path / "audit.jsonl")
    )
    reaper = ZombieReaper(config, Reused(), dev)
    orphaned(reaper, collector, clock, job)
    assert Reused.checks >= 1 and alive(pid)
    assert [e.get("reason") for e in audit_lines(tmp_path)][-1] == "pid_reused"
    assert not any(e["event"] == "signalling" for e in audit_lines(tmp_path))


def test_defunct_is_reported_with_its_parent_and_not_signalled(
    simulated, collector, clock, dev, tmp_path
):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 5
    while ProcFs().process(child.pid).state != "Z":  # exited, not yet reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        simulated(scenario([f"{{pid: {child.pid}, memory: 1GiB}}"]))
        reaper = make_reaper(dev, tmp_path, dry_run=False)
        run_twice(reaper, collector, clock)
        assert counts(reaper)["defunct"] == 1
        (found,) = audit_lines(tmp_path)
        assert found["class"] == "defunct" and found["ppid"] == os.getpid()
        assert f"parent {os.getpid()}" in found["why"]
    finally:
        child.wait()


def test_uninterruptible_holder_is_reported_not_signalled(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    pid = orphan_worker(subreaper, f"{dev}/nvidia0")
    simulated(scenario([f"{{pid: {pid}, memory: 1GiB}}"]))

    class DState(ProcFs):
        def process(self, wanted: int):
            info = super().process(wanted)
            return replace(info, state="D") if info is not None and wanted == pid else info

    config = replace(ReaperConfig(protect_users=()), dry_run=False, audit_log=str(tmp_path / "a"))
    reaper = ZombieReaper(config, DState(), dev)
    run_twice(reaper, collector, clock)
    assert counts(reaper)["uninterruptible"] == 1 and counts(reaper)["orphan"] == 0
    assert alive(pid)


def test_holder_of_a_live_job_is_not_a_zombie(simulated, collector, clock, dev, tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"f = open({dev + '/nvidia1'!r}); print(1, flush=True); import time; time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        # a session of its own, as a job started from a shell or a scheduler has: the test
        # runner's may read as 0 (CI's init never calls setsid), which makes it unverifiable
        start_new_session=True,
    )
    try:
        holder.stdout.readline()
        simulated(scenario([], [f"{{pid: {holder.pid}, memory: 1GiB}}"]))
        reaper = make_reaper(dev, tmp_path, dry_run=False)
        run_twice(reaper, collector, clock)
        assert counts(reaper, "1") == dict.fromkeys(CLASSES, 0)
        assert audit_lines(tmp_path) == []
    finally:
        holder.kill()
        holder.wait()


def test_leaked_memory_without_holders(simulated, collector, clock, dev, tmp_path):
    simulated("gpus:\n  - {minor_number: 0, memory_used: 3GiB}\n  - {minor_number: 1}\n")
    reaper = make_reaper(dev, tmp_path)
    run_twice(reaper, collector, clock)
    assert counts(reaper)["leaked"] == 1 and counts(reaper, "1")["leaked"] == 0
    (found,) = audit_lines(tmp_path)
    assert found["class"] == "leaked" and found["pid"] is None


def test_max_kills_per_run(simulated, collector, clock, dev, tmp_path, subreaper):
    jobs = [start_job(subreaper, f"{dev}/nvidia0") for _ in range(3)]
    pids = [job.worker for job in jobs]
    simulated(scenario([entry for job in jobs for entry in job.listed("1GiB")]))
    reaper = make_reaper(dev, tmp_path, dry_run=False, max_kills_per_run=2)
    orphaned(reaper, collector, clock, *jobs)
    assert reaper.actions_total[("signal", "sigterm")] == 2
    assert reaper.actions_total[("skip", "max_kills_per_run")] == 1
    assert sum(alive(p) for p in pids) >= 1


def test_audit_log_is_private_and_a_failed_write_prevents_the_signal(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0")
    pid = job.worker
    simulated(scenario(job.listed("1GiB")))
    reaper = make_reaper(dev, tmp_path, dry_run=False)
    reaper.audit = AuditLog("/dev/full")  # every write fails: disk full
    orphaned(reaper, collector, clock, job)
    assert alive(pid)  # nothing is signalled that could not be recorded first
    assert reaper.actions_total[("skip", "audit_failed")] == 1
    assert reaper.audit.failures >= 2
    reaper.audit = AuditLog(str(tmp_path / "audit.jsonl"))  # the disk has room again
    clock.advance(1)
    reaper.run([collector.sample()], clock.now)
    wait_exited(pid)
    assert stat.S_IMODE(os.stat(tmp_path / "audit.jsonl").st_mode) == 0o600
    assert [e["event"] for e in audit_lines(tmp_path)] == ["found", "signalling"]


def test_audit_log_refuses_a_symlink(tmp_path):
    target = tmp_path / "target"
    target.write_text("")
    (tmp_path / "audit.jsonl").symlink_to(target)
    log = AuditLog(str(tmp_path / "audit.jsonl"))
    assert log.write({"event": "x"}) is False
    assert target.read_text() == ""


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("dry_run: false\n", "dry_run: dry_run: false needs audit_log"),
        ("dry_run: 'no'\n", "expected true or false"),
        ("min_age: soon\n", "min_age"),
        ("max_kills_per_run: -1\n", "max_kills_per_run: must be from 0"),
        ("audit_log: /nonexistent/dir/a.log\n", "does not exist"),
        ("protect_names: nvidia\n", "expected a list"),
        ("kill_classes: [defunct]\n", "'defunct' is never signalled: a defunct process has"),
        ("kill_classes: [unverifiable]\n", "cannot tell whose job an unverifiable process is"),
        ("kill_classes: [zombies]\n", "unknown class 'zombies' (signallable: orphan)"),
    ],
)
def test_config_errors(text, needle):
    section = parse_document(text, "c.yaml").root()
    with pytest.raises(ConfigError) as failed:
        parse_reaper(section)
    assert "c.yaml:1" in str(failed.value) and needle in str(failed.value)


def test_ended_process_still_listed_is_not_reported_again(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0")
    pid = job.worker
    simulated(scenario(job.listed()))  # NVML keeps listing it
    reaper = make_reaper(dev, tmp_path, dry_run=False)
    orphaned(reaper, collector, clock, job)
    wait_exited(pid)
    for _ in range(3):
        clock.advance(10)
        reaper.run([collector.sample()], clock.now)
    assert [e["event"] for e in audit_lines(tmp_path)] == ["found", "signalling", "exited"]
    clock.advance(60)
    reaper.run([collector.sample()], clock.now)
    confirm = audit_lines(tmp_path)[3]  # then it is reported as what it now is (defunct)
    assert confirm["event"] == "memory_not_released" and confirm["why"] == "still listed by NVML"


def test_a_leak_is_reported_once_while_it_lasts(simulated, collector, clock, dev, tmp_path):
    simulated("gpus:\n  - {minor_number: 0, memory_used: 3GiB}\n")
    reaper = make_reaper(dev, tmp_path)
    for _ in range(4):
        reaper.run([collector.sample()], clock.now)
        clock.advance(60)
    assert [e["class"] for e in audit_lines(tmp_path)] == ["leaked"]
    assert reaper.actions_total[("report", "leaked")] == 1


def test_a_descendant_of_a_launcher_lock_holder_is_never_signalled(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    """The test process holds the lock (as ``gpu-exporter run`` does) and is the worker's
    subreaper: the worker, a ``spawn`` worker without the descriptor, is covered."""
    locks = tmp_path / "locks"
    locks.mkdir()
    lock = open(locks / "GPU-some-gpu.lock", "w")  # noqa: SIM115 (held for the test)
    try:
        job = start_job(subreaper, f"{dev}/nvidia0")
        simulated(scenario(job.listed()))
        config = replace(
            ReaperConfig(protect_users=()), dry_run=False, audit_log=str(tmp_path / "audit.jsonl")
        )
        reaper = ZombieReaper(config, ProcFs(), dev, lock_dir=str(locks))
        orphaned(reaper, collector, clock, job)
        assert ProcFs().process(job.worker).ppid == os.getpid()
        assert reaper.actions_total[("skip", "launcher_lock")] == 1
        assert alive(job.worker)
    finally:
        lock.close()


def test_verdicts_give_each_process_its_class_and_last_decision(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0")
    simulated(scenario(job.listed()))
    reaper = make_reaper(dev, tmp_path)  # a dry run
    orphaned(reaper, collector, clock, job)
    uuid = audit_lines(tmp_path)[0]["uuid"]
    assert reaper.verdicts()[(uuid, job.worker)] == ("orphan", "skipped dry_run")
    assert (uuid, job.leader.pid) not in reaper.verdicts()  # exited: no longer looked at


def test_published_holders_carry_the_mode_and_the_recent_decisions(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0")
    simulated(scenario(job.listed()))
    findings = Findings()
    dry_run = make_reaper(dev, tmp_path).config
    reaper = ZombieReaper(dry_run, ProcFs(), dev, findings=findings)
    orphaned(reaper, collector, clock, job)
    holders = findings.get(ZombieHolders)
    assert holders is not None and holders.dry_run
    decisions = [d for d in holders.recent if d["pid"] == job.worker]
    assert decisions, holders.recent
    last = decisions[-1]
    assert (last["event"], last["class"], last["reason"]) == ("skipped", "orphan", "dry_run")
    assert last["uuid"] == audit_lines(tmp_path)[0]["uuid"] and last["time"] > 0
    assert all(set(d) == set(holders.recent[0]) for d in holders.recent)  # one shape
