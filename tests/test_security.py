"""Least privilege and secrets (docs/security.md): command lines stay private by default, the
lock directory and the audit log resist another local user, and missing capabilities are said.

The attacks are real: a forked child drops to uid 65534 (``nobody``) and plants links, FIFOs and
files, or holds locks, in a root-owned sticky directory like ``/run/gpu-exporter/locks``. They
need root to change user, and skip without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.actions.audit import AuditLog
from exporter.config.yamlconf import ConfigError
from exporter.core import locks as locks_module
from exporter.core import privileges
from exporter.core.locks import LockError, default_lock_dir, held_locks, try_lock
from tests.agent import exporter_cli as cli
from tests.agent import healthz_until, http_get, serve
from tests.helpers import agent_config, as_user, one, samples, until, write
from tests.test_reaper import (
    alive,
    audit_lines,
    make_reaper,
    orphaned,
    scenario,
    start_job,
    wait_exited,
)

NOBODY, OTHER = 65534, 65533  # the attacker, and a second ordinary user
UUID = "GPU-5ec0417e-0000-4000-8000-000000000001"
SECRET = "s3cr3t-hunter2"
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="changing to another user needs root")
PR_CAPBSET_DROP = 24


# -- helpers --------------------------------------------------------------------------------------


def attacker(action: Callable[[], Any]) -> None:
    """``action`` done by the attacker (uid 65534), which must succeed."""
    answer = as_user(NOBODY, lambda: (action(), "done")[1])
    assert answer == "'done'", f"the attack itself failed: {answer}"


@contextlib.contextmanager
def held_by(uid: int, lock_dir: Path, uuid: str) -> Iterator[int]:
    """A child of ``uid`` that takes the launcher lock of ``uuid`` and holds it; yields its pid."""
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(stop_w)  # or the read below would never see the end of the pipe
            os.close(ready_r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            held = try_lock(str(lock_dir), [uuid])
            os.write(ready_w, b"locked" if held else b"busy")
            os.read(stop_r, 1)  # until the test closes its end
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(stop_r)
    try:
        assert os.read(ready_r, 16) == b"locked"
        yield pid
    finally:
        os.close(stop_w)
        os.close(ready_r)
        os.waitpid(pid, 0)


@contextlib.contextmanager
def deadline(seconds: int = 5) -> Iterator[None]:
    """Fail (instead of hanging) when the block takes longer than ``seconds``."""

    def expired(signum: int, frame: Any) -> None:
        raise AssertionError(f"blocked for more than {seconds}s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def identity(path: Path) -> tuple[int, int, int, int, str]:
    info = os.lstat(path)
    return (info.st_mode, info.st_uid, info.st_size, info.st_mtime_ns, path.read_text())


@pytest.fixture
def shared() -> Iterator[Path]:
    """A world-readable folder with ``locks``, root-owned and 1777 like /run/gpu-exporter/locks,
    and ``victim``, a private root-owned file. (tmp_path's parents are 0700: no use to others.)"""
    root = Path(tempfile.mkdtemp(prefix="gpu-exporter-security-"))
    root.chmod(0o755)
    (root / "locks").mkdir()
    (root / "locks").chmod(0o1777)
    (root / "victim").write_text("precious")
    (root / "victim").chmod(0o600)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _drop_bounding(*caps: int) -> Callable[[], None]:
    """A preexec_fn: drop ``caps`` from the bounding set, so that root exec()s without them."""

    def drop() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in caps:
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")

    return drop


@contextlib.contextmanager
def agent(
    tmp_path: Path, *args: str, preexec: Callable[[], None] | None = None
) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    """``gpu-exporter serve ARGS`` on a free loopback port (optionally with a preexec_fn), once
    /healthz says ok; yields the process, its port and its stderr file."""
    with serve(tmp_path, *args, preexec_fn=preexec) as (proc, port):
        healthz_until(proc, port)
        yield proc, port, Path(proc.stderr_path)  # type: ignore[attr-defined]


def get(port: int, path: str) -> str:
    status, body = http_get(f"http://127.0.0.1:{port}{path}")
    assert status == 200, (path, status, body)
    return body


def snapshot_processes(port: int) -> list[dict[str, Any]]:
    data = json.loads(get(port, "/snapshot"))
    return [proc for gpu in data["gpus"] for proc in gpu["processes"] or ()]


# -- command lines --------------------------------------------------------------------------------

#: A GPU with a process whose command line holds a secret, as a token given on the command line.
SECRET_SCENARIO = f"""
gpus:
  - name: GPU A
    uuid: {UUID}
    processes:
      - spawn: [python3, -c, "import time; time.sleep(60)", train.py, "--token={SECRET}"]
        memory: 1GiB
"""


def test_expose_cmdline_setting(tmp_path: Path) -> None:
    assert agent_config(None, environ={}).expose_cmdline is False
    path = write(tmp_path, "expose_cmdline: true\n")
    assert agent_config(path, environ={}).expose_cmdline is True
    env = {"GPU_EXPORTER_EXPOSE_CMDLINE": "false"}
    assert agent_config(path, environ=env).expose_cmdline is False
    assert agent_config(path, {"expose_cmdline": "no"}, environ={}).expose_cmdline is False
    assert agent_config(None, {"expose_cmdline": "true"}, environ={}).expose_cmdline is True
    bad = write(tmp_path, "expose_cmdline: sometimes\n", "bad.yaml")
    with pytest.raises(ConfigError, match=r"bad.yaml:1.*expected true or false"):
        agent_config(bad, environ={})
    result = cli("status", "--simulate", "--expose-cmdline", "maybe")
    assert result.returncode == 2
    assert "--expose-cmdline: expected true or false, got 'maybe'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_secret_in_argv_is_nowhere_by_default(tmp_path: Path) -> None:
    scenario_file = write(tmp_path, SECRET_SCENARIO, "secret.yaml")
    with agent(tmp_path, "--simulate", scenario_file, "--interval", "0.2") as (_, port, err):
        (proc,) = until(lambda: snapshot_processes(port), what="the spawned process")
        assert proc["visible"] and proc["name"] and proc["cmdline"] == []
        bodies = {path: get(port, path) for path in ("/metrics", "/snapshot", "/", "/healthz")}
        bodies["/recommend"] = http_get(f"http://127.0.0.1:{port}/recommend")[1]
        metrics = samples(bodies["/metrics"].encode())
        name = proc["name"]
        pid = str(proc["pid"])
        assert one(metrics, "gpu_process_memory_used_bytes", pid=pid, process=name) == 1024**3
        for path, body in bodies.items():
            assert SECRET not in body, path
        assert SECRET not in err.read_text()
    for args in (("status",), ("status", "--json")):
        result = cli(*args, "--simulate", scenario_file)
        assert result.returncode == 0, result.stderr
        assert "python" in result.stdout  # the process is there, by name
        assert SECRET not in result.stdout + result.stderr, args


def test_expose_cmdline_shows_it_and_a_reload_hides_it_again(tmp_path: Path) -> None:
    scenario_file = write(tmp_path, SECRET_SCENARIO, "secret.yaml")
    config = write(tmp_path, "expose_cmdline: true\n")
    status = cli("status", "--json", "--simulate", scenario_file, "--config", config)
    assert f"--token={SECRET}" in status.stdout, status.stderr
    args = ("--simulate", scenario_file, "--interval", "0.2", "--config", config)
    with agent(tmp_path, *args) as (proc, port, err):
        (shown,) = until(lambda: snapshot_processes(port), what="the spawned process")
        assert shown["cmdline"][-1] == f"--token={SECRET}"
        write(tmp_path, "expose_cmdline: false\n")
        proc.send_signal(signal.SIGHUP)
        until(lambda: snapshot_processes(port)[0]["cmdline"] == [], what="the reload")
        assert SECRET not in get(port, "/snapshot")
        assert "config reloaded" in err.read_text()
        assert "only after a restart" not in err.read_text()


# -- the lock directory ---------------------------------------------------------------------------


@needs_root
def test_a_link_planted_at_a_lock_name_is_never_followed(shared: Path) -> None:
    victim = shared / "victim"
    before = identity(victim)
    lock = shared / "locks" / f"{UUID}.lock"
    attacker(lambda: os.symlink(victim, lock))
    with pytest.raises(LockError, match="is a symbolic link; refusing to use it"):
        try_lock(str(shared / "locks"), [UUID])
    assert identity(victim) == before
    assert held_locks(str(shared / "locks")) == {}


def _plant(kind: str, shared: Path) -> Callable[[], Any]:
    lock = shared / "locks" / f"{UUID}.lock"
    fifo = shared / "locks" / "fifo"
    plants: dict[str, Callable[[], Any]] = {
        "a link to a directory": lambda: os.symlink(shared, lock),
        "a link to /dev/zero": lambda: os.symlink("/dev/zero", lock),
        "a link to a FIFO": lambda: (os.mkfifo(fifo), os.symlink(fifo, lock)),
        "a FIFO": lambda: os.mkfifo(lock),
        "a directory": lambda: os.mkdir(lock),
    }
    return plants[kind]


@needs_root
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("a link to a directory", "is a symbolic link"),
        ("a link to /dev/zero", "is a symbolic link"),
        ("a link to a FIFO", "is a symbolic link"),
        ("a FIFO", "is not a regular file"),
        ("a directory", "is not a regular file"),
    ],
)
def test_other_things_planted_at_a_lock_name_are_refused_at_once(
    shared: Path, kind: str, message: str
) -> None:
    attacker(_plant(kind, shared))
    with deadline(5), pytest.raises(LockError, match=message):
        try_lock(str(shared / "locks"), [UUID])


