"""A launcher lock lasts as long as the job, and its lock directory is resolved once.

Processes that a job leaves behind without the lock descriptors (``spawn`` workers, double
forks, children in a new session with their descriptors closed) keep the job's GPU until they
exit, because ``run`` waits for them; a lock directory reached through another user's link, in
any spelling, is refused. Real processes and real locks throughout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from exporter.core.locks import LockError, held_locks, open_lock_dir, try_lock
from exporter.launcher.lineage import descendants
from tests.agent import clean_env
from tests.agent import exporter_cli as cli
from tests.helpers import until
from tests.test_launcher import NO_GPUS, RUN

NOBODY = 65534  # owns the hostile links: neither root nor the caller
#: Job scripts that print their GPU and the pid of a worker they leave behind, then exit 0. The
#: worker holds no lock descriptor: only the launcher's wait keeps the GPU for it.
LEFTOVER_JOBS = {
    "spawn": """
        import multiprocessing, os, time

        def work():
            time.sleep(60)

        if __name__ == "__main__":
            worker = multiprocessing.get_context("spawn").Process(target=work)
            worker.start()
            print(os.environ["CUDA_VISIBLE_DEVICES"], worker.pid, flush=True)
            os._exit(0)  # no join: the worker is left behind
        """,
    "double-fork": """
        import os, time

        read, write = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(write, str(os.getpid()).encode())
                for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
                    if fd > 2:
                        try:
                            os.close(fd)  # the lock descriptors too
                        except OSError:
                            pass
                time.sleep(60)
            os._exit(0)
        os.close(write)
        worker = int(os.read(read, 32))
        os.waitpid(middle, 0)
        print(os.environ["CUDA_VISIBLE_DEVICES"], worker, flush=True)
        """,
    "new-session": """
        import os, subprocess, sys

        worker = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            close_fds=True,
            start_new_session=True,
        )
        print(os.environ["CUDA_VISIBLE_DEVICES"], worker.pid, flush=True)
        """,
}


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def holds_a_lock_file(pid: int, locks: Path) -> bool:
    """``pid`` has a descriptor open on a file in ``locks``."""
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith(f"{locks}/"):
                return True
    return False


@dataclass
class Launch:
    """A running ``gpu-exporter run`` and the file its standard error goes to."""

    proc: subprocess.Popen[str]
    stderr: Path
    workers: list[int] = field(default_factory=list)  # killed at the end, should it fail

    def said(self) -> str:
        return self.stderr.read_text()


@contextlib.contextmanager
def launched(host: tuple[Path, Path], *args: str, job: tuple[str, ...]) -> Iterator[Launch]:
    """``gpu-exporter run ARGS -- JOB`` on the host's simulated GPUs; at the end, what it still
    runs is killed and it is reaped (it reaps its own descendants)."""
    scenario, locks = host
    err = locks.parent / f"run-{time.monotonic_ns()}.err"
    with err.open("w") as handle:
        proc = subprocess.Popen(
            [*RUN, str(scenario), "--lock-dir", str(locks), *args, "--", *job],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=handle,
            text=True,
            env=clean_env(TMPDIR=str(locks.parent)),
        )
    launch = Launch(proc, err)
    try:
        yield launch
    finally:
        running = descendants(proc.pid) if proc.poll() is None else []
        for pid in running + [p for p in launch.workers if alive(p)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)  # it reaps the killed ones, then ends
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def leftover_job(host: tuple[Path, Path], how: str) -> tuple[str, ...]:
    job = host[1].parent / f"job-{how}.py"
    job.write_text(textwrap.dedent(LEFTOVER_JOBS[how]))
    return (sys.executable, str(job))


def started(launch: Launch) -> tuple[str, int]:
    """The GPU and the leftover worker's pid that the job printed."""
    assert launch.proc.stdout is not None
    line = launch.proc.stdout.readline()
    assert line, launch.said()
    gpu, worker = line.split()
    launch.workers.append(int(worker))
    return gpu, int(worker)


def run_on(host: tuple[Path, Path], gpu: str) -> subprocess.CompletedProcess[str]:
    """``gpu-exporter run -- true`` limited to ``gpu``."""
    scenario, locks = host
    return cli(
        "run",
        "--simulate",
        str(scenario),
        "--lock-dir",
        str(locks),
        "--",
        "true",
        env=clean_env(CUDA_VISIBLE_DEVICES=gpu),
    )


