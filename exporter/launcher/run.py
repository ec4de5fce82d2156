"""``gpu-exporter run``: hold the GPUs' locks, run the job on them, forward signals, restart.

The job inherits the lock descriptors, so its GPUs stay reserved for as long as any process of
the job lives, even if this launcher is killed. Its exit status is passed on (128+N when a signal
N ended it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from exporter.launcher.acquire import Device, LocalGpus
from exporter.launcher.locks import SUFFIX as LOCK_SUFFIX
from exporter.launcher.locks import Reservation, lock_path
from exporter.procfs import file_identity, scan_fd_holders

RESTART_POLICIES = ("never", "on-failure", "always")
#: Backoff before restart N (N from 1) is min(BACKOFF_INITIAL * 2**(N-1), BACKOFF_MAX) seconds.
BACKOFF_INITIAL = 1.0
BACKOFF_MAX = 60.0
#: How long to wait, under the lock, for a finished attempt's GPU memory to come back.
RELEASE_TIMEOUT = 60.0
EXIT_NOT_FOUND, EXIT_NOT_EXECUTABLE = 127, 126


@dataclass(frozen=True)
class RunOptions:
    """How to supervise the job."""

    command: Sequence[str]
    restart: str = "never"
    max_restarts: int = 3
    backoff_initial: float = BACKOFF_INITIAL
    backoff_max: float = BACKOFF_MAX
    release_timeout: float = RELEASE_TIMEOUT


class _CannotStart(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Identified(Protocol):
    index: int
    uuid: str


def job_environment(devices: Sequence[_Identified]) -> dict[str, str]:
    """What a job needs to see exactly its GPUs, numbered as NVML numbers them."""
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(getattr(d, "cuda_id", "") or d.uuid for d in devices),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPU_EXPORTER_GPUS": ",".join(str(d.index) for d in devices),
    }


def exit_status(returncode: int) -> int:
    """A shell's view of a child's end: its code, or 128+N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """Runs the job (again, by the restart policy) with signals forwarded to it."""

    def __init__(
        self,
        gpus: LocalGpus,
        reservation: Reservation,
        devices: Sequence[Device],
        options: RunOptions,
        stderr: TextIO = sys.stderr,
    ) -> None:
        self.gpus = gpus
        self.reservation = reservation
        self.devices = list(devices)
        self.options = options
        self.stderr = stderr
        self._child: subprocess.Popen[bytes] | None = None
        self._own_group = not _interactive()
        self._stopping = threading.Event()

    def say(self, message: str) -> None:
        self.stderr.write(f"gpu-exporter: {message}\n")
        self.stderr.flush()

    def run(self) -> int:
        """Run until the job is done for good; returns its exit status."""
        previous = {
            sig: signal.signal(sig, self._forward) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.reservation.release()

    def _loop(self) -> int:
        env = {**os.environ, **job_environment(self.devices)}
        restarts = 0
        while True:
            try:
                status = self._attempt(env)
            except _CannotStart as exc:
                self.say(str(exc))
                return exc.status
            reason = self._no_restart(status, restarts)
            if reason:
                if self.options.restart != "never":
                    self.say(f"not restarting: {reason}")
                return status
            restarts += 1
            delay = min(
                self.options.backoff_initial * 2 ** (restarts - 1), self.options.backoff_max
            )
            self.say(
                f"job ended with status {status}; restart {restarts} of "
                f"{self.options.max_restarts} in {delay:g}s"
            )
            if self._stopping.wait(delay):
                return status

    def _attempt(self, env: dict[str, str]) -> int:
        self.reservation.inheritable()
        group: dict[str, Any] = {}
        if self._own_group:  # signals reach the job's workers too, once
            group = (
                {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
            )
        try:
            self._child = subprocess.Popen(
                list(self.options.command), env=env, pass_fds=self.reservation.fds, **group
            )
        except FileNotFoundError:
            raise _CannotStart(
                EXIT_NOT_FOUND, f"command not found: {self.options.command[0]}"
            ) from None
        except PermissionError:
            raise _CannotStart(
                EXIT_NOT_EXECUTABLE, f"command not executable: {self.options.command[0]}"
            ) from None
        return exit_status(self._child.wait())

    def _no_restart(self, status: int, restarts: int) -> str:
        """Why not to restart now ('' to restart)."""
        if self.options.restart == "never":
            return "restart never"
        if self._stopping.is_set():
            return "stopped by a signal"
        if self.options.restart == "on-failure" and status == 0:
            return "the job succeeded"
        if restarts >= self.options.max_restarts:
            return f"{restarts} restart(s) done, --max-restarts {self.options.max_restarts}"
        return self._gpus_ready()

    def _gpus_ready(self) -> str:
        """Wait under the lock until the last attempt's GPU memory is released; '' when it is.

        Released means: no process of the job is left (none holds our lock descriptors but us),
        and NVML no longer lists any process of it on our GPUs (the driver frees a context a
        little after its process ends).
        """
        deadline = time.monotonic() + self.options.release_timeout
        mine = {d.uuid for d in self.devices}
        locks = {file_identity(lock_path(self.gpus.lock_dir, uuid)): "job" for uuid in mine}
        job = {self._child.pid} if self._child is not None else set()
        while True:
            snapshot = self.gpus.sample()
            by_uuid = {g.uuid: g for g in snapshot.gpus}
            for uuid in mine:
                gpu = by_uuid.get(uuid)
                if gpu is None or not gpu.up:
                    return f"GPU {uuid} is down or lost ({gpu.error if gpu else 'gone'})"
            holders, _ = scan_fd_holders(self.gpus.proc_root, locks, (LOCK_SUFFIX,))  # type: ignore[arg-type]
            left = holders.get("job", set()) - {os.getpid()}
            job |= left  # every process seen holding the job's locks is the job's
            listed = [p.pid for u in mine for p in by_uuid[u].processes or () if p.pid in job]
            if not left and not listed:
                return ""
            if time.monotonic() >= deadline:
                limit = self.options.release_timeout
                return f"GPU memory of the last attempt not released after {limit:g}s"
            if self._stopping.wait(0.5):
                return "stopped by a signal"

    def _forward(self, signum: int, _frame: Any) -> None:
        """Pass SIGINT/SIGTERM on to the job (its whole process group when it has its own)."""
        self._stopping.set()
        child = self._child
        if child is None or child.poll() is not None:
            return
        if not self._own_group and signum == signal.SIGINT:
            return  # the terminal sent it to the job's (and our) process group already
        try:
            if self._own_group:
                os.killpg(child.pid, signum)
            else:
                os.kill(child.pid, signum)
        except ProcessLookupError:
            pass


def _interactive() -> bool:
    """A job on a terminal stays in our process group, so it can read from the terminal."""
    try:
        return os.isatty(sys.stdin.fileno()) and os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False
