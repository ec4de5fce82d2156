"""A real one-node Slurm cluster on loopback, for tests: munged, slurmctld and slurmd as child
processes in the foreground, every file of theirs (munge key, seed and socket, slurm.conf,
cgroup.conf, gres.conf, spool and state directories, logs, pid files) in one directory, on ports
nothing listens on; the client commands find it through ``SLURM_CONF``. :meth:`Cluster.stop`
cancels every job, stops the daemons and says what it found still running (it kills that)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.agent import clean_env, free_port, stop

#: What the cluster runs (Debian's slurmd, slurmctld, slurm-client and munge packages).
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")
#: proctrack/cgroup's hierarchy with cgroup/v1: every process of a job is in it.
FREEZER = Path("/sys/fs/cgroup/freezer")
_SLURM_COMMS = ("slurmd", "slurmctld", "slurmstepd")


class ClusterDown(Exception):
    """The cluster did not come up; the message has the end of its logs."""


def node_name() -> str:
    """This host's name as slurmd takes it (the short one)."""
    return socket.gethostname().split(".")[0]


def unusable() -> str:
    """Why no cluster can run here ("" when one can)."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as their users and makes their cgroups)"
    missing = [name for name in PROGRAMS if shutil.which(name) is None]
    if missing:
        return (
            f"needs {', '.join(missing)}: Debian's slurmd, slurmctld and munge "
            "(test.sh installs them as root)"
        )
    if not (FREEZER / "tasks").is_file():
        return f"needs a cgroup v1 freezer hierarchy at {FREEZER} (proctrack/cgroup, cgroup/v1)"
    running = [f"{comm} ({pid})" for pid, comm, _ in processes() if comm in _SLURM_COMMS]
    if running:
        return f"Slurm already runs here, its cgroups would be this test's: {', '.join(running)}"
    return ""


def processes() -> Iterator[tuple[int, str, str]]:
    """(pid, comm, state) of every process of this host."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                head, tail = handle.read().rsplit(b")", 1)
        except (OSError, ValueError):
            continue
        comm = head.split(b"(", 1)[1].decode(errors="replace")
        yield int(name), comm, tail.split()[0].decode()


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return b""