# -- the lock lasts until the job's last process exits ---------------------------------------------


@pytest.mark.parametrize("how", list(LEFTOVER_JOBS))
def test_a_leftover_without_the_lock_descriptor_keeps_the_gpu(host, how):
    locks = host[1]
    with launched(host, job=leftover_job(host, how)) as launch:
        gpu, worker = started(launch)
        until(lambda: "leftover process" in launch.said(), "the launcher to wait")
        assert str(worker) in launch.said()
        assert not holds_a_lock_file(worker, locks)  # so only the launcher's wait protects it
        assert launch.proc.poll() is None
        assert held_locks(str(locks)) == {gpu: launch.proc.pid}  # what the agent shows
        assert try_lock(str(locks), [gpu]) is None
        second = run_on(host, gpu)
        assert second.returncode == NO_GPUS, second.stderr
        assert "reserved by a launcher lock" in second.stderr
        os.kill(worker, signal.SIGKILL)
        assert launch.proc.wait(timeout=20) == 0  # the job's main process's status
    assert not alive(worker)
    free = try_lock(str(locks), [gpu])
    assert free is not None
    free.release()
    again = run_on(host, gpu)
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize("when", ["while the job runs", "after the job exited"])
def test_sigterm_reaches_the_processes_the_job_left_behind(host, when):
    locks = host[1]
    job = leftover_job(host, "new-session")  # the worker is out of the job's process group
    if when == "while the job runs":
        job = (*job[:1], "-c", f"exec(open({job[1]!r}).read()); import time; time.sleep(60)")
    with launched(host, job=job) as launch:
        _, worker = started(launch)
        if when == "after the job exited":
            until(lambda: "leftover process" in launch.said(), "the launcher to wait")
        launch.proc.send_signal(signal.SIGTERM)
        status = launch.proc.wait(timeout=20)
        assert not alive(worker)
    assert status == (128 + signal.SIGTERM if when == "while the job runs" else 0)
    assert held_locks(str(locks)) == {}


def test_the_simulations_own_processes_are_not_the_jobs(host):
    scenario, locks = host
    scenario.write_text(
        textwrap.dedent(
            """
            gpus:
              - name: GPU A
                memory_total: 80GiB
                processes:
                  - {spawn: [python3, -c, "import time; time.sleep(60)"], memory: 1GiB}
            """
        )
    )
    with launched(host, job=leftover_job(host, "new-session")) as launch:
        _, worker = started(launch)
        until(lambda: "leftover process" in launch.said(), "the launcher to wait")
        simulated = set(descendants(launch.proc.pid)) - {worker}
        assert simulated, "the scenario's process runs under the launcher"
        assert f"1 leftover process(es) ({worker})" in launch.said()
        os.kill(worker, signal.SIGKILL)
        assert launch.proc.wait(timeout=20) == 0  # without waiting for the simulation's
    assert held_locks(str(locks)) == {}


def test_a_restart_waits_for_what_the_last_attempt_left_behind(host):
    log = host[1].parent / "order"
    job = host[1].parent / "attempt.py"
    job.write_text(
        textwrap.dedent(
            f"""
            import os, subprocess, sys
            with open({str(log)!r}, "a") as out:
                out.write("attempt\\n")
            note = "import time; time.sleep(1); open({str(log)!r}, 'a').write('leftover-done\\\\n')"
            subprocess.Popen([sys.executable, "-c", note], close_fds=True, start_new_session=True)
            sys.exit(1)
            """
        )
    )
    with launched(
        host, "--restart", "on-failure", "--max-restarts", "1", job=(sys.executable, str(job))
    ) as launch:
        assert launch.proc.wait(timeout=30) == 1, launch.said()
    # Its leftover was done before the next attempt started, and before the launcher ended.
    assert log.read_text().split() == ["attempt", "leftover-done", "attempt", "leftover-done"]
    assert launch.said().count("leftover process") == 2


# -- the lock directory is resolved once -----------------------------------------------------------

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a link to another user (lchown) needs root"
)


