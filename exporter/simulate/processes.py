"""The real processes of a scenario: started with the simulation, reaped when it stops.

Each spawned process is a child of the simulating process, started by ``subprocess`` alone: no
Python code runs between fork and exec (no ``preexec_fn``), so starting one is safe while other
threads run, as churn restarts do in the sampler's thread. A guard process (:class:`Guard`)
sends the children SIGTERM should the simulating process die without stopping them, even of
SIGKILL: the parent-death signal (``PR_SET_PDEATHSIG``) would need code in the child before
exec. See docs/simulate.md ("spawn").
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable

from exporter.config.yamlconf import ConfigError
from exporter.core.procfs import file_identity, scan_fd_holders
from exporter.simulate.scenario import Scenario, SimGpu, SimProcess

#: (GPU, entry): a process entry by its GPU's index in the scenario and its own in the GPU's list.
Key = tuple[int, int]

#: A job leader in its own session and process group: it holds the GPU's device node (NVML lists
#: it, as a CUDA process), starts the worker, and exits after ``orphan_after`` seconds. The worker
#: is left an orphan, as when a training process dies and leaves a DataLoader worker behind.
_ORPHAN_LEADER = (
    "import subprocess, sys, time\n"
    "held = tuple(int(fd) for fd in sys.argv[2].split(',') if fd)\n"
    "worker = subprocess.Popen(sys.argv[3:], stdin=subprocess.DEVNULL,"
    " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=held)\n"
    "print(worker.pid, flush=True)\n"
    "time.sleep(float(sys.argv[1]))\n"
)

#: The guard: reads ``+PID`` / ``-PID`` lines (watch, forget) from its standard input; ``exit``
#: ends it quietly. At end of file (the simulating process died: the kernel closed the pipe),
#: it sends SIGTERM to every PID it still watches.
_GUARD = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "pids, rest = set(), b''\n"
    "while chunk := os.read(0, 65536):\n"
    "    *lines, rest = (rest + chunk).split(b'\\n')\n"
    "    for line in lines:\n"
    "        if line == b'exit':\n"
    "            sys.exit()\n"
    "        (pids.add if line[:1] == b'+' else pids.discard)(int(line[1:]))\n"
    "for pid in pids:\n"
    "    try:\n"
    "        os.kill(pid, signal.SIGTERM)\n"
    "    except OSError:\n"
    "        pass\n"
)
#: The guard's last argument: how to tell it in /proc (``cmdline``).
GUARD_MARK = "gpu-exporter-simulation-guard"


def running(pid: int) -> bool:
    """True while ``pid`` lives (not exited, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def make_device_folder(gpus: Iterable[SimGpu], folder: str = "") -> str:
    """A folder of empty ``nvidiaN`` files, stand-ins for the GPUs' device nodes: ``folder``
    (its files made or emptied, readable by all: other containers' jobs open them), or a new
    temporary one."""
    where = folder or tempfile.gettempdir()
    try:
        root = folder or tempfile.mkdtemp(prefix="gpu-exporter-sim-dev-")
        for gpu in gpus:
            path = os.path.join(root, f"nvidia{gpu.minor_number}")
            with open(path, "w"):
                pass
            if folder:
                os.chmod(path, 0o666)
    except OSError as exc:
        advice = "" if folder else " (set TMPDIR to a writable folder)"
        raise ConfigError(
            "simulation",
            "",
            f"cannot make the simulated device nodes in {where}: {exc.strerror}{advice}",
        ) from None
    return root


def remove_device_folder(gpus: Iterable[SimGpu], root: str, made: bool) -> None:
    """Remove the stand-ins: the whole folder when :func:`make_device_folder` ``made`` it,
    else only its ``nvidiaN`` files."""
    if made:
        shutil.rmtree(root, ignore_errors=True)
        return
    for gpu in gpus:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(root, f"nvidia{gpu.minor_number}"))


class DeviceHolders:
    """The processes outside the simulation that hold a GPU's device stand-in open, read from
    ``/proc`` at most once per ``ttl`` seconds (one sample lists each GPU several times)."""

    def __init__(
        self, dev_root: str, gpus: Iterable[SimGpu], ttl: float = 0.1, root: str = "/proc"
    ) -> None:
        self._root = root
        self._ttl = ttl
        self._wanted: dict[tuple[str, int, int], str] = {}
        for gpu in gpus:
            identity = file_identity(os.path.join(dev_root, f"nvidia{gpu.minor_number}"))
            if identity is not None:
                self._wanted[identity] = str(gpu.minor_number)
        self._read_at = -math.inf
        self._holders: dict[str, set[int]] = {}

    def of(self, minor_number: int, excluded: Iterable[int]) -> list[int]:
        """The holders of ``/dev/nvidiaN`` (N: ``minor_number``) but ``excluded``, in order."""
        now = time.monotonic()
        if now - self._read_at >= self._ttl:
            self._holders = scan_fd_holders(self._root, self._wanted)[0] if self._wanted else {}
            self._read_at = now
        found = self._holders.get(str(minor_number), set()) - set(excluded) - {os.getpid()}
        return sorted(pid for pid in found if running(pid))