@needs_root
@pytest.mark.parametrize("mode", [0o600, 0o000])
def test_a_lock_file_of_the_attacker_never_books_a_gpu_twice(shared: Path, mode: int) -> None:
    locks = shared / "locks"
    lock = locks / f"{UUID}.lock"
    attacker(lambda: os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)))
    assert os.lstat(lock).st_uid == NOBODY
    # Another ordinary user cannot open it: a clear refusal, naming the owner.
    refused = as_user(OTHER, lambda: try_lock(str(locks), [UUID]))
    assert refused.startswith("LockError: cannot open"), refused
    assert "Permission denied" in refused and f"owner uid {NOBODY}, mode {mode:04o}" in refused
    # Root can: it locks correctly, and then nobody else gets that GPU.
    held = try_lock(str(locks), [UUID])
    assert held is not None
    try:
        assert held_locks(str(locks)) == {UUID: os.getpid()}
        assert try_lock(str(locks), [UUID]) is None
        # its owner neither: taken (0600), or not even openable by it (0000)
        assert as_user(NOBODY, lambda: try_lock(str(locks), [UUID])) in (
            "None",
            f"LockError: cannot open {lock}: Permission denied (owner uid {NOBODY}, mode 0000)",
        )
    finally:
        held.release()


@needs_root
def test_a_lock_file_replaced_between_open_and_flock_is_not_trusted(
    shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    locks = shared / "locks"
    lock = locks / f"{UUID}.lock"
    attacker(lambda: os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)))
    real_flock, raced = fcntl.flock, []

    def replace_then_flock(fd: int, operation: int) -> None:
        if not raced:  # the attacker removes its file and makes a new one in between, once
            raced.append(fd)
            attacker(
                lambda: (
                    os.unlink(lock),
                    os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)),
                )
            )
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", replace_then_flock)
    held = try_lock(str(locks), [UUID])
    monkeypatch.undo()
    assert raced and held is not None
    try:
        # The lock is on the file the name now stands for, so the next launcher sees it taken.
        assert os.fstat(held.fds[0]).st_ino == os.lstat(lock).st_ino
        assert try_lock(str(locks), [UUID]) is None
    finally:
        held.release()


