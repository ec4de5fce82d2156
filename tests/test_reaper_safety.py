"""The reaper in kill mode never signals a job that is still wanted.

Each shape is built with real processes holding a stand-in device node: detached jobs (``nohup``
without job control, a double-fork daemon, a forking service under a live supervisor, a PID
namespace's init), processes the agent cannot fully see (another PID namespace, ``hidepid``),
protections by real and saved uid and by executable, reloads that call off a pending SIGKILL, and
durations that follow the monotonic clock, not the wall clock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from exporter.actions.engine import ActionEngine, parse_actions
from exporter.actions.reaper import CLASSES, ReaperConfig, ZombieReaper
from exporter.config.yamlconf import parse_document
from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.sampling.collect import Collector
from exporter.sampling.sampler import Sampler
from tests.helpers import until
from tests.test_reaper import (
    alive,
    audit_lines,
    counts,
    orphaned,
    scenario,
    start_job,
)

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="namespaces, mounts and uids need root")
PR_SET_NAME = 15


def kill_mode(dev: str, tmp_path: Path, procfs: ProcFs | None = None, **options) -> ZombieReaper:
    """A reaper that signals at once: no protected user, no min_age, no grace."""
    settings = {"dry_run": False, "min_age": 0, "grace_period": 0, **options}
    config = replace(
        ReaperConfig(protect_users=()), audit_log=str(tmp_path / "audit.jsonl"), **settings
    )
    return ZombieReaper(config, procfs or ProcFs(), dev)


def holds(pid: int, device: str, proc: str = "/proc") -> bool:
    with contextlib.suppress(OSError):
        return any(
            os.readlink(f"{proc}/{pid}/fd/{fd}") == device for fd in os.listdir(f"{proc}/{pid}/fd")
        )
    return False


def holder_code(device: str, setup: str = "") -> str:
    """A process that holds ``device`` open and sleeps; ``setup`` runs after the open."""
    return f"import os, time; f = open({device!r}); {setup or 'pass'}; time.sleep(120)"


def survives(reaper: ZombieReaper, collector, clock, pid: int, runs: int = 5) -> None:
    """Runs the reaper ``runs`` times a minute apart: the process lives through all of them and
    nothing is ever signalled."""
    for _ in range(runs):
        reaper.run([collector.sample()], clock.now)
        clock.advance(60)
    reaper.run([collector.sample()], clock.now)
    assert alive(pid)
    assert not any(e["event"] == "signalling" for e in audit_lines(reaper_dir(reaper)))
    assert ("signal", "sigterm") not in reaper.actions_total


def reaper_dir(reaper: ZombieReaper) -> Path:
    return Path(reaper.config.audit_log or "").parent


def pid_from(command: list[str], pids: list[int], **popen) -> int:
    """Runs ``command``, which prints a PID and exits (leaving that process behind)."""
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True, **popen)
    pid = int(done.stdout.split()[0])
    pids.append(pid)
    return pid


# -- detached jobs: never seen their job end on a GPU, so never orphans -------------------------


def test_a_nohup_job_of_a_script_that_exited_survives(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    device = f"{dev}/nvidia0"
    code = holder_code(device)
    # no job control: the job stays in the dead shell's process group and session
    script = f"nohup {sys.executable} -c {code!r} >/dev/null 2>&1 & echo $!"
    pid = pid_from(["sh", "-c", script], subreaper, start_new_session=True)
    until(lambda: holds(pid, device), "the job to hold the device")
    simulated(scenario([f"{{pid: {pid}, memory: 4GiB}}"]))
    reaper = kill_mode(dev, tmp_path)
    survives(reaper, collector, clock, pid)
    assert counts(reaper) == dict.fromkeys(CLASSES, 0)


def test_a_double_fork_daemon_survives(simulated, collector, clock, dev, tmp_path, subreaper):
    device = f"{dev}/nvidia0"
    daemonize = (
        "import os, sys\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        quiet = os.open('/dev/null', os.O_RDWR)\n"  # a daemon leaves its terminal
        "        os.dup2(quiet, 1)\n"
        f"        exec({holder_code(device)!r})\n"
        "    os.write(w, b'%d\\n' % pid)\n"
        "    os._exit(0)\n"
        "print(os.read(r, 32).decode().strip(), flush=True)\n"
        "os._exit(0)\n"
    )
    pid = pid_from([sys.executable, "-c", daemonize], subreaper)
    until(lambda: holds(pid, device), "the daemon to hold the device")
    simulated(scenario([f"{{pid: {pid}, memory: 4GiB}}"]))
    survives(kill_mode(dev, tmp_path), collector, clock, pid)


def test_a_forking_service_under_a_live_supervisor_survives(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    device = f"{dev}/nvidia0"
    start_script = f"{sys.executable} -c {holder_code(device)!r} >/dev/null 2>&1 & echo $!"
    supervisor = (  # the shape of systemd's Type=forking: the start script exits, the worker's
        # parent becomes the supervisor, which lives on
        "import ctypes, os, subprocess, sys, time\n"
        "ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n"
        f"out = subprocess.run(['sh', '-c', {start_script!r}], stdout=subprocess.PIPE,"
        " start_new_session=True).stdout\n"
        "print(out.decode().strip(), flush=True)\n"
        "while True:\n"
        "    try:\n"
        "        os.wait()\n"
        "    except ChildProcessError:\n"
        "        time.sleep(1)\n"
    )
    service = subprocess.Popen([sys.executable, "-c", supervisor], stdout=subprocess.PIPE)
    try:
        pid = int(service.stdout.readline())
        until(lambda: holds(pid, device), "the worker to hold the device")
        assert ProcFs().process(pid).ppid == service.pid
        simulated(scenario([f"{{pid: {pid}, memory: 4GiB}}"]))
        survives(kill_mode(dev, tmp_path), collector, clock, pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        service.kill()
        service.wait()


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_the_init_of_a_pid_namespace_survives(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    device = f"{dev}/nvidia0"
    runtime = subprocess.Popen(  # a container runtime: it starts the container's init, then dies
        ["unshare", "--fork", "--pid", sys.executable, "-c", holder_code(device)],
        start_new_session=True,
    )
    try:
        until(lambda: _child_of(runtime.pid) is not None, "the namespace's init")
        pid = _child_of(runtime.pid)
        subreaper.append(pid)
        until(lambda: holds(pid, device), "the init to hold the device")
        runtime.kill()  # its group and session leader is gone
        runtime.wait()
        simulated(scenario([f"{{pid: {pid}, memory: 4GiB}}"]))
        survives(kill_mode(dev, tmp_path), collector, clock, pid)
    finally:
        runtime.kill()
        runtime.wait()


def _child_of(parent: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        return int(children[0]) if children else None
    return None


def test_a_process_whose_launcher_only_probed_the_gpu_survives(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    """The launcher held the device node (as NVML does) but NVML never listed it: it was not
    doing GPU work, so its exit is no evidence about the job it handed the GPU to."""
    job = start_job(subreaper, f"{dev}/nvidia0")
    simulated(scenario([job.entry()]))  # only the worker has a CUDA context
    reaper = kill_mode(dev, tmp_path)
    reaper.run([collector.sample()], clock.now)
    job.end()
    survives(reaper, collector, clock, job.worker)


def test_a_worker_still_busy_on_the_gpu_after_its_leader_exits_is_not_an_orphan(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0")
    busy_until_150s = "{points: [[0, 0.9], [150, 0.9], [151, 0]]}"
    busy = f"{{pid: {job.worker}, memory: 2GiB, sm_utilization: {busy_until_150s}}}"
    simulated(scenario([job.listed()[0], busy]))
    reaper = kill_mode(dev, tmp_path, min_age=60)
    orphaned(reaper, collector, clock, job, age=60)  # t = 61: busy since its leader exited
    for _ in range(2):  # t = 121, 181: busy within each sample's window (until 151)
        assert counts(reaper)["orphan"] == 0 and alive(job.worker)
        clock.advance(60)
        reaper.run([collector.sample()], clock.now)
    assert counts(reaper)["orphan"] == 0
    clock.advance(60)
    reaper.run([collector.sample()], clock.now)  # t = 241: no activity in the last 60 s
    assert reaper.actions_total[("signal", "sigterm")] == 1
    (found,) = [e for e in audit_lines(tmp_path) if e["event"] == "found"]
    assert found["why"].endswith("no GPU activity since")


# -- processes the agent cannot fully see: unverifiable, never signalled -------------------------


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_an_agent_looking_into_another_pid_namespace_signals_nothing(
    simulated, collector, clock, dev, tmp_path, subreaper, caplog
):
    device = f"{dev}/nvidia0"
    inside = f"{sys.executable} -c {holder_code(device)!r} & wait"
    container = subprocess.Popen(
        ["unshare", "--fork", "--pid", "--mount-proc", "sh", "-c", inside],
        start_new_session=True,
    )
    try:
        until(lambda: _child_of(container.pid) is not None, "the namespace's init")
        init = _child_of(container.pid)
        proc = f"/proc/{init}/root/proc"  # procfs of the namespace, as a container mounts it
        until(lambda: holds(2, device, proc), "the worker to hold the device")
        simulated(scenario(["{pid: 2, memory: 4GiB}"]))
        reaper = kill_mode(dev, tmp_path, ProcFs(proc))
        with caplog.at_level(logging.WARNING):
            survives(reaper, collector, clock, init)
        assert holds(2, device, proc)
        assert counts(reaper)["unverifiable"] == 1
        (found,) = [e for e in audit_lines(tmp_path) if e["event"] == "found"]
        assert "another PID namespace" in found["why"]
        assert caplog.text.count("shows another PID namespace than the agent's") == 1
    finally:
        container.kill()
        container.wait()


@pytest.fixture
def hidepid_proc(tmp_path: Path) -> Iterator[str]:
    """A procfs mounted with hidepid=2 (as hardened hosts mount /proc)."""
    if not ROOT:
        pytest.skip("mounting a procfs needs root")
    target = tmp_path / "proc"
    target.mkdir()
    mounted = subprocess.run(["mount", "-t", "proc", "-o", "hidepid=2", "proc", str(target)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount a procfs here")
    yield str(target)
    subprocess.run(["umount", "-l", str(target)], check=False)


def test_with_hidepid_a_job_whose_leader_is_not_visible_is_unverifiable(
    simulated, collector, clock, dev, tmp_path, subreaper, hidepid_proc
):
    device = f"{dev}/nvidia0"
    script = f"nohup {sys.executable} -c {holder_code(device)!r} >/dev/null 2>&1 & echo $!"
    pid = pid_from(["sh", "-c", script], subreaper, start_new_session=True)
    until(lambda: holds(pid, device), "the job to hold the device")
    simulated(scenario([f"{{pid: {pid}, memory: 4GiB}}"]))
    procfs = ProcFs(hidepid_proc)
    assert procfs.hides_processes() and not ProcFs("/proc").hides_processes()
    reaper = kill_mode(dev, tmp_path, procfs)
    survives(reaper, collector, clock, pid)
    assert counts(reaper)["unverifiable"] == 1
    (found,) = [e for e in audit_lines(tmp_path) if e["event"] == "found"]
    assert "hidden (procfs mounted with hidepid)" in found["why"]


def test_a_group_or_session_outside_the_namespace_is_unverifiable(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0")

    class Namespaced(ProcFs):
        """Reads the worker as a procfs of a child namespace shows it: pgid and sid 0."""

        def process(self, wanted: int):
            info = super().process(wanted)
            if info is not None and wanted == job.worker:
                return replace(info, pgid=0, sid=0)
            return info

    simulated(scenario(job.listed()))
    reaper = kill_mode(dev, tmp_path, Namespaced())
    orphaned(reaper, collector, clock, job)
    survives(reaper, collector, clock, job.worker)
    assert counts(reaper)["unverifiable"] == 1


# -- protections: any uid, any name ------------------------------------------------------------


@needs_root
def test_a_root_daemon_that_dropped_only_its_effective_uid_is_protected(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0", setup="os.setresuid(0, 65534, 0)")
    until(lambda: ProcFs().process(job.worker).uid == 65534, "the worker to drop its euid")
    simulated(scenario(job.listed()))
    reaper = kill_mode(dev, tmp_path, protect_users=("root",))
    orphaned(reaper, collector, clock, job)
    assert counts(reaper)["orphan"] == 1
    survives(reaper, collector, clock, job.worker)
    assert reaper.actions_total[("skip", "protected_user")] >= 1


def test_a_protected_executable_is_protected_whatever_it_calls_itself(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    rename = f"import ctypes; ctypes.CDLL(None).prctl({PR_SET_NAME}, b'innocent', 0, 0, 0)"
    job = start_job(subreaper, f"{dev}/nvidia0", setup=rename)
    until(lambda: ProcFs().process(job.worker).name == "innocent", "the worker's new name")
    exe = os.path.basename(os.path.realpath(sys.executable))
    simulated(scenario(job.listed()))
    reaper = kill_mode(dev, tmp_path, protect_names=(exe,))
    orphaned(reaper, collector, clock, job)
    survives(reaper, collector, clock, job.worker)
    assert reaper.actions_total[("skip", "protected_name")] >= 1


# -- reloads win -------------------------------------------------------------------------------


RELOADS = {
    "dry_run": {"dry_run": True},
    "protected_user": {"protect_users": (str(os.getuid()),)},
    "protected_name": {"protect_names": ("python*",)},
    "kill_classes": {"kill_classes": ()},
    "max_kills_per_run": {"max_kills_per_run": 0},
}


@pytest.mark.parametrize("reason", [*RELOADS, "disabled"])
def test_a_reload_calls_off_a_pending_sigkill(
    simulated, collector, clock, dev, tmp_path, subreaper, reason
):
    job = start_job(subreaper, f"{dev}/nvidia0", ignore_term=True)
    simulated(scenario(job.listed()))
    reaper = kill_mode(dev, tmp_path, grace_period=30, min_age=60)
    orphaned(reaper, collector, clock, job)
    assert reaper.actions_total[("signal", "sigterm")] == 1  # ignored: SIGKILL is due in 30 s
    if reason == "disabled":
        reaper.close("disabled")
    else:
        reaper.reconfigure(replace(reaper.config, **RELOADS[reason]))
        for _ in range(3):
            clock.advance(30)
            reaper.run([collector.sample()], clock.now)
    assert alive(job.worker)
    events = audit_lines(tmp_path)
    assert not any(e.get("signal") == "SIGKILL" and e["event"] == "signalling" for e in events)
    (cancelled,) = [e for e in events if e["event"] == "cancelled"]
    assert cancelled["pid"] == job.worker and cancelled["reason"] == reason
    assert cancelled["signal"] == "SIGKILL"
    assert reaper.actions_total[("cancel", reason)] == 1


def test_disabling_the_reaper_in_the_engine_calls_off_its_pending_sigkill(
    simulated, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0", ignore_term=True)
    driver = simulated(scenario(job.listed()))
    audit = tmp_path / "audit.jsonl"

    def actions(reaper: str):
        text = f"actions:\n  zombie_reaper: {reaper}\n"
        return parse_actions(parse_document(text, "c.yaml").root().section("actions"))

    kill = (
        f"{{dry_run: false, audit_log: {audit}, protect_users: [], min_age: 0s, grace_period: 1h}}"
    )
    collector = Collector(
        Nvml(library=driver), ProcFs(), monotonic=clock, clock=lambda: 1.7e9 + clock.now
    )
    sampler = Sampler(collector, interval=5, deadline=5, monotonic=clock)
    engine = ActionEngine(sampler, actions(kill), ProcFs(), dev, monotonic=clock)
    try:
        for step in (0, 1, 1):  # leader seen, its exit seen, then the worker is an orphan
            clock.advance(step)
            sampler.sample_once()
            assert engine.run("zombie_reaper")
            if step == 0:
                job.end()
        assert [e["event"] for e in audit_lines(tmp_path)][-1] == "signalling"
        engine.reload(actions("{enabled: false}"))
        assert [e["reason"] for e in audit_lines(tmp_path) if e["event"] == "cancelled"] == [
            "disabled"
        ]
        assert alive(job.worker)
    finally:
        engine.stop()
        collector.close()


# -- time ----------------------------------------------------------------------------------------


def test_a_wall_clock_step_does_not_make_an_orphan_old_enough(
    simulated, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0")
    driver = simulated(scenario(job.listed()))
    wall = [1.7e9]

    def stepping() -> float:
        wall[0] += 86400  # NTP steps the clock a day at every sample
        return wall[0]

    collector = Collector(Nvml(library=driver), ProcFs(), monotonic=clock, clock=stepping)
    try:
        reaper = kill_mode(dev, tmp_path, min_age=60)
        orphaned(reaper, collector, clock, job, age=30)  # 30 s on the monotonic clock
        assert counts(reaper)["orphan"] == 0 and alive(job.worker)
    finally:
        collector.close()


def test_a_process_flipping_in_and_out_of_d_state_is_reported_once_and_keeps_its_timer(
    simulated, collector, clock, dev, tmp_path, subreaper
):
    job = start_job(subreaper, f"{dev}/nvidia0")
    stuck = [False]

    class Flipping(ProcFs):
        def process(self, wanted: int):
            info = super().process(wanted)
            if info is not None and wanted == job.worker and stuck[0]:
                return replace(info, state="D")
            return info

    simulated(scenario(job.listed()))
    reaper = kill_mode(dev, tmp_path, Flipping(), min_age=60, dry_run=True)
    reaper.run([collector.sample()], clock.now)
    job.end()
    # its exit is seen at 1 s; then D, not D, D, not D every 20 s: 80 s after the exit
    for seconds, in_d in ((1, False), (20, True), (20, False), (20, True), (20, False)):
        clock.advance(seconds)
        stuck[0] = in_d
        reaper.run([collector.sample()], clock.now)
    found = [e["class"] for e in audit_lines(tmp_path) if e["event"] == "found"]
    assert found == ["uninterruptible", "orphan"], found