class Guard:
    """A helper process that stops the watched children if the simulating process dies first.

    It is started on the first :meth:`watch`, in a session of its own (a Ctrl-C for the agent's
    process group does not reach it), and ended by :meth:`close`. Without it (it could not
    start) the children are still stopped by :meth:`ScenarioProcesses.stop`.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._failed = False

    def watch(self, pid: int) -> None:
        if self._proc is None and not self._failed:
            self._start()
        self._send(b"+%d\n" % pid)

    def forget(self, pid: int) -> None:
        self._send(b"-%d\n" % pid)

    def close(self) -> None:
        """End the guard without signalling anything."""
        proc, self._proc = self._proc, None
        if proc is None or proc.stdin is None:
            return
        with contextlib.suppress(OSError):
            os.write(proc.stdin.fileno(), b"exit\n")
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _start(self) -> None:
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _GUARD, GUARD_MARK],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            import logging  # here only: importing the simulation need not load logging

            self._failed = True
            logging.getLogger(__name__).warning(
                "simulation: no guard process (%s): should this process be killed, "
                "the scenario's processes outlive it",
                exc,
            )

    def _send(self, line: bytes) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError):  # it was killed: nothing to guard with
                os.write(self._proc.stdin.fileno(), line)


class ScenarioProcesses:
    """The PIDs a scenario lists, and the processes it spawned for them.

    :meth:`start` starts every ``spawn`` entry once and resolves the ``pid`` ones; :meth:`stop`
    ends them all (SIGTERM, then SIGKILL after 2 s) and reaps them.
    """

    def __init__(self, scenario: Scenario, dev_root: str) -> None:
        self.scenario = scenario
        #: A folder of ``nvidiaN`` stand-ins; spawned processes hold theirs open.
        self.dev_root = dev_root
        self.pids: dict[Key, int] = {}
        self.children: list[subprocess.Popen[bytes]] = []
        self._orphans: list[int] = []
        #: The leader of an orphan's job, listed on the GPU while it lives.
        self._leaders: dict[Key, subprocess.Popen[bytes]] = {}
        self._periods: dict[Key, int] = {}  # churn: the period its process started in
        self._guard = Guard()

    def start(self) -> None:
        """Start the spawned processes and resolve the listed PIDs; raises ConfigError for a
        program that does not exist (having stopped what did start)."""
        try:
            for g, gpu in enumerate(self.scenario.gpus):
                for p, proc in enumerate(gpu.processes):
                    if proc.holders:
                        continue  # found at each listing (DeviceHolders)
                    if proc.spawn:
                        self.pids[(g, p)] = self._start(proc, (g, p))
                    elif proc.pid == "self":
                        self.pids[(g, p)] = os.getpid()
                    elif proc.pid == "parent":
                        self.pids[(g, p)] = os.getppid()
                    else:
                        self.pids[(g, p)] = int(proc.pid)  # type: ignore[arg-type]
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop and reap every process started (orphans: signalled, init reaps them)."""
        for child in self.children:
            with contextlib.suppress(OSError):
                child.terminate()
        for pid in self._orphans:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self._orphans.clear()
        for leader in self._leaders.values():
            with contextlib.suppress(OSError):
                leader.kill()
            leader.wait()
        self._leaders.clear()
        for child in self.children:
            try:
                child.wait(timeout=2)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            self._guard.forget(child.pid)
        self.children.clear()
        self._guard.close()

    def started(self) -> set[int]:
        """The PIDs of every process the simulation started and still watches."""
        leaders = {leader.pid for leader in self._leaders.values()}
        return {child.pid for child in self.children} | set(self._orphans) | leaders

    def leader(self, key: Key) -> int | None:
        """The PID of an orphan entry's job leader while it lives (reaped once it ends)."""
        leader = self._leaders.get(key)
        return leader.pid if leader is not None and leader.poll() is None else None

    def churn(self, key: Key, proc: SimProcess, period: int) -> int | None:
        """The PID a churning ``spawn`` entry lists in ``period``: its process while that runs
        in that period; otherwise the process is killed and reaped and the program started
        again. None when it cannot start now (tried again at the next listing)."""
        pid = self.pids.get(key)
        child = next((c for c in self.children if c.pid == pid), None)
        if child is not None and self._periods.get(key, 0) == period and child.poll() is None:
            return pid
        if child is not None:
            self.children.remove(child)
            with contextlib.suppress(OSError):
                child.kill()
            child.wait()
            self._guard.forget(child.pid)
        self.pids.pop(key, None)
        try:
            pid = self._start(proc, key)
        except (OSError, ConfigError):  # no fork now (EAGAIN, ENOMEM), or the program is gone
            return None
        self.pids[key], self._periods[key] = pid, period
        return pid

    def _start(self, proc: SimProcess, key: Key) -> int:
        g, p = key
        argv = list(proc.spawn)
        if argv[0] in ("python", "python3"):  # the interpreter running the agent
            argv[0] = sys.executable
        if shutil.which(argv[0]) is None:
            raise ConfigError(
                proc.where or "scenario",
                f"gpus[{g}].processes[{p}].spawn",
                f"cannot start {argv[0]!r}: no such program",
            )
        # The device stays open in the process, as a CUDA context keeps /dev/nvidiaN open.
        device = os.path.join(self.dev_root, f"nvidia{self.scenario.gpus[g].minor_number}")
        fd = os.open(device, os.O_RDONLY) if proc.holds_device else None
        held = (fd,) if fd is not None else ()
        try:
            if proc.orphan:
                return self._start_orphan(proc, key, argv, held)
            child = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=held,
                # as a job on a GPU host: its own session, never the agent's (which may read as
                # sid 0: under an init that never calls setsid, or from outside its namespace)
                start_new_session=True,
            )
        finally:
            if fd is not None:
                os.close(fd)
        self.children.append(child)
        self._guard.watch(child.pid)
        return child.pid

    def _start_orphan(
        self, proc: SimProcess, key: Key, argv: list[str], held: tuple[int, ...]
    ) -> int:
        lives, fds = str(proc.orphan_after), ",".join(map(str, held))
        leader = subprocess.Popen(
            [sys.executable, "-c", _ORPHAN_LEADER, lives, fds, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=held,
        )
        assert leader.stdout is not None
        with leader.stdout:
            pid = int(leader.stdout.readline())
        self._leaders[key] = leader
        self._orphans.append(pid)
        return pid
