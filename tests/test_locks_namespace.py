"""Launcher locks seen from another PID namespace (issue 18), and what keeps old and new launchers
apart (docs/launcher.md, "How the locks work").

In a PID namespace where the process that took a ``flock`` does not exist, ``/proc/locks`` leaves
the lock out. A launcher now also marks its lock with an OFD read lock, which any namespace sees.
The namespaces are real (``unshare -fp --mount-proc``: a new PID namespace with its own
``/proc``), and so are the launchers, jobs and readers: child processes this test starts and
reaps.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.core import locks as locks_module
from exporter.core.locks import UNKNOWN_HOLDER, held_locks, open_lock_dir, try_lock
from exporter.core.selection import Policy
from exporter.launcher.acquire import LocalGpus, acquire
from exporter.launcher.lineage import children
from tests.agent import clean_env, exporter_cli, free_port, http_get, stderr_of
from tests.helpers import as_user, one, samples, until
from tests.test_launcher import NO_GPUS, SLEEPER, start_run

ROOT = os.geteuid() == 0
NOBODY = 65534
#: How this test makes a PID namespace with its own /proc (as root; else in a user namespace).
UNSHARE = ["unshare", "-fp", "--mount-proc"] if ROOT else ["unshare", "-rfp", "--mount-proc"]


def _why_no_namespace() -> str:
    """Why unshare cannot make a PID namespace here ("" when it can)."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    try:
        done = subprocess.run(
            [*UNSHARE, "sh", "-c", "echo $$"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if done.returncode != 0 or done.stdout.strip() != "1":
        return f"unshare cannot make a PID namespace: {done.stderr.strip() or done.stdout}"
    return ""


WHY_NOT = _why_no_namespace()
needs_namespace = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)


def inside(*argv: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    """``argv`` run to its end in a new PID namespace with its own /proc, output captured."""
    return subprocess.run(
        [*UNSHARE, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env=clean_env(TMPDIR=str(tmp)),
    )


def cli_inside(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    """``gpu-exporter ARGS`` in a new PID namespace."""
    return inside(sys.executable, "-m", "exporter", *args, tmp=tmp)


#: Run in a new PID namespace: what held_locks finds there, and whether /proc/locks there has a
#: flock line for the file (it leaves out a lock whose taker it cannot name).
READER = """
import json, os, sys
from exporter.core.locks import held_locks
locks, name = sys.argv[1:]
st = os.stat(os.path.join(locks, name))
key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
lines = [l.split() for l in open("/proc/locks")]
print(json.dumps({
    "pid": os.getpid(),
    "held": held_locks(locks),
    "flock_line": any(len(p) > 5 and p[1] == "FLOCK" and p[5] == key for p in lines),
}))
"""


def read_inside(locks: Path, uuid: str, tmp: Path) -> dict[str, Any]:
    done = inside(sys.executable, "-c", READER, str(locks), f"{uuid}.lock", tmp=tmp)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["pid"] == 1  # it is in a namespace of its own
    return seen


def statuses(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    return {g["uuid"]: g["reserved_by"] for g in json.loads(result.stdout)["gpus"]}


AGENT = (sys.executable, "-m", "exporter", "serve", "--interval", "1s", "--listen")


@contextlib.contextmanager
def agent_inside(tmp: Path, *args: str) -> Iterator[int]:
    """``gpu-exporter serve ARGS`` in a new PID namespace (the network is shared): its port."""
    port = free_port()
    err = tmp / f"serve-{port}.err"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [*UNSHARE, "--kill-child=SIGTERM", *AGENT, f"127.0.0.1:{port}", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=clean_env(TMPDIR=str(tmp)),
        )
    proc.stderr_path = str(err)  # type: ignore[attr-defined]
    try:

        def answers() -> bool:
            assert proc.poll() is None, stderr_of(proc)  # type: ignore[arg-type]
            with contextlib.suppress(OSError):
                return http_get(f"http://127.0.0.1:{port}/healthz")[1].startswith("ok")
            return False

        until(answers, "the agent in its namespace to answer")
        yield port
    finally:
        for pid in children(proc.pid):  # the agent: unshare ignores SIGTERM, and reaps it
            os.kill(pid, signal.SIGTERM)
        try:
            status = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()  # the agent gets SIGTERM as unshare ends (--kill-child)
            proc.wait()
            raise
    assert status == 0, stderr_of(proc)  # type: ignore[arg-type]


# -- a job whose launcher has exited, seen from another PID namespace -----------------------------


@needs_namespace
def test_a_job_whose_launcher_exited_is_reserved_in_another_namespace(host, subreaper, tmp_path):
    scenario, locks = host
    launcher = start_run(scenario, locks, job=SLEEPER)
    try:
        gpu, worker = launcher.stdout.readline().split()
        subreaper.append(int(worker))  # the job: ours once its launcher is gone
        until(lambda: held_locks(str(locks)).get(gpu) == launcher.pid, "the launcher's lock")
    finally:
        launcher.kill()  # SIGKILL: the lock is left to the job, which inherited it
        launcher.wait()
    assert gpu in held_locks(str(locks))  # seen from here still
    lock_dir = ("--simulate", str(scenario), "--lock-dir", str(locks))
    other = next(u for u in statuses(exporter_cli("status", *lock_dir, "--json")) if u != gpu)

    # In a namespace of its own, /proc/locks has no line for the flock; the mark says it is held.
    seen = read_inside(locks, gpu, tmp_path)
    assert not seen["flock_line"], "the kernel showed the flock: this test shows nothing"
    assert seen["held"] == {gpu: UNKNOWN_HOLDER}

    assert statuses(cli_inside("status", *lock_dir, "--json", tmp=tmp_path)) == {
        gpu: UNKNOWN_HOLDER,
        other: None,
    }
    table = cli_inside("status", *lock_dir, tmp=tmp_path)
    assert table.returncode == 0, table.stderr
    assert (
        "reserved by a launcher lock (holder not visible from this PID namespace)" in table.stdout
    )
    busy = cli_inside("recommend", *lock_dir, "--count", "2", tmp=tmp_path)
    assert busy.returncode == NO_GPUS and busy.stdout == ""
    assert f"({gpu}): reserved by a launcher lock" in busy.stderr
    free = cli_inside("recommend", *lock_dir, tmp=tmp_path)
    assert free.returncode == 0 and free.stdout.strip() == other

    # The agent's Collector in such a namespace: gpu_reserved 1, reserved_by 0, left out of
    # /recommend.
    with agent_inside(tmp_path, *lock_dir) as port:
        found = samples(http_get(f"http://127.0.0.1:{port}/metrics")[1].encode())
        assert one(found, "gpu_reserved", uuid=gpu) == 1.0
        assert one(found, "gpu_reserved", uuid=other) == 0.0
        snapshot = json.loads(http_get(f"http://127.0.0.1:{port}/snapshot")[1])
        reserved = {g["uuid"]: (g["reserved_by"], g["reserved_by_user"]) for g in snapshot["gpus"]}
        assert reserved == {gpu: (UNKNOWN_HOLDER, ""), other: (None, "")}
        status, body = http_get(f"http://127.0.0.1:{port}/recommend?count=2")
        assert status == 409 and "reserved by a launcher lock" in body

    os.kill(int(worker), signal.SIGKILL)  # the job ends: the GPU is free everywhere at once
    os.waitpid(int(worker), 0)
    subreaper.remove(int(worker))
    assert held_locks(str(locks)) == {}
    assert read_inside(locks, gpu, tmp_path)["held"] == {}


#: PID 1 of a namespace of its own: starts the launcher (argv), kills it with SIGKILL once its
#: job runs, says the job's line and the launcher's pid, and holds the namespace (the job in it)
#: until its standard input ends; then the kernel ends every process of the namespace.
KEEPER = """
import os, signal, subprocess, sys
launcher = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, text=True)
line = launcher.stdout.readline().strip()
os.kill(launcher.pid, signal.SIGKILL)
launcher.wait()
print(line, launcher.pid, flush=True)
sys.stdin.read()
"""


@needs_namespace
def test_a_job_in_one_namespace_is_reserved_in_another(host, tmp_path):
    scenario, locks = host
    argv = [sys.executable, "-m", "exporter", "run", "--simulate", str(scenario)]
    argv += ["--lock-dir", str(locks), "--", *SLEEPER]
    keeper = subprocess.Popen(
        [*UNSHARE, sys.executable, "-c", KEEPER, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(TMPDIR=str(tmp_path)),
    )
    try:
        gpu, _worker, launcher = keeper.stdout.readline().split()
        assert int(launcher) > 1  # a PID of that namespace, where the launcher is gone now
        assert gpu in held_locks(str(locks))  # seen from here
        seen = read_inside(locks, gpu, tmp_path)  # and from a third namespace
        assert seen["held"] == {gpu: UNKNOWN_HOLDER} and not seen["flock_line"]
        json_status = cli_inside(
            "status", "--simulate", str(scenario), "--lock-dir", str(locks), "--json", tmp=tmp_path
        )
        assert statuses(json_status)[gpu] == UNKNOWN_HOLDER
    finally:
        keeper.stdin.close()  # PID 1 of that namespace exits: the kernel ends the job too
        assert keeper.wait(timeout=20) == 0
    until(lambda: held_locks(str(locks)) == {}, "the job's end to free its GPU")


# -- old and new launchers keep each other off a GPU ----------------------------------------------

#: A launcher as a child process: "new" (try_lock: flock, then the mark) or "old" (what launchers
#: before the mark did: flock alone). Says "ready", waits for a line, tries once, says "won" or
#: "lost", and holds what it won until its standard input ends.
CONTENDER = """
import fcntl, os, sys
from exporter.core.locks import try_lock
kind, locks, uuid = sys.argv[1:]
print("ready", flush=True)
sys.stdin.readline()
if kind == "new":
    held = try_lock(locks, [uuid])
    won = held is not None
else:
    fd = os.open(os.path.join(locks, uuid + ".lock"), os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        won = True
    except BlockingIOError:
        won = False
print("won" if won else "lost", flush=True)
sys.stdin.read()
"""
UUID = "GPU-0f7e1d2c-0000-4000-8000-00000000abcd"


@contextlib.contextmanager
def contenders(locks: Path, *kinds: str) -> Iterator[list[subprocess.Popen[str]]]:
    """One CONTENDER of each kind, all ready; ended and reaped after."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONTENDER, kind, str(locks), UUID],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        for kind in kinds
    ]
    try:
        for proc in procs:
            assert proc.stdout.readline() == "ready\n"
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def go(procs: list[subprocess.Popen[str]]) -> list[str]:
    """Let every contender try at once; what each says."""
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    return [proc.stdout.readline().strip() for proc in procs]


@pytest.mark.parametrize("first", ["old", "new"])
def test_old_and_new_launchers_exclude_each_other(tmp_path, first):
    locks = tmp_path / "locks"
    locks.mkdir()
    second = "new" if first == "old" else "old"
    with contenders(locks, first) as (holder,):
        assert go([holder]) == ["won"]
        assert held_locks(str(locks)) == {UUID: holder.pid}  # the flock line names it here
        assert try_lock(str(locks), [UUID]) is None  # a new launcher: refused
        with contenders(locks, second, "new") as late:
            assert go(late) == ["lost", "lost"]
        marked = held_locks(str(locks), proc_root="/nonexistent")  # the probe alone
        assert marked == ({UUID: UNKNOWN_HOLDER} if first == "new" else {})  # only new ones mark
    assert held_locks(str(locks)) == {}  # the lock and the mark end with the holder


def test_of_launchers_racing_for_one_gpu_exactly_one_wins(tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir()
    for _ in range(3):  # each round starts with no lock file: creating it is part of the race
        with contenders(locks, "old", "new", "old", "new", "new", "old") as racing:
            said = go(racing)
            assert said.count("won") == 1, said
            winner = racing[said.index("won")]
            assert held_locks(str(locks)) == {UUID: winner.pid}
        (locks / f"{UUID}.lock").unlink()


# -- probing takes nothing, from a read-only descriptor -------------------------------------------


def _whole(kind: int) -> bytes:
    return locks_module._FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0)


def test_this_kernel_probes_a_read_lock_from_a_read_only_descriptor(tmp_path):
    # What locks.py relies on, on this kernel: a mark can only be a read lock on a read-only
    # descriptor, and a probe for a write lock from one finds it (a read-lock probe would not).
    if not locks_module.OFD_LOCKS:
        pytest.skip("no OFD locks on this platform")
    held = try_lock(str(tmp_path), [UUID])
    assert held is not None
    try:
        fd = os.open(tmp_path / f"{UUID}.lock", os.O_RDONLY)
        try:
            with pytest.raises(OSError) as refused:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _whole(fcntl.F_WRLCK))
            assert refused.value.errno == errno.EBADF
            answer = locks_module._FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _whole(1)))
            assert (answer[0], answer[4]) == (fcntl.F_RDLCK, -1)  # a read lock, no PID: OFD
            missed = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _whole(fcntl.F_RDLCK))
            assert locks_module._FLOCK.unpack(missed)[0] == fcntl.F_UNLCK
            # the probe took nothing: another open file description still locks as it could
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _whole(fcntl.F_RDLCK))
        finally:
            os.close(fd)
    finally:
        held.release()


def _probe_as_nobody(locks: Path) -> str:
    """What held_locks finds, probing only (no /proc/locks), as uid 65534, who may only read."""

    def probe() -> Any:
        try:
            os.close(os.open(locks / f"{UUID}.lock", os.O_RDWR))
            return "it could open the file for writing"
        except PermissionError:
            return held_locks(str(locks), proc_root="/nonexistent")

    return as_user(NOBODY, probe)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A lock directory others can reach and read (tmp_path's parents are 0700), 1777 like
    /run/gpu-exporter/locks."""
    root = Path(tempfile.mkdtemp(prefix="gpu-exporter-ns-"))
    root.chmod(0o755)
    (root / "locks").mkdir()
    (root / "locks").chmod(0o1777)
    yield root / "locks"
    shutil.rmtree(root, ignore_errors=True)


def test_a_lock_file_the_reader_may_only_read_is_probed(shared):
    if not locks_module.OFD_LOCKS:
        pytest.skip("no OFD locks on this platform")
    with contenders(shared, "new") as (holder,):
        assert go([holder]) == ["won"]
        lock = shared / f"{UUID}.lock"
        if ROOT:  # root's file, 0644, as the agent makes them: others may only read it
            assert os.stat(lock).st_uid == 0
            assert _probe_as_nobody(shared) == repr({UUID: UNKNOWN_HOLDER})
        else:
            lock.chmod(0o444)  # unwritable by its owner too
            assert held_locks(str(shared), proc_root="/nonexistent") == {UUID: UNKNOWN_HOLDER}
        assert held_locks(str(shared)) == {UUID: holder.pid}


# -- without OFD locks, flock alone, as before ----------------------------------------------


@pytest.mark.parametrize("error", [errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP])
def test_a_file_system_without_ofd_locks_still_locks_with_flock(tmp_path, monkeypatch, error):
    real = fcntl.fcntl
    ofd = {fcntl.F_OFD_SETLK, fcntl.F_OFD_GETLK}

    def no_ofd(fd: int, cmd: int, arg: Any = 0) -> Any:
        if cmd in ofd:
            raise OSError(error, os.strerror(error))
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", no_ofd)
    held = try_lock(str(tmp_path), [UUID])
    assert held is not None
    try:
        assert try_lock(str(tmp_path), [UUID]) is None  # another open file description: refused
        assert held_locks(str(tmp_path)) == {UUID: os.getpid()}  # /proc/locks, as before
        assert held_locks(str(tmp_path), proc_root="/nonexistent") == {}  # no mark to probe
    finally:
        held.release()
    assert held_locks(str(tmp_path)) == {}


# -- the launcher's own lock, where /proc/locks does not name it ----------------------------------


def test_the_check_under_the_lock_knows_its_own_marks(host, tmp_path):
    # Without /proc/locks (or with one of another namespace) the launcher's own GPU reads
    # "reserved, holder not visible" under its lock: it must not take that for another's.
    scenario, locks = host
    proc = tmp_path / "proc"  # a /proc without locks
    proc.mkdir()
    with (
        open_lock_dir(str(locks)) as opened,
        LocalGpus(simulate=str(scenario), proc_root=str(proc), lock_dir=opened) as gpus,
    ):
        reservation, chosen = acquire(gpus, Policy("default", count=2), visible_env=None)
        try:
            assert {d.uuid for d in chosen} == set(reservation.uuids)
            assert held_locks(str(locks), proc_root=str(proc)) == dict.fromkeys(
                reservation.uuids, UNKNOWN_HOLDER
            )
        finally:
            reservation.release()