class Cluster:
    """One node (this host, ``node_name()``) with ``gres_files`` as its ``gpu`` GRES, their
    numbers in the files' order; ``prolog`` and ``epilog`` run at each job's allocation and end
    (``PrologFlags=Alloc``)."""

    def __init__(
        self, root: Path, gres_files: list[Path], prolog: Path, epilog: Path, cpus: int = 8
    ) -> None:
        self.root = root
        self.node = node_name()
        self.conf = root / "etc" / "slurm.conf"
        self.logs_dir = root / "log"
        self.munge_socket = root / "run" / "munge.socket"
        self.env = clean_env(SLURM_CONF=str(self.conf))
        self.daemons: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._outputs: list[Any] = []
        self._stopped: list[str] | None = None
        for sub in ("etc", "log", "run", "munge", "state", "spool"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o700)  # munged wants its key and seed to itself
        (root / "run").chmod(0o755)  # and its socket's directory open to every user
        self._write_config(gres_files, prolog, epilog, cpus)

    # -- configuration -------------------------------------------------------------------------

    def _write_config(self, gres_files: list[Path], prolog: Path, epilog: Path, cpus: int) -> None:
        root, node = self.root, self.node
        names = sorted(path.name for path in gres_files)
        folder = gres_files[0].parent
        assert all(path.parent == folder for path in gres_files), gres_files
        assert names == [f"nvidia{n}" for n in range(len(names))], names
        self.conf.write_text(
            f"ClusterName=gpu-exporter-test\n"
            f"SlurmctldHost={node}(127.0.0.1)\n"
            f"SlurmctldPort={free_port()}\n"
            f"SlurmdPort={free_port()}\n"
            "SlurmUser=root\n"
            "SlurmdUser=root\n"
            "AuthType=auth/munge\n"
            "CredType=cred/munge\n"
            f"AuthInfo=socket={self.munge_socket}\n"
            f"StateSaveLocation={root}/state\n"
            f"SlurmdSpoolDir={root}/spool\n"
            f"SlurmctldPidFile={root}/run/slurmctld.pid\n"
            f"SlurmdPidFile={root}/run/slurmd.pid\n"
            f"SlurmctldLogFile={self.logs_dir}/slurmctld.log\n"
            f"SlurmdLogFile={self.logs_dir}/slurmd.log\n"
            "SlurmctldDebug=info\n"
            "SlurmdDebug=info\n"
            "MailProg=/bin/true\n"
            "MpiDefault=none\n"
            "ProctrackType=proctrack/cgroup\n"
            "TaskPlugin=task/cgroup\n"
            "SelectType=select/cons_tres\n"
            "SelectTypeParameters=CR_Core\n"
            # more CPUs than the host may have: each test job takes one, and several run at once
            "SlurmdParameters=config_overrides\n"
            "ReturnToService=2\n"
            "KillWait=5\n"
            "AccountingStorageType=accounting_storage/none\n"
            "JobCompType=jobcomp/none\n"
            "GresTypes=gpu\n"
            f"Prolog={prolog}\n"
            f"Epilog={epilog}\n"
            "PrologFlags=Alloc\n"
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} Gres=gpu:{len(names)} State=UNKNOWN\n"
            f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP\n"
        )
        (root / "etc" / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nConstrainDevices=no\n")
        (root / "etc" / "gres.conf").write_text(
            f"AutoDetect=off\nName=gpu File={folder}/nvidia[0-{len(names) - 1}]\n"
        )

    # -- the daemons ---------------------------------------------------------------------------

    def start(self, timeout: float = 30) -> None:
        """Start munged, slurmctld and slurmd; wait until the node is idle (else stop them all
        and raise :class:`ClusterDown` with their logs)."""
        try:
            key = self.root / "munge" / "munge.key"
            key.write_bytes(secrets.token_bytes(128))
            key.chmod(0o600)
            self._daemon(
                "munged",
                "munged",
                "--foreground",
                "--force",  # its socket in a directory only root can reach: pytest's
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self.root}/run/munged.pid",
                f"--log-file={self.logs_dir}/munged.log",
                f"--seed-file={self.root}/munge/munged.seed",
            )
            self._wait(self.munge_socket.exists, "munged's socket", timeout)
            self._daemon("slurmctld", "slurmctld", "-D", "-f", str(self.conf))
            self._daemon("slurmd", "slurmd", "-D", "-N", self.node, "-f", str(self.conf))
            self._wait(lambda: self.node_state() == "idle", f"node {self.node} idle", timeout)
        except BaseException:
            self.stop()
            raise

    def _daemon(self, name: str, *argv: str) -> None:
        out = (self.logs_dir / f"{name}.out").open("wb")
        self._outputs.append(out)
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.env
        )
        self.daemons.append((name, proc))

    def _wait(self, check: Callable[[], Any], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            ended = [
                f"{name} exited {p.returncode}" for name, p in self.daemons if p.poll() is not None
            ]
            if ended or time.monotonic() > deadline:
                why = ", ".join(ended) or f"{timeout:.0f} s"
                raise ClusterDown(f"the cluster is not up: no {what} ({why})\n{self.logs()}")
            time.sleep(0.1)

    def node_state(self) -> str:
        """The node's state as sinfo says it ("idle", "mixed", "alloc", ...; "" unknown)."""
        ran = self.run("sinfo", "--noheader", "--nodes", self.node, "--format", "%t", check=False)
        return ran.stdout.strip() if ran.returncode == 0 else ""

    def logs(self, lines: int = 25) -> str:
        """The last ``lines`` lines of each daemon's log and output."""
        out = []
        for path in sorted(self.logs_dir.iterdir()):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name} (last {len(text)} lines)\n" + "\n".join(text))
        return "\n".join(out)

    # -- the client commands -------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A client command (sbatch, squeue, ...) against this cluster."""
        ran = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env=self.env,
            stdin=subprocess.DEVNULL,
            timeout=30,
            cwd=self.root,
        )
        if check:
            assert ran.returncode == 0, f"{argv}: {ran.returncode} {ran.stderr}\n{self.logs()}"
        return ran

    def submit(self, *args: str) -> str:
        """``sbatch ARGS``, its output in ``job-<id>.out``; the job's id."""
        output = f"--output={self.root}/job-%j.out"
        return self.run("sbatch", "--parsable", output, *args).stdout.strip().split(";")[0]

    def output(self, job: str) -> str:
        """What job ``job`` has written so far."""
        return _read(str(self.root / f"job-{job}.out")).decode(errors="replace")

    def jobs(self) -> set[str]:
        """The jobs squeue lists (pending, running, completing)."""
        return set(self.run("squeue", "--noheader", "--format", "%i").stdout.split())

    # -- the end -------------------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` has run."""
        return self._stopped is not None

    def stop(self) -> list[str]:
        """Cancel every job and wait until none is left, stop slurmd, slurmctld and munged
        (SIGTERM, SIGKILL after 10 s), remove Slurm's empty cgroups; what was still running
        after, killed (empty: nothing). The second call returns the first's answer."""
        if self._stopped is not None:
            return self._stopped
        if all(p.poll() is None for _, p in self.daemons) and self.daemons:
            with contextlib.suppress(AssertionError, subprocess.SubprocessError, OSError):
                self._cancel_all()
        for _, proc in reversed(self.daemons):  # slurmd, slurmctld, munged
            stop(proc, 10)
        for out in self._outputs:
            out.close()
        left = self.leftovers()
        for pid, _ in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.remove_cgroups()
        self._stopped = [what for _, what in left]
        return self._stopped

    def _cancel_all(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while (jobs := self.jobs()) and time.monotonic() < deadline:
            self.run("scancel", *sorted(jobs), check=False)
            time.sleep(0.2)
        # the job records go before their last slurmstepd: wait for it too
        while self._steps() and time.monotonic() < deadline:
            time.sleep(0.1)

    @staticmethod
    def _steps() -> list[int]:
        return [pid for pid, comm, state in processes() if comm == "slurmstepd" and state != "Z"]

    def cgroups(self) -> list[Path]:
        """Slurm's cgroup directories for this node, in every v1 hierarchy (deepest first)."""
        found: list[Path] = []
        for hierarchy in FREEZER.parent.iterdir():
            for top in (hierarchy / f"slurm_{self.node}", hierarchy / "slurm"):
                if top.is_dir() and not top.is_symlink():
                    found.extend(sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True))
                    found.append(top)
        return found

    def leftovers(self) -> list[tuple[int, str]]:
        """(pid, what) of each live process of this cluster: its daemons, a slurmstepd, a
        process in a job's cgroup or with this cluster's SLURM_CONF (a job's)."""
        mine = f"SLURM_CONF={self.conf}".encode()
        in_jobs: set[int] = set()
        for cgroup in self.cgroups():
            for line in _read(str(cgroup / "cgroup.procs")).split():
                in_jobs.add(int(line))
        left = []
        for pid, comm, state in processes():
            if state == "Z" or pid == os.getpid():
                continue
            daemon = any(p.pid == pid and p.poll() is None for _, p in self.daemons)
            environ = _read(f"/proc/{pid}/environ").split(b"\0")
            if daemon or comm in _SLURM_COMMS or pid in in_jobs or mine in environ:
                cmdline = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode().strip()
                where = _read(f"/proc/{pid}/cgroup").decode(errors="replace").strip()
                left.append((pid, f"{pid} {comm} [{cmdline}] cgroup {where!r}"))
        return left

    def remove_cgroups(self) -> None:
        """Remove the empty cgroups Slurm made for this node (best effort)."""
        for cgroup in self.cgroups():
            with contextlib.suppress(OSError):
                cgroup.rmdir()