@needs_root
def test_root_owned_lock_files_cannot_be_removed_by_users_and_still_work(shared: Path) -> None:
    # The remedy docs/launcher.md gives for lock files that their creator could remove.
    locks = shared / "locks"
    lock = locks / f"{UUID}.lock"
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_RDONLY, 0o644))
    assert as_user(NOBODY, lambda: os.unlink(lock)).startswith("PermissionError")
    with held_by(NOBODY, locks, UUID) as holder:
        assert held_locks(str(locks)) == {UUID: holder}
        assert try_lock(str(locks), [UUID]) is None
    assert os.lstat(lock).st_uid == 0


@needs_root
def test_the_agent_makes_each_gpus_lock_file_and_names_one_a_user_made(
    shared: Path, simulated: Callable[[str], Any], clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Closes the gap above for good: the agent (root here) makes the lock files, so no user can
    # remove one while another user's job holds it; one a user made first is pointed out.
    from exporter.core.nvml import Nvml
    from exporter.core.procfs import ProcFs
    from exporter.sampling.collect import Collector

    locks = shared / "locks"
    other = "GPU-5ec0417e-0000-4000-8000-000000000002"
    attacker(lambda: os.close(os.open(locks / f"{other}.lock", os.O_CREAT | os.O_RDONLY, 0o644)))
    driver = simulated(f"gpus: [{{uuid: {UUID}}}, {{uuid: {other}}}]\n")
    collector = Collector(
        Nvml(library=driver),
        ProcFs("/proc"),
        monotonic=clock,
        lock_dir=str(locks),
        provision_locks=True,  # as the agent's
    )
    try:
        with caplog.at_level(logging.WARNING, logger="exporter.sampling.collect"):
            collector.sample()
            collector.sample()  # once per GPU, not once per sample
    finally:
        collector.close()
    made = locks / f"{UUID}.lock"
    assert os.lstat(made).st_uid == 0 and stat.S_IMODE(os.lstat(made).st_mode) == 0o644
    assert as_user(NOBODY, lambda: os.unlink(made)).startswith("PermissionError")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"{other}.lock belongs to uid {NOBODY}, who can remove it" in warnings[0]
    with held_by(NOBODY, locks, UUID) as holder:  # users still lock the agent's files
        assert held_locks(str(locks)) == {UUID: holder}


@needs_root
def test_a_gpu_locked_by_the_attacker_is_taken_for_everyone(shared: Path, tmp_path: Path) -> None:
    locks = shared / "locks"
    scenario_file = write(tmp_path, f"gpus: [{{uuid: {UUID}}}]\n", "one.yaml")
    with held_by(NOBODY, locks, UUID) as holder:
        assert held_locks(str(locks)) == {UUID: holder}
        run = cli("run", "--simulate", scenario_file, "--lock-dir", str(locks), "--", "true")
        assert run.returncode == 75, run.stderr
        assert f"GPU 0 ({UUID}): reserved by a launcher lock" in run.stderr
        assert "Traceback" not in run.stderr
        assert try_lock(str(locks), [UUID]) is None
    free = try_lock(str(locks), [UUID])  # the attacker is gone: so is its lock
    assert free is not None
    free.release()


@needs_root
@pytest.mark.parametrize(
    "case", ["world-writable, not sticky", "the attacker's directory", "the attacker's link"]
)
def test_an_unsafe_lock_directory_is_refused(shared: Path, tmp_path: Path, case: str) -> None:
    locks = shared / "locks"
    if case == "world-writable, not sticky":
        locks.chmod(0o777)
        target, message = locks, "is writable by other users and not sticky"
    elif case == "the attacker's directory":
        target, message = locks / "mine", f"belongs to another user \\(uid {NOBODY}\\)"
        attacker(lambda: (os.mkdir(target), os.chmod(target, 0o1777)))
    else:
        safe = shared / "safe"
        safe.mkdir()
        target, message = locks / "link", "symbolic link of another user|Permission denied"
        attacker(lambda: os.symlink(safe, target))
    with pytest.raises(LockError, match=message):
        try_lock(str(target), [UUID])
    assert not list(Path(target).glob("*.lock"))
    scenario_file = write(tmp_path, f"gpus: [{{uuid: {UUID}}}]\n", "one.yaml")
    run = cli("run", "--simulate", scenario_file, "--lock-dir", str(target), "--", "true")
    assert run.returncode == 1, run.stderr
    assert run.stderr.startswith("gpu-exporter: "), run.stderr
    assert "Traceback" not in run.stderr


@needs_root
@pytest.mark.parametrize("kind", ["a directory", "a link to its directory", "a link to root's"])
def test_a_per_user_directory_made_by_the_attacker_is_refused(
    shared: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    tmp = shared / "locks"  # root-owned and 1777, as /tmp
    monkeypatch.setattr(locks_module, "USER_TMP", str(tmp))
    monkeypatch.setattr(locks_module, "_ensure_system_dir", lambda: False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    mine = tmp / f"gpu-exporter-{os.getuid()}"
    owned = tmp / "attackers"
    roots = shared / "roots"
    roots.mkdir()
    plant = {
        "a directory": lambda: (os.mkdir(mine), os.chmod(mine, 0o777)),
        "a link to its directory": lambda: (os.mkdir(owned), os.symlink(owned, mine)),
        "a link to root's": lambda: os.symlink(roots, mine),
    }[kind]
    attacker(plant)
    with pytest.raises(LockError, match=r"is not a private directory of this user|cannot make"):
        default_lock_dir()
    assert not (roots / "locks").exists() and not (owned / "locks").exists()


@needs_root
def test_the_per_user_directory_is_private_when_nobody_got_there_first(
    shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(locks_module, "USER_TMP", str(shared / "locks"))
    monkeypatch.setattr(locks_module, "_ensure_system_dir", lambda: False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    path = Path(default_lock_dir())
    assert path == shared / "locks" / f"gpu-exporter-{os.getuid()}" / "locks"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_a_link_in_the_lock_directory_does_not_shield_a_gpus_holders_from_the_reaper(
    simulated,
    collector,
    clock,
    dev,
    tmp_path,
    subreaper,
) -> None:
    # Anyone may plant a link in the shared lock directory; one to the GPU's device node must not
    # make every holder of that GPU look like a launcher's job (skipped as launcher_lock).
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / f"{UUID}.lock").symlink_to(f"{dev}/nvidia0")
    job = start_job(subreaper, f"{dev}/nvidia0")
    simulated(scenario(job.listed()))
    reaper = make_reaper(dev, tmp_path)
    reaper.lock_dir = str(locks)
    orphaned(reaper, collector, clock, job)
    events = [(e["event"], e.get("class"), e.get("reason")) for e in audit_lines(tmp_path)]
    assert events == [("found", "orphan", None), ("skipped", "orphan", "dry_run")], events
    reaper.close()


# -- the audit log --------------------------------------------------------------------------------


def test_the_audit_log_is_created_0600_even_with_umask_000(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    old = os.umask(0)
    try:
        log = AuditLog(str(path))
        assert log.write({"event": "x"}) is True
        log.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_an_audit_log_with_a_wider_mode_is_narrowed_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text('{"old": 1}\n')
    path.chmod(0o644)
    log = AuditLog(str(path))
    with caplog.at_level(logging.WARNING):
        assert log.write({"event": "x"}) is True
    log.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "was mode 0644; made it 0600" in caplog.text
    assert len(path.read_text().splitlines()) == 2  # appended, never truncated


@needs_root
@pytest.mark.parametrize("kind", ["a link to a victim file", "a FIFO", "the attacker's own file"])
def test_what_another_user_plants_at_the_audit_path_is_refused(shared: Path, kind: str) -> None:
    path = shared / "locks" / "audit.jsonl"  # a directory others can write to
    victim = shared / "victim"
    before = identity(victim)
    plant = {
        "a link to a victim file": lambda: os.symlink(victim, path),
        "a FIFO": lambda: os.mkfifo(path, 0o666),
        "the attacker's own file": lambda: (path.write_text("forged\n"), path.chmod(0o666)),
    }[kind]
    attacker(plant)
    log = AuditLog(str(path))
    with deadline(5):
        assert log.write({"event": "x"}) is False
    assert log.failures == 1
    assert identity(victim) == before
    if kind == "the attacker's own file":
        assert path.read_text() == "forged\n"


# -- capabilities ---------------------------------------------------------------------------------


def test_effective_capabilities_are_read_from_proc_status(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapInh:\t0\nCapEff:\t0000000000080024\nCapBnd:\tffff\n")
    assert privileges.effective(str(status)) == {
        "CAP_KILL",
        "CAP_SYS_PTRACE",
        "CAP_DAC_READ_SEARCH",
    }
    status.write_text("CapEff:\t0000000000000020\n")
    assert privileges.effective(str(status)) == {"CAP_KILL"}
    status.write_text("Name:\tx\n")
    assert privileges.effective(str(status)) is None
    assert privileges.effective(str(tmp_path / "missing")) is None
    everything = frozenset(privileges.CAPABILITIES)
    assert privileges.reaper_warnings(False, everything) == []
    assert privileges.reaper_warnings(True, frozenset()) != []  # the fd scan needs two
    (kill,) = privileges.reaper_warnings(False, everything - {"CAP_KILL"})
    assert "lacks CAP_KILL" in kill
    (scan,) = privileges.reaper_warnings(True, everything - {"CAP_SYS_PTRACE"})
    assert "lacks CAP_SYS_PTRACE" in scan and "unverifiable" in scan
    assert privileges.reaper_warnings(True, everything - {"CAP_DAC_READ_SEARCH"}) == []
    (listing,) = privileges.reaper_warnings(
        True, everything - {"CAP_DAC_READ_SEARCH", "CAP_DAC_OVERRIDE"}
    )
    assert "lacks CAP_DAC_READ_SEARCH:" in listing
    assert privileges.reaper_warnings(False, None) == []


def _foreign_job(pids: list[int], device: str, uid: int) -> tuple[int, int, Callable[[], None]]:
    """A job whose worker runs as ``uid``: its leader (root) holds ``device`` open, and so does
    the worker. Returns the leader's and the worker's pids and what ends the leader (the test
    process is a subreaper: the worker's parent then)."""
    read, write_end = os.pipe()
    hold_read, hold_write = os.pipe()  # the leader lives until the test closes hold_write
    leader = os.fork()
    if leader == 0:
        code = 1
        try:
            os.close(read)
            os.close(hold_write)
            os.setsid()
            held = os.open(device, os.O_RDONLY)
            worker = os.fork()
            if worker == 0:
                fd = os.open(device, os.O_RDONLY)  # opened as root, held as uid
                os.set_inheritable(fd, True)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.execvp("sleep", ["sleep", "60"])
            os.write(write_end, f"{worker}\n".encode())
            os.read(hold_read, 1)  # until the test ends the job
            os.close(held)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write_end)
    os.close(hold_read)
    with os.fdopen(read) as pipe:
        pid = int(pipe.readline())
    pids.extend((pid, leader))
    until(lambda: _holds(pid, device), what="the worker to hold the device")

    def end() -> None:
        os.close(hold_write)
        os.waitpid(leader, 0)

    return leader, pid, end


def capability(metrics: dict[str, list[Any]], name: str) -> float:
    """The value of ``gpu_exporter_capability{name=NAME}`` (helpers.one takes ``name`` itself)."""
    (value,) = [s.value for s in metrics["gpu_exporter_capability"] if s.labels["name"] == name]
    return value


def _refused(port: int) -> dict[str, list[Any]] | None:
    """The agent's metrics once the reaper has counted a refused signal."""
    metrics = samples(get(port, "/metrics").encode())
    actions = metrics.get("gpu_exporter_zombie_actions_total", [])
    return metrics if any(s.labels["outcome"] == "error" for s in actions) else None


def _reaper_runs(port: int) -> float:
    metrics = samples(get(port, "/metrics").encode())
    runs = metrics.get("gpu_exporter_action_runs_total", [])
    return sum(s.value for s in runs if s.labels["action"] == "zombie_reaper")


def _holds(pid: int, device: str) -> bool:
    with contextlib.suppress(OSError):
        return any(
            os.readlink(f"/proc/{pid}/fd/{fd}") == device for fd in os.listdir(f"/proc/{pid}/fd")
        )
    return False


@needs_root
def test_an_agent_without_cap_kill_says_so_and_audits_the_refused_signal(
    tmp_path: Path,
    dev: str,
    subreaper: list[int],
) -> None:
    leader, pid, end_job = _foreign_job(subreaper, f"{dev}/nvidia0", NOBODY)
    listed = f"{{pid: {leader}, memory: 1GiB}}, {{pid: {pid}, memory: 1GiB}}"
    scenario_file = write(
        tmp_path, f"gpus:\n  - minor_number: 0\n    processes: [{listed}]\n", "orphan.yaml"
    )
    audit = tmp_path / "audit.jsonl"
    config = write(
        tmp_path,
        f"""
        actions:
          zombie_reaper:
            every: 0.3s
            dry_run: false
            min_age: 0s
            protect_users: []
            audit_log: {audit}
        """,
    )
    args = ("--simulate", scenario_file, "--dev", dev, "--config", config, "--interval", "0.2")
    without_kill = _drop_bounding(privileges.CAPABILITIES["CAP_KILL"])
    with agent(tmp_path, *args, preexec=without_kill) as (_, port, err):
        until(lambda: _reaper_runs(port) >= 2, what="the reaper to see the job's leader")
        end_job()  # the reaper sees it exit: its worker is an orphan on the reaper's evidence
        metrics = until(lambda: _refused(port), what="the refused signal")
        log = err.read_text()
    assert capability(metrics, "CAP_KILL") == 0
    assert capability(metrics, "CAP_SYS_PTRACE") == 1
    assert one(metrics, "gpu_exporter_zombie_actions_total", action="signal", outcome="error") == 1
    assert log.count("lacks CAP_KILL") >= 2  # at start, and when the signal was refused
    start_line = next(line for line in log.splitlines() if "dry_run: false" in line)
    assert "WARNING" in start_line and "can signal only processes of its own user" in start_line
    assert f"cannot send SIGTERM to orphan pid {pid}: Operation not permitted" in log
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    mine = [e for e in events if e.get("pid") == pid]
    assert [e["event"] for e in mine][:3] == ["found", "signalling", "signal_failed"], mine
    assert mine[2]["error"] == "Operation not permitted" and mine[2]["signal"] == "SIGTERM"
    assert sum(e["event"] == "signalling" for e in mine) == 1  # not tried again every run
    assert alive(pid)


def test_an_agent_without_the_fd_capabilities_says_other_users_are_unverifiable(
    tmp_path: Path,
) -> None:
    caps = privileges.CAPABILITIES
    fd_caps = ("CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_DAC_OVERRIDE")
    drop = _drop_bounding(*(caps[name] for name in fd_caps)) if ROOT else None
    config = write(tmp_path, "actions: {zombie_reaper: {every: 1h}}\n")
    with agent(tmp_path, "--simulate", "--config", config, preexec=drop) as (_, port, err):
        metrics = samples(get(port, "/metrics").encode())
        log = err.read_text()
    assert capability(metrics, "CAP_SYS_PTRACE") == 0
    assert capability(metrics, "CAP_DAC_READ_SEARCH") == 0
    (line,) = [
        line for line in log.splitlines() if "lacks CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE" in line
    ]
    assert "WARNING" in line and "other users' processes will be unverifiable" in line
    assert "lacks CAP_KILL" not in log  # dry run: signalling is not asked for
    kill_config = write(
        tmp_path,
        f"actions: {{zombie_reaper: {{dry_run: false, audit_log: {tmp_path / 'a.jsonl'}}}}}\n",
        "kill.yaml",
    )
    no_kill = _drop_bounding(caps["CAP_KILL"]) if ROOT else None
    checked = cli("check-config", kill_config, preexec_fn=no_kill)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout == f"{kill_config}: ok\n"
    assert "lacks CAP_KILL" in checked.stderr


def test_a_refused_sigkill_is_audited_logged_counted_and_not_repeated(
    simulated,
    collector,
    clock,
    dev,
    tmp_path,
    subreaper,
    monkeypatch,
    caplog,
) -> None:
    import exporter.actions.reaper.action as reaper_module

    job = start_job(subreaper, f"{dev}/nvidia0", ignore_term=True)
    pid = job.worker
    simulated(scenario(job.listed()))
    reaper = make_reaper(dev, tmp_path, dry_run=False, grace_period=0)
    orphaned(reaper, collector, clock, job)  # SIGTERM, which it ignores
    real = reaper_module.signal.pidfd_send_signal

    def refuse_sigkill(fd: int, signum: int, *args: Any) -> None:
        if signum == signal.SIGKILL:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        real(fd, signum, *args)

    monkeypatch.setattr(reaper_module.signal, "pidfd_send_signal", refuse_sigkill)
    with caplog.at_level(logging.ERROR):
        for step in (1, 60, 60):  # SIGKILL refused; then past min_age, seen as an orphan again
            clock.advance(step)
            reaper.run([collector.sample()], clock.now)
    events = [(e["event"], e.get("signal")) for e in audit_lines(tmp_path)]
    assert events[:4] == [
        ("found", None),
        ("signalling", "SIGTERM"),
        ("signalling", "SIGKILL"),
        ("signal_failed", "SIGKILL"),
    ], events
    assert ("signalling", "SIGKILL") not in events[4:]  # given up, not retried every run
    assert reaper.actions_total[("signal", "error")] == 1
    assert ("signal", "sigkill") not in reaper.actions_total
    assert reaper.actions_total[("skip", "signal_failed")] >= 1
    assert f"cannot send SIGKILL to orphan pid {pid}: Operation not permitted" in caplog.text
    assert alive(pid)
    reaper.close()
    os.kill(pid, signal.SIGKILL)
    wait_exited(pid)
