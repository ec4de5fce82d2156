"""procfs reading: a fake /proc tree for exact parsing and hostile content, then the real /proc."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exporter.core.procfs import MAX_CMDLINE_BYTES, ProcFs, parse_cgroup, parse_slurm

BTIME = 1_700_000_000
TICKS = os.sysconf("SC_CLK_TCK")
CONTAINER = "3f2a9c1be0d44d6f8a7b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9012"
OTHER_CONTAINER = "aa" * 32
POD_DASHES = "1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901"
POD_UNDERSCORES = POD_DASHES.replace("-", "_")


def stat_line(
    pid: int,
    comm: bytes,
    *,
    state: bytes = b"S",
    ppid: int = 1,
    pgid: int | None = None,
    sid: int | None = None,
    starttime: int = 123456,
) -> bytes:
    """A realistic 52-field /proc/PID/stat line (field 22 is starttime in clock ticks)."""
    pgid = pid if pgid is None else pgid
    sid = pid if sid is None else sid
    after_comm = [
        state,  # 3 state
        b"%d" % ppid,  # 4 ppid
        b"%d" % pgid,  # 5 pgrp
        b"%d" % sid,  # 6 session
        b"34816",  # 7 tty_nr
        b"-1",  # 8 tpgid
        b"4194560",  # 9 flags
        b"1874",  # 10 minflt
        b"0",  # 11 cminflt
        b"3",  # 12 majflt
        b"0",  # 13 cmajflt
        b"77",  # 14 utime
        b"21",  # 15 stime
        b"0",  # 16 cutime
        b"0",  # 17 cstime
        b"20",  # 18 priority
        b"0",  # 19 nice
        b"9",  # 20 num_threads
        b"0",  # 21 itrealvalue
        b"%d" % starttime,  # 22 starttime
        b"2361880576",  # 23 vsize
        b"24577",  # 24 rss
    ]
    after_comm += [b"%d" % (1000 + i) for i in range(25, 53)]  # 25..52
    assert len(after_comm) == 50
    return b"%d (%s) " % (pid, comm) + b" ".join(after_comm) + b"\n"


class FakeProc:
    """A procfs tree under tmp_path."""

    def __init__(self, root: Path, btime: int | None = BTIME) -> None:
        self.root = root
        if btime is not None:
            (root / "stat").write_bytes(
                b"cpu  10132153 290696 3084719 46828483 16683 0 25195 0 0 0\n"
                b"intr 1462898 0 9 0\nctxt 2279347\n"
                b"btime %d\nprocesses 26442\nprocs_running 1\n" % btime
            )

    def add(
        self,
        pid: int,
        comm: bytes = b"python3",
        *,
        stat: bytes | None = None,
        cmdline: bytes | None = b"python3\0train.py\0",
        cgroup: bytes | None = b"0::/user.slice/user-1000.slice/session-3.scope\n",
        **fields: object,
    ) -> Path:
        piddir = self.root / str(pid)
        piddir.mkdir()
        (piddir / "stat").write_bytes(stat if stat is not None else stat_line(pid, comm, **fields))
        if cmdline is not None:
            (piddir / "cmdline").write_bytes(cmdline)
        if cgroup is not None:
            (piddir / "cgroup").write_bytes(cgroup)
        return piddir

    def procfs(self) -> ProcFs:
        return ProcFs(root=str(self.root))


@pytest.fixture
def fake(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path)


def my_user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


# -- a fake procfs tree ---------------------------------------------------------------------------


def test_process_reads_every_field(fake: FakeProc) -> None:
    cgroup = (
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{POD_UNDERSCORES}.slice/cri-containerd-{CONTAINER}.scope\n"
    ).encode()
    fake.add(
        1234,
        b"my (weird) proc",
        state=b"R",
        ppid=77,
        pgid=1200,
        sid=1100,
        starttime=987654,
        cmdline=b"/usr/bin/my\0--flag\0value with spaces\0",
        cgroup=cgroup,
    )
    info = fake.procfs().process(1234)
    assert info is not None
    assert info.pid == 1234
    assert info.name == "my (weird) proc"
    assert info.state == "R"
    assert (info.ppid, info.pgid, info.sid) == (77, 1200, 1100)
    assert info.start_ticks == 987654
    assert info.start_time == pytest.approx(BTIME + 987654 / TICKS)
    assert info.cmdline == ("/usr/bin/my", "--flag", "value with spaces")
    assert info.uid == os.stat(fake.root / "1234").st_uid == os.geteuid()
    assert info.user == my_user()
    assert info.container_id == CONTAINER
    assert info.pod_uid == POD_DASHES


def test_comm_that_looks_like_more_stat_fields(fake: FakeProc) -> None:
    # A process can name itself anything, including ") Z 9 9 9": only the LAST ')' ends comm.
    fake.add(42, b"x) Z 9 9 9 0 -1 (y", state=b"S", ppid=5, pgid=6, sid=7, starttime=100)
    info = fake.procfs().process(42)
    assert info is not None
    assert info.name == "x) Z 9 9 9 0 -1 (y"
    assert (info.state, info.ppid, info.pgid, info.sid, info.start_ticks) == ("S", 5, 6, 7, 100)


def test_empty_comm(fake: FakeProc) -> None:
    fake.add(43, b"", cmdline=b"")
    info = fake.procfs().process(43)
    assert info is not None
    assert info.name == ""
    assert info.cmdline == ()


def test_no_btime_gives_no_start_time(tmp_path: Path) -> None:
    fake = FakeProc(tmp_path, btime=None)
    fake.add(7, starttime=500)
    info = fake.procfs().process(7)
    assert info is not None
    assert info.start_ticks == 500
    assert info.start_time is None


def test_boot_time(fake: FakeProc) -> None:
    assert fake.procfs().boot_time() == BTIME


def test_plain_process_has_no_container_or_pod(fake: FakeProc) -> None:
    fake.add(8)
    info = fake.procfs().process(8)
    assert info is not None
    assert (info.container_id, info.pod_uid) == ("", "")


# -- cgroup forms ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "container", "pod"),
    [
        pytest.param(
            "0::/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{POD_UNDERSCORES}.slice/cri-containerd-{CONTAINER}.scope\n",
            CONTAINER,
            POD_DASHES,
            id="v2-systemd-kubepods",
        ),
        pytest.param(
            f"12:pids:/kubepods/besteffort/pod{POD_DASHES}/{CONTAINER}\n"
            f"11:memory:/kubepods/besteffort/pod{POD_DASHES}/{CONTAINER}\n"
            f"1:name=systemd:/kubepods/besteffort/pod{POD_DASHES}/{CONTAINER}\n",
            CONTAINER,
            POD_DASHES,
            id="v1-cgroupfs-kubepods",
        ),
        pytest.param(
            f"0::/kubepods/pod{POD_DASHES}/{CONTAINER}\n",
            CONTAINER,
            POD_DASHES,
            id="v2-cgroupfs-kubepods",
        ),
        pytest.param(f"0::/system.slice/docker-{CONTAINER}.scope\n", CONTAINER, "", id="v2-docker"),
        pytest.param(
            f"12:cpu,cpuacct:/docker/{CONTAINER}\n11:memory:/docker/{CONTAINER}\n",
            CONTAINER,
            "",
            id="v1-docker",
        ),
        pytest.param(
            f"0::/machine.slice/libpod-{CONTAINER}.scope/container\n",
            CONTAINER,
            "",
            id="podman",
        ),
        pytest.param(
            f"0::/docker/{OTHER_CONTAINER}/docker/{CONTAINER}\n",
            CONTAINER,
            "",
            id="nested-innermost-wins",
        ),
        pytest.param(
            "0::/user.slice/user-1000.slice/user@1000.service/app.slice/"
            "app-gnome-firefox-4242.scope\n",
            "",
            "",
            id="user-session",
        ),
        pytest.param(
            "12:pids:/user.slice/user-1000.slice/session-3.scope\n"
            "1:name=systemd:/user.slice/user-1000.slice/session-3.scope\n0::/\n",
            "",
            "",
            id="v1-user-session",
        ),
        pytest.param("0::/\n", "", "", id="root-cgroup"),
        pytest.param("", "", "", id="empty"),
        pytest.param(
            # 65 hex characters is not a container id, nor is a 63-character one.
            f"0::/system.slice/x-{CONTAINER}a.scope/y-{CONTAINER[:-1]}.scope\n",
            "",
            "",
            id="wrong-length-hex",
        ),
    ],
)
def test_parse_cgroup(text: str, container: str, pod: str) -> None:
    assert parse_cgroup(text) == (container, pod)


@pytest.mark.parametrize(
    ("text", "job", "step"),
    [
        # Slurm 22.05's cgroup v1 plugin, as it runs on Debian: the node's name in the path
        pytest.param(
            "12:freezer:/slurm_node7/uid_1000/job_4242/step_0/task_0\n"
            "11:memory:/slurm_node7/uid_1000/job_4242/step_0/task_0\n",
            "4242",
            "0",
            id="v1-slurm-nodename",
        ),
        pytest.param("4:devices:/slurm/uid_5/job_9/step_batch\n", "9", "batch", id="v1-batch"),
        pytest.param("4:cpuset:/slurm/uid_5/job_9\n", "9", "", id="v1-job-only"),
        pytest.param(
            "0::/system.slice/slurmstepd.scope/job_77/step_extern/user/task_special\n",
            "77",
            "extern",
            id="v2-extern",
        ),
        pytest.param(
            "0::/system.slice/slurmstepd.scope/job_78/step_12/user/task_0\n", "78", "12", id="v2"
        ),
        pytest.param("0::/system.slice/slurmstepd.scope/system\n", "", "", id="v2-slurmstepd"),
        pytest.param("0::/user.slice/job_3/step_1\n", "", "", id="lookalike-outside-slurm"),
        pytest.param("", "", "", id="empty"),
    ],
)
def test_parse_slurm(text: str, job: str, step: str) -> None:
    assert parse_slurm(text) == (job, step)


def test_a_slurm_jobs_process_is_named_by_its_job(fake: FakeProc) -> None:
    fake.add(4321, cgroup=b"0::/system.slice/slurmstepd.scope/job_77/step_3/user/task_0\n")
    info = ProcFs(str(fake.root)).process(4321)
    assert info is not None and (info.slurm_job, info.slurm_step) == ("77", "3")


# -- races and hostile content --------------------------------------------------------------------


def test_missing_pid_is_none(fake: FakeProc) -> None:
    fake.add(10)
    procfs = fake.procfs()
    assert procfs.process(11) is None
    assert procfs.process(0) is None
    assert procfs.process(-10) is None
    assert procfs.process(10) is not None


def test_pid_zero_is_never_a_process(fake: FakeProc) -> None:
    # NVML reports pid 0 for processes it cannot attribute: never look it up, whatever the root.
    fake.add(0)
    assert fake.procfs().process(0) is None


def test_pid_dir_without_stat_is_none(fake: FakeProc) -> None:
    (fake.root / "12").mkdir()
    (fake.root / "12" / "cmdline").write_bytes(b"ghost\0")
    assert fake.procfs().process(12) is None


def test_stat_is_a_directory_is_none(fake: FakeProc) -> None:
    (fake.root / "13" / "stat").mkdir(parents=True)
    assert fake.procfs().process(13) is None


def test_vanished_between_reads(fake: FakeProc) -> None:
    fake.add(14)
    procfs = fake.procfs()
    assert procfs.process(14) is not None
    for name in ("stat", "cmdline", "cgroup"):
        (fake.root / "14" / name).unlink()
    (fake.root / "14").rmdir()
    assert procfs.process(14) is None


def test_stat_without_cmdline_or_cgroup(fake: FakeProc) -> None:
    fake.add(15, b"kworker/0:1", cmdline=None, cgroup=None, starttime=42)
    info = fake.procfs().process(15)
    assert info is not None
    assert info.name == "kworker/0:1"
    assert info.cmdline == ()
    assert info.start_ticks == 42
    assert (info.container_id, info.pod_uid) == ("", "")


def test_cmdline_and_cgroup_unreadable_as_other_file_types(fake: FakeProc) -> None:
    piddir = fake.add(16, b"worker", cmdline=None, cgroup=None)
    (piddir / "cmdline").mkdir()  # reading a directory fails with an OSError, like EACCES
    (piddir / "cgroup").symlink_to(piddir / "gone")  # dangling: ENOENT
    info = fake.procfs().process(16)
    assert info is not None
    assert info.name == "worker"
    assert info.cmdline == ()
    assert info.container_id == ""


def test_zombie_has_empty_cmdline(fake: FakeProc) -> None:
    fake.add(17, b"defunct", state=b"Z", cmdline=b"")
    info = fake.procfs().process(17)
    assert info is not None
    assert (info.state, info.name, info.cmdline) == ("Z", "defunct", ())


def test_a_command_line_read_inside_exec_is_not_remembered(fake: FakeProc) -> None:
    # Inside exec the kernel shows an empty command line; the start time stays, and so may the
    # name (python running python): the next read must see the new command line.
    piddir = fake.add(19, b"python3", cmdline=b"", starttime=77)
    procfs = fake.procfs()
    assert procfs.process(19).cmdline == ()
    (piddir / "cmdline").write_bytes(b"python3\0serve.py\0")
    assert procfs.process(19).cmdline == ("python3", "serve.py")
    (piddir / "cmdline").write_bytes(b"")  # now a zombie: the life's command line is kept
    assert procfs.process(19).cmdline == ("python3", "serve.py")


def test_non_utf8_comm_and_cmdline(fake: FakeProc) -> None:
    fake.add(
        18,
        b"caf\xe9 \xff",
        cmdline=b"/opt/caf\xe9\0--name=\xff\xfe\0ok\0",
        cgroup=b"0::/weird-\xff/docker-" + CONTAINER.encode() + b".scope\n",
    )
    info = fake.procfs().process(18)
    assert info is not None
    assert isinstance(info.name, str)
    assert info.name == "caf\\xe9 \\xff"
    assert info.cmdline == ("/opt/caf\\xe9", "--name=\\xff\\xfe", "ok")
    assert all(isinstance(arg, str) for arg in info.cmdline)
    assert info.container_id == CONTAINER


def test_huge_cmdline_is_cut(fake: FakeProc) -> None:
    fake.add(19, cmdline=b"prog\0" + b"x" * 1_000_000 + b"\0--tail\0")
    info = fake.procfs().process(19)
    assert info is not None
    assert info.cmdline[0] == "prog"
    assert len(info.cmdline) == 2  # "--tail" lies far beyond the cut
    assert info.cmdline[1] == "x" * (MAX_CMDLINE_BYTES - len(b"prog\0"))
    assert len("\0".join(info.cmdline).encode()) <= MAX_CMDLINE_BYTES


def test_huge_cmdline_cut_inside_a_utf8_character(fake: FakeProc) -> None:
    fake.add(20, cmdline=b"a" + "é".encode() * 600_000)
    info = fake.procfs().process(20)
    assert info is not None
    (arg,) = info.cmdline
    assert arg.startswith("aé")
    assert arg.endswith("\\xc3")  # half of the last "é": escaped, not an exception
    assert len(arg.encode("utf-8", "surrogateescape")) <= MAX_CMDLINE_BYTES + 3


@pytest.mark.parametrize(
    "stat",
    [
        b"",
        b"\n",
        b"garbage",
        b"1234 (name",
        b"1234 name) S 1 1 1",
        b"1234 (name)",
        b"1234 (name) S 1 1",
        b"1234 (name) S one 1 1 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 5 1 1\n",
        b"1234 (name) S 1 1 1 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 notticks 1 1\n",
        b"1234 (name) S 1 1 1 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0\n",  # cut before starttime
        b"\x00\xff\xfe" * 50,
    ],
)
def test_malformed_stat_is_none(fake: FakeProc, stat: bytes) -> None:
    fake.add(1234, stat=stat)
    assert fake.procfs().process(1234) is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_stat_is_none(fake: FakeProc) -> None:
    piddir = fake.add(21)
    (piddir / "stat").chmod(0)
    try:
        assert fake.procfs().process(21) is None
    finally:
        (piddir / "stat").chmod(0o644)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_cmdline_and_cgroup(fake: FakeProc) -> None:
    piddir = fake.add(22, b"secret", cgroup=f"0::/docker/{CONTAINER}\n".encode())
    (piddir / "cmdline").chmod(0)
    (piddir / "cgroup").chmod(0)
    try:
        info = fake.procfs().process(22)
    finally:
        (piddir / "cmdline").chmod(0o644)
        (piddir / "cgroup").chmod(0o644)
    assert info is not None
    assert info.name == "secret"
    assert info.cmdline == ()
    assert info.container_id == ""


@pytest.mark.parametrize(
    ("comm", "cmdline", "name"),
    [
        # The kernel cuts comm to 15 characters: argv[0]'s basename completes it.
        (
            b"very_long_progr",
            b"/opt/bin/very_long_program_name\0--flag\0",
            "very_long_program_name",
        ),
        (b"very_long_progr", b"very_long_program_name\0", "very_long_program_name"),
        # argv[0] rewritten (nginx style): keep comm.
        (b"very_long_progr", b"nginx: worker process\0", "very_long_progr"),
        # comm shorter than 15 was not cut: keep it even if argv[0] is longer.
        (b"python3", b"/usr/bin/python3.11\0x.py\0", "python3"),
        # No cmdline (kernel thread, zombie): comm as it is.
        (b"very_long_progr", b"", "very_long_progr"),
    ],
)
def test_truncated_comm_is_completed(
    fake: FakeProc, comm: bytes, cmdline: bytes, name: str
) -> None:
    fake.add(23, comm, cmdline=cmdline)
    info = fake.procfs().process(23)
    assert info is not None
    assert info.name == name


# -- user names -----------------------------------------------------------------------------------


def unknown_uid() -> int:
    for uid in (4_000_000_000, 3_999_999_999, 2_147_483_000):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
    pytest.skip("every candidate uid is in this host's passwd")


def test_user_name_known_and_unknown() -> None:
    procfs = ProcFs()
    assert procfs.user_name(os.geteuid()) == my_user()
    uid = unknown_uid()
    assert procfs.user_name(uid) == str(uid)
    assert procfs.user_name(2**63) == str(2**63)  # beyond uid_t
    assert procfs.user_name(-5) == "-5"


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory another owner")
def test_process_owned_by_unknown_uid(fake: FakeProc) -> None:
    uid = unknown_uid()
    piddir = fake.add(24)
    os.chown(piddir, uid, -1)
    info = fake.procfs().process(24)
    assert info is not None
    assert info.uid == uid
    assert info.user == str(uid)


# -- the real /proc -------------------------------------------------------------------------------


def test_real_proc_sees_this_process() -> None:
    info = ProcFs().process(os.getpid())
    assert info is not None
    assert info.pid == os.getpid()
    assert info.ppid == os.getppid()
    assert info.pgid == os.getpgrp()
    assert info.sid == os.getsid(0)
    assert info.uid == os.geteuid()
    assert info.user == my_user()
    assert info.state in ("R", "S")
    comm = Path("/proc/self/comm").read_text().rstrip("\n")
    assert info.name.startswith(comm)
    assert info.cmdline, "our own command line must be readable"
    args = tuple(sys.argv[1:])
    assert info.cmdline[len(info.cmdline) - len(args) :] == args
    assert info.start_time is not None
    assert time.time() - 24 * 3600 < info.start_time <= time.time() + 2


@pytest.mark.parametrize("keep", [False, True], ids=["looked-up", "kept-open"])
def test_real_proc_sees_a_child_until_it_is_reaped(keep: bool) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(30)"]
    procfs = ProcFs()
    started = time.time()
    child = subprocess.Popen(argv)
    try:
        info = procfs.process(child.pid, keep)
        assert info is not None
        assert info.pid == child.pid
        assert info.ppid == os.getpid()
        assert info.uid == os.geteuid()
        assert info.user == my_user()
        # Just after fork the child may still show our own command line: wait for its exec.
        deadline = time.monotonic() + 5
        while info is not None and info.cmdline != tuple(argv) and time.monotonic() < deadline:
            time.sleep(0.01)
            info = procfs.process(child.pid, keep)
        assert info is not None
        assert info.cmdline == tuple(argv)
        assert info.start_time is not None
        assert started - 2 <= info.start_time <= time.time() + 2
        child.kill()
        # Killed but not reaped: a zombie, still listed, with no command line.
        deadline = time.monotonic() + 5
        while info is not None and info.state != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
            info = procfs.process(child.pid, keep)
        assert info is not None
        assert info.state == "Z"
        assert info.cmdline == tuple(argv)  # remembered from when it was alive
        assert ProcFs().process(child.pid).cmdline == ()  # the kernel has dropped it
        child.wait(timeout=5)
        assert procfs.process(child.pid, keep) is None
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_lasting_facts_are_read_once_per_process(fake: FakeProc) -> None:
    piddir = fake.add(4321, cmdline=b"python3\0train.py\0")
    procfs = fake.procfs()
    assert procfs.process(4321).cmdline == ("python3", "train.py")
    (piddir / "cmdline").write_bytes(b"changed\0")  # not read again for the same process
    assert procfs.process(4321).cmdline == ("python3", "train.py")
    # the PID now names another process (a later start time): everything is read again
    (piddir / "stat").write_bytes(stat_line(4321, b"python3", starttime=999999))
    assert procfs.process(4321).cmdline == ("changed",)
    procfs.retain(set())  # forgotten: read again next time
    (piddir / "cmdline").write_bytes(b"again\0")
    assert procfs.process(4321).cmdline == ("again",)


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _until(what: str, check, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return found


def test_a_kept_process_is_read_fresh_each_time() -> None:
    """A process whose files are kept open is still read as it is now: its state, its owner
    and, after an exec, its new name and command line."""
    code = (
        "import os, sys, time; sys.stdin.readline(); "
        + ("os.setresuid(65534, 65534, 65534); " if os.geteuid() == 0 else "")
        + f"sys.stdin.readline(); os.execv({shutil.which('sleep')!r}, ['sleep', '30'])"
    )  # execv: execvp imports a module, which nobody (65534) may not be able to read
    procfs = ProcFs()
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    assert child.stdin is not None
    try:
        first = _until("the child's exec", lambda: _python(procfs.process(child.pid, True)))
        assert first.uid == os.geteuid()
        os.kill(child.pid, signal.SIGSTOP)
        assert _until("a stopped state", lambda: _state(procfs.process(child.pid, True), "T"))
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write(b"\n")
        child.stdin.flush()
        if os.geteuid() == 0:
            moved = _until("the new uid", lambda: _uid(procfs.process(child.pid, True), 65534))
            assert moved.user == pwd.getpwuid(65534).pw_name
        child.stdin.write(b"\n")
        child.stdin.flush()
        after = _until("the second exec", lambda: _named(procfs.process(child.pid, True), "sleep"))
        assert after.cmdline == ("sleep", "30")
        assert after.start_ticks == first.start_ticks
    finally:
        child.kill()
        child.wait()
    assert procfs.process(child.pid, True) is None


def _python(info):
    return info if info is not None and info.cmdline[1:2] == ("-c",) else None


def _state(info, state: str):
    return info if info is not None and info.state == state else None


def _uid(info, uid: int):
    return info if info is not None and info.uid == uid else None


def _named(info, name: str):
    return info if info is not None and info.name == name else None


def test_kept_files_are_closed_by_retain_and_close() -> None:
    children = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
    try:
        procfs = ProcFs()
        before = _open_descriptors()
        for child in children:
            assert procfs.process(child.pid, True) is not None
        assert _open_descriptors() == before + 2 * len(children)
        procfs.process(children[0].pid)  # without keep: nothing more stays open
        assert _open_descriptors() == before + 2 * len(children)
        procfs.retain({children[0].pid})
        assert _open_descriptors() == before + 2
        procfs.close()
        assert _open_descriptors() == before
        assert procfs.process(children[0].pid) is not None  # still readable after close
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_a_copy_of_proc_keeps_nothing_open(fake: FakeProc) -> None:
    """Files of a copied tree never end with their process: they are looked up every time."""
    piddir = fake.add(4321, cmdline=b"python3\0train.py\0")
    procfs = fake.procfs()
    before = _open_descriptors()
    assert procfs.process(4321, keep=True) is not None
    assert _open_descriptors() == before
    for child in piddir.iterdir():
        child.unlink()
    piddir.rmdir()
    assert procfs.process(4321, keep=True) is None