@pytest.fixture
def links(tmp_path: Path) -> dict[str, Path]:
    """A sticky, world-writable folder (like /tmp) holding ``theirs``, a link of another user,
    and ``mine``, a link of ours, both to ``real``; and ``their-dir``, a folder of that user with
    a ``locks`` folder of ours in it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    other = tmp_path / "other"
    other.mkdir()
    (shared / "theirs").symlink_to(real)
    os.lchown(shared / "theirs", NOBODY, NOBODY)
    (shared / "mine").symlink_to(real)
    their_dir = shared / "their-dir"
    (their_dir / "locks").mkdir(parents=True)
    os.chown(their_dir, NOBODY, NOBODY)
    return {"shared": shared, "real": real, "other": other, "their-dir": their_dir}


def run_in(host: tuple[Path, Path], lock_dir: str) -> subprocess.CompletedProcess[str]:
    return cli("run", "--simulate", str(host[0]), "--lock-dir", lock_dir, "--", "true")


@needs_root
@pytest.mark.parametrize("spelling", ["", "/", "/.", "/./", "//", "/sub/.."])
def test_a_link_of_another_user_is_refused_however_it_is_spelled(host, links, spelling):
    link = links["shared"] / "theirs"
    result = run_in(host, f"{link}{spelling}")
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"gpu-exporter: {link} ")
    assert f"is a symbolic link of another user (uid {NOBODY})" in result.stderr
    assert "Traceback" not in result.stderr
    with pytest.raises(LockError, match="symbolic link of another user"):
        try_lock(f"{link}{spelling}", ["GPU-x"])
    assert not list(links["real"].rglob("*.lock"))


@needs_root
def test_a_link_of_another_user_further_up_the_path_is_refused(host, links):
    (links["real"] / "locks").mkdir()
    path = links["shared"] / "theirs" / "locks"
    result = run_in(host, str(path))
    assert result.returncode == 1
    assert f"{links['shared'] / 'theirs'} (on the way to {path}) is a symbolic link" in (
        result.stderr
    )


@needs_root
def test_a_directory_of_another_user_on_the_way_is_refused(host, links):
    path = links["their-dir"] / "locks"
    result = run_in(host, f"{path}/")
    assert result.returncode == 1
    assert f"{links['their-dir']}, on the way to the lock directory {path}/, belongs to" in (
        result.stderr
    )
    assert f"another user (uid {NOBODY})" in result.stderr


@needs_root
@pytest.mark.parametrize("spelling", ["", "/", "/.", "/sub/.."])
def test_a_link_of_the_caller_is_fine(host, links, spelling):
    result = run_in(host, f"{links['shared'] / 'mine'}{spelling}")
    assert result.returncode == 0, result.stderr
    assert list(links["real"].glob("GPU-*.lock"))


def test_dot_dot_after_a_link_is_the_parent_of_its_target(tmp_path):
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real / "sub")
    with open_lock_dir(f"{tmp_path / 'link'}/..") as opened:
        assert os.fstat(opened.fd).st_ino == real.stat().st_ino


def test_repointing_the_path_later_changes_nothing(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    link = tmp_path / "link"
    link.symlink_to(first)
    with open_lock_dir(f"{link}/") as opened:
        link.unlink()
        link.symlink_to(second)
        held = try_lock(opened, ["GPU-x"])
        assert held is not None
        try:
            assert [p.name for p in first.iterdir()] == ["GPU-x.lock"]
            assert list(second.iterdir()) == []
            assert held_locks(opened) == {"GPU-x": os.getpid()}
            assert held_locks(str(second)) == {}
        finally:
            held.release()


def test_unsafe_lock_directories_still_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(LockError, match="is writable by other users and not sticky"):
        open_lock_dir(f"{open_dir}/.")
    (open_dir / "locks").mkdir()
    with pytest.raises(LockError, match=r"open, on the way to .* is writable by other users"):
        open_lock_dir(str(open_dir / "locks"))
    (tmp_path / "file").write_text("")
    with pytest.raises(LockError, match=r"file: Not a directory"):
        open_lock_dir(f"{tmp_path / 'file'}/.")
    with pytest.raises(LockError, match=r"nothing: No such file or directory"):
        open_lock_dir(str(tmp_path / "open" / ".." / "nothing" / ".."))
